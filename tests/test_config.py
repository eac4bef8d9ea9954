"""Command lines: the HF recipes' flags are accepted unchanged, argument files work, defaults never crash."""

import dataclasses
import json
import re
import shlex
from pathlib import Path

import pytest

from spmdlm.cli.launch import family_choices, parse_args
from spmdlm.errors import ArgumentError
from spmdlm.families import all_presets
from spmdlm.run_args import RunArgs
from spmdlm.run_args.choices import quickstart
from spmdlm.run_args.sections import (
    ControlArgs,
    DataArgs,
    OperationsArgs,
    OptimizationArgs,
    OutputArgs,
    ReportingArgs,
)

GPT2_RECIPE = """--output_dir=./norwegian-gpt2 --model_type=gpt2 --config_name=./norwegian-gpt2
--tokenizer_name=./norwegian-gpt2 --train_file=corpus.txt --do_train --do_eval --block_size=512
--per_device_train_batch_size=64 --per_device_eval_batch_size=64 --learning_rate=5e-3 --warmup_steps=1000
--adam_beta1=0.9 --adam_beta2=0.98 --weight_decay=0.01 --overwrite_output_dir --num_train_epochs=20
--logging_steps=500 --save_steps=2500 --eval_steps=2500 --push_to_hub"""

T5_RECIPE = """--output_dir=./norwegian-t5-base --model_type=t5 --config_name=./norwegian-t5-base
--tokenizer_name=./norwegian-t5-base --train_file=corpus.txt --max_seq_length=512 --per_device_train_batch_size=32
--per_device_eval_batch_size=32 --adafactor --learning_rate=0.005 --weight_decay=0.001 --warmup_steps=2000
--overwrite_output_dir --logging_steps=500 --save_steps=10000 --eval_steps=2500 --push_to_hub"""


ROBERTA_RECIPE = """--output_dir=./norwegian-roberta-base --model_type=roberta --config_name=./norwegian-roberta-base
--tokenizer_name=./norwegian-roberta-base --train_file=corpus.txt --max_seq_length=128 --weight_decay=0.01
--per_device_train_batch_size=128 --per_device_eval_batch_size=128 --learning_rate=3e-4 --warmup_steps=1000
--overwrite_output_dir --num_train_epochs=18 --adam_beta1=0.9 --adam_beta2=0.98 --logging_steps=500
--save_steps=2500 --eval_steps=2500 --push_to_hub"""

BART_RECIPE = """--output_dir=./norwegian-bart-base --config_name=./norwegian-bart-base
--tokenizer_name=./norwegian-bart-base --train_file=corpus.txt --max_seq_length=1024 --per_device_train_batch_size=32
--per_device_eval_batch_size=32 --learning_rate=1e-4 --warmup_steps=2000 --overwrite_output_dir --logging_steps=500
--save_steps=2000 --eval_steps=2000 --push_to_hub"""


def test_roberta_and_bart_recipes_are_accepted_unchanged():
    args, _ = parse_args(shlex.split(ROBERTA_RECIPE))
    assert (
        args.model.model_type == "roberta"
        and args.objective["max_seq_length"] == 128
        and args.control.num_train_epochs == 18
    )
    args, _ = parse_args(shlex.split(BART_RECIPE))
    # no --model_type: the config's model_type decides (the recipe's config says bart)
    assert (
        args.model.model_type is None
        and args.objective["max_seq_length"] == 1024
        and args.optimization.learning_rate == 1e-4
    )


def test_gpt2_recipe_is_accepted_unchanged():
    args, given = parse_args(shlex.split(GPT2_RECIPE))
    assert (
        args.model.model_type == "gpt2"
        and args.objective["block_size"] == 512
        and args.optimization.learning_rate == 5e-3
    )
    assert (
        args.control.do_train and args.control.do_eval and args.control.overwrite_output_dir and args.output.push_to_hub
    )
    assert (
        args.control.num_train_epochs == 20
        and args.optimization.adam_beta2 == 0.98
        and args.reporting.eval_steps == 2500
    )
    assert (
        "max_steps" not in given and args.control.max_steps == -1
    )  # quick-start defaults only for the embedded corpus


def test_t5_recipe_is_accepted_unchanged():
    args, _ = parse_args(shlex.split(T5_RECIPE))
    assert args.model.model_type == "t5" and args.optimization.adafactor and args.objective["max_seq_length"] == 512
    assert (
        args.control.training and args.control.evaluating
    )  # the recipe gives neither --do_train nor --do_eval: both run


RECIPES = sorted((Path(__file__).parent.parent / "launch" / "recipes").glob("*.json"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[path.stem for path in RECIPES])
def test_every_recipe_parses_names_its_family_and_is_in_the_readme(recipe):
    args, _ = parse_args([str(recipe)])
    # BART's keeps the HF command's missing --model_type: the config's model_type decides
    assert args.model.model_type in (None, all_presets()[args.model.config_name]["model_type"])
    assert args.model.dtype == "bfloat16" and args.devices.mesh
    assert f"| `{recipe.name}` |" in (recipe.parent / "README.md").read_text()


def test_a_preset_config_name_alone_takes_its_own_familys_quickstart():
    args, _ = parse_args(["--config_name", "modernbert-base", "--max_seq_length", "256"])
    assert args.objective["block_size"] is None and args.objective["max_seq_length"] == 256


def test_defaults_never_crash():
    args, _ = parse_args(["--train_file", "x.txt"])
    assert (
        args.reporting.eval_steps == args.reporting.logging_steps == 500
    )  # HF's eval_steps=None crashed on `step % None`
    assert (
        args.objective["block_size"] is None and args.objective["max_seq_length"] is None
    )  # resolved from the model later


def test_embedded_corpus_uses_the_quickstart_unless_overridden():
    args, _ = parse_args(["--max_steps", "7"])
    assert (
        args.model.config_name == quickstart(family_choices(), "gpt2")["config_name"] == "gpt2-tiny"
        and args.control.max_steps == 7
    )
    args, _ = parse_args(["--model_type", "t5"])
    assert (
        args.model.config_name == "t5-v1_1-tiny"
        and args.optimization.adafactor
        and args.objective["max_seq_length"] == 128
    )
    assert args.control.output_dir == "runs/t5-v1_1-tiny-stdlib"
    for family in ("roberta", "bart"):
        args, _ = parse_args(["--model_type", family])
        assert args.model.config_name == f"{family}-tiny" and args.control.output_dir == f"runs/{family}-tiny-stdlib"


def test_the_default_output_dir_is_named_after_the_model_and_the_data():
    output_dir = lambda *argv: parse_args(list(argv))[0].control.output_dir
    assert output_dir() == "runs/gpt2-tiny-stdlib"  # the README's first command: as before
    assert (
        output_dir(
            "--model_type", "roberta", "--config_name", "roberta-tiny", "--train_file", "/usr/share/games/fortunes/de/"
        )
        == "runs/roberta-tiny-de"
    )
    assert output_dir("--model_type", "roberta", "--train_file", "corpus/*.txt") == "runs/roberta-base-corpus"
    assert (
        output_dir(
            "--model_type",
            "t5",
            "--config_name",
            "conf/t5-small.json",
            "--train_file",
            "licenses/Apache-2.0,docs/notes.txt.gz",
        )
        == "runs/t5-small-Apache-2+notes"
    )
    assert output_dir("--train_file", "news/*.jsonl:0.6,wiki/:0.4") == "runs/gpt2-news+wiki"
    assert output_dir("--dataset_dir", "data/gpt2-1024/", "--model_type", "gpt2") == "runs/gpt2-gpt2-1024"
    assert output_dir("--train_file", "x.txt", "--output_dir", "mine") == "mine"


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_argument_file(tmp_path, suffix):
    values = {
        "train_file": "a.txt",
        "learning_rate": 0.1,
        "do_train": True,
        "mesh": "data=2,fsdp=-1",
        "block_size": "16",
    }
    path = tmp_path / f"args{suffix}"
    path.write_text(json.dumps(values))  # JSON is valid YAML
    args, _ = parse_args([str(path)])
    assert (
        args.optimization.learning_rate == 0.1
        and args.control.do_train
        and args.devices.mesh == "data=2,fsdp=-1"
        and args.objective["block_size"] == 16
    )
    path.write_text(json.dumps({**values, "learning_rte": 1}))
    with pytest.raises(ArgumentError, match="unknown keys learning_rte"):
        parse_args([str(path)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "float16"], "--dtype"),
        (["--per_device_train_batch_size", "0"], "at least 1"),
        (["--mlm_probability", "1.5"], r"--mlm_probability must be in \(0, 1\), got 1.5"),
        (["--dataset_name", "oscar"], "--train_file"),
        (["--lr_scheduler_type", "foo"], "lr_scheduler_type"),
        (["--block_size", "0"], "--block_size must be at least 1"),
        (["--save_total_limit", "0"], "--save_total_limit must be at least 1"),
        (["--max_train_samples", "-3"], "--max_train_samples must be at least 1"),
        (["--remat", "some"], "--remat must be one of auto, none, dots, dots_with_attention, qkv, full"),
        (["--scan_unroll", "-1"], "--scan_unroll must be auto, 0"),
        (["--scan_unroll", "some"], "--scan_unroll must be auto, 0"),
    ],
)
def test_bad_values(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(["--train_file", "x.txt", *argv])


def test_boolean_flags_take_values_like_hf():
    args, _ = parse_args(["--train_file", "x", "--do_train", "false", "--export_hf=False", "--no_do_eval"])
    assert args.control.do_train is False and args.output.export_hf is False and args.control.do_eval is False


def test_remat_defaults_to_auto_and_gradient_checkpointing_means_full():
    args = parse_args(["--train_file", "x"])[0]
    assert (args.optimization.remat, args.optimization.scan_unroll) == ("auto", "auto")
    assert parse_args(["--train_file", "x", "--gradient_checkpointing"])[0].optimization.remat == "full"


def test_help_is_grouped_with_each_default_once_and_the_presets_listed():
    from spmdlm.cli.launch import build_parser
    from spmdlm.families import preset_names
    from spmdlm.run_args import SECTIONS

    text = build_parser(family_choices()).format_help()
    assert text.startswith("usage: python -m spmdlm.launch [ARGS_FILE.json|.yaml] [--flag VALUE ...]\n")
    for title in ["objective", *(section.TITLE for section in SECTIONS.values())]:
        assert f"\n{title}:\n" in text
    flat = " ".join(text.split())
    assert "(default: None)" not in flat and not re.search(r"default[^()]*\) \(default:", flat)  # one per flag
    assert "quick-start values" in flat and "gpt2: config_name=gpt2-tiny" in flat
    assert all(name in flat for name in preset_names())


def test_an_unknown_model_type_names_the_families():
    families = "bart, gpt2, llama, modernbert, qwen3, roberta, t5"
    with pytest.raises(ArgumentError, match=f"'robertaa' is not a model family; use one of {families}"):
        parse_args(["--model_type", "robertaa"])


def test_a_run_config_written_before_the_sections_reads_back_whole():
    """run_config.json as the flat RunArgs wrote it (the default run's): every flag and objective flag reads back
    into its section with the value recorded, and is written again as it was (a resume compares them)."""
    saved = json.loads((Path(__file__).parent / "golden" / "run_config_before_sections.json").read_text())
    now = RunArgs.of_run(saved).to_json()
    newer = set(now) - set(saved)  # flags added since that file: the operations section, the EMA's, the monitors',
    added = {"ema_decay", "ema_start", "monitor_every", "monitor_warn_factor", "batch_size_ramp"}  # the batch ramp,
    added |= {"lr_scheduler_on_extension"}  # and what a longer run does to the schedule
    assert newer == {field.name for field in dataclasses.fields(OperationsArgs)} | added
    assert {k: now[k] for k in newer} == {k: v for k, v in RunArgs().to_json().items() if k in newer}
    assert {k: v for k, v in now.items() if k not in newer} == {k: saved[k] for k in now if k not in newer}


@pytest.mark.parametrize(
    "section, values, message",
    [
        (DataArgs, dict(train_file="a.txt", dataset_dir="d"), "give one of --train_file, --data_mixture"),
        (ControlArgs, dict(seed=-1), "--seed must be in"),
        (ReportingArgs, dict(eval_tasks_steps=5), "--eval_tasks_steps apply to --eval_tasks"),
        (OptimizationArgs, dict(lr_scheduler_type="constant", min_lr_ratio=0.1), "--min_lr_ratio applies to"),
        (OutputArgs, dict(push_to_hub=True, export_hf=False), "--push_to_hub uploads the export"),
    ],
)
def test_each_section_refuses_its_own_bad_values_when_made(section, values, message):
    with pytest.raises(ArgumentError, match=message):
        section(**values)
    with pytest.raises(ArgumentError, match=message):  # and so does a run's arguments given them by flag name
        RunArgs.of(values)
