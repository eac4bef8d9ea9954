"""Every place that lists the model families names every registered one: --help's description, the verbs'
--for_model choices, the model card's last line (all three derived from the registry), and the docs, the README and
pyproject's description (written by hand, checked here)."""

import re

import pytest
import tomllib
from conftest import REPO

from spmdlm.cli import prepare, tokenizer
from spmdlm.cli.launch import build_parser, family_choices
from spmdlm.families import families, preset_names
from spmdlm.train import publish

NAMES = list(families())


def named(text: str) -> list[str]:
    """The registered families `text` does not name (GPT-2 names gpt2, T5 v1.1 t5, Qwen3 qwen3: case and hyphens
    aside)."""
    flat = text.lower().replace("-", "")
    return [name for name in NAMES if name not in flat]


def opening(path) -> str:
    """A document's text before its first `## ` section."""
    return path.read_text().split("\n## ", 1)[0]


def test_the_registry_has_the_seven_families():
    assert sorted(NAMES) == ["bart", "gpt2", "llama", "modernbert", "qwen3", "roberta", "t5"]


def test_help_names_every_family_with_its_objective():
    description = build_parser(family_choices()).description
    first = " ".join(description.split("\n\n")[0].split())
    assert named(first) == [], first
    assert "gpt2 (causal LM)" in first and "roberta (masked LM)" in first and "t5 (span corruption)" in first


@pytest.mark.parametrize("parser", [prepare.build_parser, tokenizer.build_parser], ids=["prepare", "tokenizer"])
def test_for_model_offers_every_family(parser):
    (action,) = [a for a in parser()._actions if "--for_model" in a.option_strings]
    assert sorted(action.choices) == sorted(NAMES)


def test_the_model_card_s_last_line_names_every_family():
    line = publish.trained_with()
    assert named(line) == [] and line.startswith("Trained with spmdlm ")


@pytest.mark.parametrize(
    "where,text",
    [
        ("README.md (opening)", lambda: opening(REPO / "README.md")),
        ("docs/generation.md (opening)", lambda: opening(REPO / "docs" / "generation.md")),
        (
            "pyproject.toml description",
            lambda: tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["description"],
        ),
    ],
)
def test_the_hand_written_lists_name_every_family(where, text):
    assert named(text()) == [], where


def test_every_for_model_list_in_the_docs_is_whole():
    found = {}
    for path in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]:
        for listed in re.findall(r"--for_model ((?:[a-z0-9]+\|)+[a-z0-9]+)", path.read_text()):
            found.setdefault(path.name, []).append(listed)
    assert found, "no --for_model a|b|c list in the docs"
    for name, lists in found.items():
        for listed in lists:
            assert sorted(listed.split("|")) == sorted(NAMES), f"{name}: --for_model {listed}"


def test_the_training_guide_lists_every_preset():
    section = (REPO / "docs" / "training.md").read_text()
    bullet = section[section.index("- Model: `--config_name`") :].split("\n- ", 1)[0]
    assert [p for p in preset_names() if f"`{p}`" not in bullet] == [], bullet
    assert named(bullet) == []
