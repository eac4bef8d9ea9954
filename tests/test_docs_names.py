"""Every dotted name `spmdlm.X.Y` the README and docs/ mention resolves: a module that imports, or an attribute of
one (a function, a class, a constant), or one of the entry-point groups plugins register under. A name that moved
(`spmdlm.export.load_hf`, which lives in `spmdlm.hf_export`) breaks no link, so only this notices it."""

import importlib
import re

import pytest
from test_docs_links import PAGES, REPO

from spmdlm.families import ENTRY_POINT_GROUP
from spmdlm.optimizers import OPTIMIZER_GROUP, SCHEDULE_GROUP

NAME = re.compile(r"(?<![\w./-])spmdlm(?:\.[A-Za-z_]\w*)+")  # not a path (spmdlm/x.py) nor part of a longer name
GROUPS = {ENTRY_POINT_GROUP, OPTIMIZER_GROUP, SCHEDULE_GROUP}  # named in the docs, imported by no one


def resolves(name: str) -> bool:
    """The longest prefix of `name` that imports, then the rest as its attributes."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            if not hasattr(found, attribute):
                return False
            found = getattr(found, attribute)
        return True
    return False


def names(page) -> set[str]:
    return {match.rstrip(".") for match in NAME.findall(page.read_text())}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_dotted_name_the_docs_mention_resolves(page):
    missing = sorted(name for name in names(page) - GROUPS if not resolves(name))
    assert not missing, f"{page.relative_to(REPO)} names what does not exist: {missing}"


def test_the_check_sees_the_names_and_can_fail():
    assert "spmdlm.hf_export.load_hf" in names(REPO / "docs" / "export.md")
    assert resolves("spmdlm.hf_export.load_hf") and resolves("spmdlm.data.tokenization")
    assert not resolves("spmdlm.export.load_hf") and not resolves("spmdlm.nonesuch.x")
