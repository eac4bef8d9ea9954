"""The model card of every export and --push_to_hub, against a loopback Hub emulator (tests/hub_emulator.py): nothing
here reaches the real Hub."""

import dataclasses
import json
import math
import socket
from pathlib import Path

import huggingface_hub
import pytest
from conftest import STDLIB_JSON, run_argv
from family_fixtures import FIXTURES
from flax import nnx
from hub_emulator import USER, HubEmulator
from huggingface_hub import ModelCard

from spmdlm import hf_export, storage
from spmdlm.cli.launch import main, parse_args
from spmdlm.errors import ArgumentError
from spmdlm.families import get_family
from spmdlm.families.base import Generation
from spmdlm.hf_export import export_complete, save_hf
from spmdlm.train import publish
from spmdlm.train import run as train_run
from spmdlm.train.prepared import Prepared
from spmdlm.train.stages import corpora, resolve
from spmdlm.train.stages.outputs import OutputDir

TOKEN = "hf_emulated_token"
CARD_FLAGS = ("--card_license", "apache-2.0", "--card_tags", "tiny,code", "--card_datasets", "someone/stdlib-json")
RESULTS = {
    "eval_loss": 2.5,
    "eval_perplexity": math.exp(2.5),
    "eval_accuracy": 0.25,
    "eval_tokens": 512.0,
    "eval_bits_per_byte": 1.25,
    "eval_bytes": 1024,
    "train_loss": 2.75,
}


@pytest.fixture
def hub(monkeypatch):
    """The emulator, with HF_ENDPOINT pointing at it (read by spmdlm when a run starts); reachable also where
    HF_HUB_OFFLINE=1 keeps the real Hub out (huggingface_hub read it at import)."""
    with HubEmulator() as emulator:
        monkeypatch.setenv("HF_ENDPOINT", emulator.url)
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
        yield emulator


def flags(family: str, out: Path, config: Path, cache_dir: Path, *extra: str) -> list[str]:
    sizes = dict(per_device_train_batch_size=2, per_device_eval_batch_size=2, max_eval_samples=16)
    steps = dict(logging_steps=2, max_steps=4)
    return run_argv(out, config, cache_dir, *FIXTURES[family].run_flags, *extra, model_type=family, **sizes, **steps)


def run_context(argv: list[str]) -> Prepared:
    """The records a run of `argv` has when it finishes, without training: resolved, tokenizer, data."""
    args, _ = parse_args(argv)
    return train_run.prepare(resolve.resolve(args, 0.0), OutputDir("fresh"), corpora.read_corpora(args.data))


def export_untrained(prepared: Prepared, folder) -> None:
    """The run's model as initialised, exported to `folder`."""
    family, config = prepared.run.family, prepared.vocabulary.config
    save_hf(family.make_model(config, rngs=nnx.Rngs(0)), config, folder, tokenizer=prepared.vocabulary.tokenizer)


def run_snippet(card: ModelCard, model_id: str, folder: Path) -> None:
    """The card's usage snippet, run against the local export instead of the Hub."""
    code = card.text.split("```python\n", 1)[1].split("```", 1)[0]
    assert f'model_id = "{model_id}"' in code
    exec(code.replace(f'model_id = "{model_id}"', f"model_id = {str(folder)!r}"), {})


# -- the model card ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", FIXTURES)
def test_every_family_gets_a_card_with_its_results_metadata_and_usage(
    family, tmp_path, tiny_configs, cache_dir, capsys
):
    prepared = run_context(flags(family, tmp_path / "run", tiny_configs[family], cache_dir, *CARD_FLAGS))
    folder = tmp_path / "run" / "hf"
    export_untrained(prepared, folder)
    publish.write_model_card(folder, prepared, RESULTS)

    card = ModelCard.load(folder / "README.md")
    data = card.data
    kind = get_family(family).generation  # what the family's export is for, as its card says
    task = {Generation.FILL_MASK: "fill-mask", Generation.DECODER_ONLY: "text-generation"}.get(
        kind, "text2text-generation"
    )
    assert data.library_name == "transformers" and data.pipeline_tag == task and data.license == "apache-2.0"
    assert data.tags == [family, "spmdlm", task, "tiny", "code"] and data.datasets == ["someone/stdlib-json"]
    assert data.model_name == "run"
    found = {r.metric_type: r.metric_value for r in data.eval_results}
    assert found == {
        "loss": RESULTS["eval_loss"],
        "perplexity": RESULTS["eval_perplexity"],
        "accuracy": RESULTS["eval_accuracy"],
        "bits_per_byte": RESULTS["eval_bits_per_byte"],
    }
    assert {(r.task_type, r.dataset_type, r.dataset_name) for r in data.eval_results} == {
        (task, "someone/stdlib-json", "someone/stdlib-json")
    }
    text = card.text
    assert f"{publish.parameter_count(folder):,} parameters" in text
    assert "global batch 16 examples (2 per device x 8 batch devices x 1 accumulation)" in text
    assert "mesh: data=8 over 8 cpu devices" in text and f"`{STDLIB_JSON}`" in text
    assert "| eval_loss | 2.5 |" in text and "Trained with spmdlm " in text
    expected = {
        Generation.FILL_MASK: 'pipeline("fill-mask"',
        Generation.DECODER_ONLY: "AutoModelForCausalLM.from_pretrained",
    }
    assert expected.get(kind, "AutoModelForSeq2SeqLM.from_pretrained") in text
    assert hf_export.TORCH_CPU_INSTALL in text  # transformers' side needs PyTorch; spmdlm.generate does not
    assert "python -m spmdlm.generate --model_name_or_path run/hf" in text and str(folder) not in text
    assert ("--fill_mask" in text) == (kind == Generation.FILL_MASK)
    capsys.readouterr()
    run_snippet(card, "run/hf", folder)  # the local export (a relative path, never an absolute one): nothing was pushed
    assert capsys.readouterr().out  # it printed what the (random) model made of the example


def test_a_card_without_metadata_flags_or_results(tmp_path, tiny_configs, cache_dir):
    prepared = run_context(flags("gpt2", tmp_path / "run", tiny_configs["gpt2"], cache_dir))
    folder = tmp_path / "run" / "hf"
    export_untrained(prepared, folder)
    publish.write_model_card(folder, prepared, {}, step=2)
    data = ModelCard.load(folder / "README.md").data
    assert data.license is None and data.datasets is None and data.eval_results is None
    assert data.tags == ["gpt2", "spmdlm", "text-generation"]
    assert "step 2 of 4" in (folder / "README.md").read_text()


def test_a_family_from_elsewhere_gets_the_usage_of_what_it_declares():
    family = dataclasses.replace(get_family("gpt2"), name="mine", hf_auto_class="AutoModel", generation=Generation.NONE)
    code = hf_export.usage_snippet(family, "user/mine")
    compile(code, "snippet", "exec")
    assert "from transformers import AutoModel," in code and "generate" not in code
    assert publish.TASKS[family.generation] == "feature-extraction"


# -- uploads ---------------------------------------------------------------------------------------------------------
def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("xet", [True, False], ids=["pipelined", "single-commit"])
def test_uploads_create_the_repository_once_and_send_every_file(hub, tmp_path, monkeypatch, xet):
    # with hf_xet installed upload_folder streams through its pipeline; without it, one create_commit
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", not xet)
    folder, other = tmp_path / "hf", tmp_path / "checkpoint"
    for path, text in (
        ("config.json", "{}"),
        ("README.md", "---\nlicense: mit\n---\n# x\n"),
        ("sub/model.bin", "weights"),
    ):
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)
    target = publish.Hub("tiny", endpoint=hub.url, token=TOKEN, private=True, export_dir=folder)
    assert target.upload(folder, "first")
    assert target.upload(folder, "again")
    (other / "old").mkdir(parents=True)
    (other / "old" / "a").write_text("1")
    assert target.upload(other, "checkpoint 1", path_in_repo="last-checkpoint", replace=True)
    (other / "old" / "a").unlink()
    (other / "new").write_text("2")
    assert target.upload(other, "checkpoint 2", path_in_repo="last-checkpoint", replace=True)

    assert target.repo_id == f"{USER}/tiny"
    (create,) = hub.calls("create")
    assert {k: create.json().get(k) for k in ("name", "organization", "visibility")} == {
        "name": "tiny",
        "organization": None,
        "visibility": "private",
    }
    repo = hub.repos[f"{USER}/tiny"]
    assert repo.private
    assert repo.commits == ["spmdlm: first", "spmdlm: again", "spmdlm: checkpoint 1", "spmdlm: checkpoint 2"]
    assert repo.files == {**folder_files(folder), "last-checkpoint/new": b"2"}
    assert {r.headers.get("authorization") for r in hub.requests} == {f"Bearer {TOKEN}"}


def test_an_export_in_a_bucket_gets_its_card_and_is_uploaded(gcs_bucket, hub, tmp_path, tiny_configs, cache_dir):
    prepared = run_context(flags("gpt2", tmp_path / "run", tiny_configs["gpt2"], cache_dir))
    local, remote = tmp_path / "hf", storage.path(f"{gcs_bucket}/publish/hf")
    export_untrained(prepared, local)
    storage.upload(local, remote)
    publish.write_model_card(remote, prepared, RESULTS)
    card = (remote / "README.md").read_bytes()
    assert f'model_id = "{remote}"'.encode() in card  # the snippet loads the export where it is
    target = publish.Hub("in-a-bucket", endpoint=hub.url, token=TOKEN, private=False, export_dir=remote)
    assert target.upload(remote, "the export")
    assert hub.repos[f"{USER}/in-a-bucket"].files == {**folder_files(local), "README.md": card}


def warnings_of(text: str) -> list[str]:
    return [line for line in text.splitlines() if "WARNING" in line]


def nobody_listening() -> str:
    """The URL of a loopback port nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("server", ["commit refused", "nothing listening", "never answering"])
def test_a_failed_upload_is_one_warning_line(server, hub, tmp_path, caplog, request):
    hub.fail["commit"] = 403
    url = {
        "commit refused": lambda: hub.url,
        "nothing listening": nobody_listening,
        "never answering": lambda: request.getfixturevalue("silent_server"),
    }[server]()
    (tmp_path / "a").write_text("x")
    target = publish.Hub("tiny", endpoint=url, token=TOKEN, private=False, export_dir=tmp_path)
    with caplog.at_level("INFO"):
        assert not target.upload(tmp_path, "a folder")
    (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
    message = record.getMessage()
    assert "\n" not in message and url in message and "tiny" in message and "unaffected" in message
    assert ("403" in message and "--hub_token" in message) if server == "commit refused" else "hf upload" in message
    assert ("no answer within 2 s" in message) == (server == "never answering")


def test_the_run_refuses_a_bad_repository_id_or_no_token_before_it_starts(tmp_path, monkeypatch):
    args, _ = parse_args(["--output_dir", str(tmp_path / "a run"), "--push_to_hub", "--hub_token", TOKEN])
    run = resolve.resolve(args, 0.0)
    with pytest.raises(ArgumentError, match="output dir's name .* is not a Hub repository id.*--hub_model_id"):
        publish.hub_for(run)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    run = dataclasses.replace(run, args=args.replace(hub_model_id="user/fine", hub_token=None))
    with pytest.raises(ArgumentError, match="needs a Hub token"):
        publish.hub_for(run)


def test_the_token_comes_from_the_login_and_the_endpoint_from_HF_ENDPOINT(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_the_environment")
    args, _ = parse_args(["--output_dir", str(tmp_path / "run"), "--push_to_hub"])
    target = publish.hub_for(resolve.resolve(args, 0.0))
    assert target.repo_id == "run" and target.endpoint == hub.url and target.create()
    assert hub.calls("create")[0].headers["authorization"] == "Bearer hf_from_the_environment"
    assert "visibility" not in hub.calls("create")[0].json()  # not private: the hub's default


# -- through the launcher ------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_run_pushes_its_export_card_and_checkpoints(hub, tmp_path, tiny_configs, cache_dir):
    out = tmp_path / "run"
    assert (
        main(
            flags(
                "gpt2",
                out,
                tiny_configs["gpt2"],
                cache_dir,
                "--save_steps",
                "2",
                "--push_to_hub",
                "--hub_strategy",
                "checkpoint",
                "--hub_model_id",
                "tiny-gpt2",
                "--hub_private_repo",
                "--hub_token",
                TOKEN,
                *CARD_FLAGS,
            )
        )
        == 0
    )
    assert len(hub.calls("create")) == 1 and hub.calls("create")[0].json()["visibility"] == "private"
    repo = hub.repos[f"{USER}/tiny-gpt2"]
    assert repo.commits == [
        "spmdlm: gpt2 at step 2 of 4",
        "spmdlm: checkpoint at step 2",
        "spmdlm: checkpoint at step 4",
        "spmdlm: gpt2 after 4 steps",
    ]
    exported = folder_files(out / "hf")
    checkpoint = {f"last-checkpoint/{name}": data for name, data in folder_files(out / "checkpoints" / "4").items()}
    assert repo.files == {**exported, **checkpoint}
    assert {r.headers.get("authorization") for r in hub.requests} == {f"Bearer {TOKEN}"}
    card = ModelCard.load(out / "hf" / "README.md")
    results = json.loads((out / "eval_results.json").read_text())
    assert {r.metric_type: r.metric_value for r in card.data.eval_results} == {
        "loss": results["eval_loss"],
        "perplexity": results["eval_perplexity"],
        "accuracy": results["eval_accuracy"],
        "bits_per_byte": results["eval_bits_per_byte"],
    }
    assert card.data.model_name == f"{USER}/tiny-gpt2" and card.data.license == "apache-2.0"
    assert f'model_id = "{USER}/tiny-gpt2"' in card.text  # pushed: the snippet loads it from the Hub


@pytest.mark.slow
@pytest.mark.parametrize("server", ["commit refused", "nothing listening", "never answering"])
def test_a_run_whose_upload_fails_ends_as_it_would_have_with_one_warning(
    server, hub, tmp_path, tiny_configs, cache_dir, capsys, monkeypatch, request
):
    hub.fail["commit"] = 403
    if server == "nothing listening":
        monkeypatch.setenv("HF_ENDPOINT", nobody_listening())
    if server == "never answering":  # the run ends within the bound (2 s each call), not never
        monkeypatch.setenv("HF_ENDPOINT", request.getfixturevalue("silent_server"))
    out = tmp_path / "run"
    capsys.readouterr()
    assert main(flags("gpt2", out, tiny_configs["gpt2"], cache_dir, "--push_to_hub", "--hub_token", TOKEN)) == 0
    captured = capsys.readouterr()
    (warning,) = warnings_of(captured.out + captured.err)
    assert "--push_to_hub" in warning and "run" in warning and "Traceback" not in captured.err
    assert ("no answer within 2 s" in warning) == (server == "never answering")
    assert export_complete(out / "hf") and (out / "hf" / "README.md").is_file() and not (out / "run.lock").exists()
    assert "eval_loss" in json.loads((out / "eval_results.json").read_text())
    if server == "commit refused":  # the same command again, once the hub takes it: the finished run is uploaded
        hub.fail.clear()
        assert main(flags("gpt2", out, tiny_configs["gpt2"], cache_dir, "--push_to_hub", "--hub_token", TOKEN)) == 0
        assert hub.repos[f"{USER}/run"].files == folder_files(out / "hf")


def test_a_push_of_an_export_that_is_not_written_is_refused(capsys, tmp_path):
    assert main(["--push_to_hub", "--export_hf", "false", "--output_dir", str(tmp_path / "run")]) == 2
    assert "--push_to_hub uploads the export, and --export_hf false writes none" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()
