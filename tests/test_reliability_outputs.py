"""Outputs that must never look complete when they are not: an export killed half-way, two preparations racing for
one --out, a disk that fills up while the token cache, a dataset or an export is written.

The kill is a SIGKILL injected by strace at the moment a given file is opened (`-D` keeps the traced program at the
shell's pid, so the path of the export's temporary directory, which holds the pid, is known in advance); the full
disks are small tmpfs mounts (root only).
"""

import json
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import FIXTURES
from test_reliability import flags, launch

from spmdlm import hf_export, storage
from spmdlm.cli.export import main as export_main
from spmdlm.data import datasets
from spmdlm.data.tokenization import load_tokenizer, save_tokenizer, special_token_ids, train_tokenizer
from spmdlm.families import get_family
from spmdlm.launch import main
from spmdlm.prepare import main as prepare_main
from spmdlm.train.stages.outputs import export_done

_RNG = np.random.default_rng(7)
_WORDS = [f"w{i}" for i in range(300)] + ["café", "straße"]
DOCS = [" ".join(_RNG.choice(_WORDS, _RNG.integers(5, 40))) + "." for _ in range(2000)]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory, cache_dir, tiny_gpt2_config):
    out = tmp_path_factory.mktemp("trained") / "run"
    assert main(flags(out, cache_dir, tiny_gpt2_config)) == 0
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "docs.txt"
    path.write_text("\n".join(DOCS) + "\n")
    return path


@pytest.fixture(scope="module")
def gpt2_tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer") / "gpt2"
    save_tokenizer(
        train_tokenizer(get_family("gpt2"), DOCS[:300], 500), folder, get_family("gpt2"), model_max_length=1024
    )
    return folder


@pytest.fixture
def full_disk(tmp_path):
    """A 2 MB tmpfs with all but `free` KiB taken by a filler file: `fill(free)` -> the mount point."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")

    def fill(free_kib: int):
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * (2048 - free_kib) * 1024)
        return disk

    try:
        yield fill
    finally:
        subprocess.run(["umount", "--lazy", str(disk)], check=True)


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


# -- 1. an export killed half-way is done again ----------------------------------------------------------------------
@pytest.mark.slow
def test_an_export_killed_while_writing_the_tokenizer_is_redone_by_the_rerun(
    capsys, tmp_path, cache_dir, tiny_gpt2_config
):
    if shutil.which("strace") is None:
        pytest.skip("needs strace (apt-get install strace) to kill the export at a given file")
    out = tmp_path / "run"
    argv = flags(out, cache_dir, tiny_gpt2_config)
    # The export's temporary directory (spmdlm.export.save_hf) and, for an export written in place, the final one.
    temp = f"{out}/.hf.tmp-{socket.gethostname()}-$$/tokenizer_config.json"
    script = (
        f'exec strace -D -f -qq -o /dev/null -e trace=openat -e inject=openat:signal=KILL -P "{temp}" '
        f'-P "{out}/hf/tokenizer_config.json" "$@"'
    )
    killed = subprocess.run(
        ["sh", "-c", script, "sh", sys.executable, "-m", "spmdlm.launch", *argv],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert killed.returncode == -9, (killed.returncode, killed.stderr[-3000:])  # killed at that openat, not before
    assert (out / "checkpoints" / "4").is_dir()
    assert not export_done(out)  # what is left does not look like a whole export
    assert not (out / "hf" / hf_export.MARKER).exists()

    code, stdout, err = launch(capsys, *argv)
    assert code == 0, err
    assert "nothing to do" not in stdout
    assert export_done(out) and all((out / "hf" / name).is_file() for name in TOKENIZER_FILES)
    assert [p.name for p in out.iterdir() if p.name.startswith(".hf")] == []  # the dead run's temp dir is gone
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(out / "hf")
    assert tok("hello world")["input_ids"]
    code, stdout, _ = launch(capsys, *argv)  # now it is complete
    assert code == 0 and "nothing to do" in stdout


def test_an_interrupted_export_cli_out_can_be_written_again_without_overwrite(capsys, tmp_path, trained):
    out = tmp_path / "hf"
    assert export_main(["--checkpoint", str(trained), "--out", str(out)]) == 0
    assert hf_export.export_complete(out)
    (out / hf_export.MARKER).unlink()  # what an export of older spmdlm killed before its tokenizer left
    (out / "tokenizer_config.json").unlink()
    capsys.readouterr()
    assert export_main(["--checkpoint", str(trained), "--out", str(out)]) == 0, capsys.readouterr().err
    assert hf_export.export_complete(out) and (out / "tokenizer_config.json").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]
    assert export_main(["--checkpoint", str(trained), "--out", str(out)]) == 2  # a whole export is kept
    assert "exists and is not empty" in capsys.readouterr().err


# -- 2. two preparations racing for one --out --------------------------------------------------------------------------
def test_a_dataset_that_appears_in_out_during_preparation_is_kept_and_refused(
    capsys, monkeypatch, tmp_path, corpus, gpt2_tokenizer
):
    out = tmp_path / "ds"
    common = ["--tokenizer", str(gpt2_tokenizer), "--for_model", "gpt2", "--workers", "1", "--out", str(out)]
    real = datasets._write_dataset
    other = {}

    def write_then_race(*args, **kwargs):
        result = real(*args, **kwargs)
        if not other:  # run B has checked an empty --out and written its shards: run A finishes first
            other["running"] = True
            assert prepare_main([*common, "--block_size", "32", str(corpus)]) == 0
            other["card"] = (out / datasets.CARD_NAME).read_text()
        return result

    monkeypatch.setattr(datasets, "_write_dataset", write_then_race)
    code = prepare_main([*common, "--block_size", "16", str(corpus)])
    err = capsys.readouterr().err
    assert code == 2, err[-3000:]
    line = one_line("\n".join(ln for ln in err.splitlines() if ln.startswith("error:")))
    assert (
        line.startswith(f"error: --out {out} got another dataset")
        and "records of 33 tokens" in line
        and "records of 17 tokens" in line
    ), line
    assert (out / datasets.CARD_NAME).read_text() == other["card"]  # A's dataset, whole
    train, _, _ = datasets.open_dataset(
        out, tokenizer=load_tokenizer(gpt2_tokenizer), record_length=33, mode="stream", verify=True
    )
    assert train.num_records > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds"]  # B's temp dir is gone


def test_two_preparations_into_an_empty_out_cannot_both_swap_in(tmp_path):
    """A dataset found in --out that this preparation did not decide to replace (another one's, swapped in meanwhile) is
    put back: the second gets the refusal."""
    out, first, second = tmp_path / "ds", tmp_path / "a", tmp_path / "b"
    out.mkdir()
    for folder, key in ((first, "a" * 64), (second, "b" * 64)):
        folder.mkdir()
        (folder / datasets.CARD_NAME).write_text(json.dumps({"key": key, "for_model": "gpt2", "record_length": 8}))
    assert storage.swap_in(first, out, last=datasets.CARD_NAME, replaces=lambda old: False)
    assert not storage.swap_in(second, out, last=datasets.CARD_NAME, replaces=lambda old: False)
    with pytest.raises(datasets.DataError, match="got another dataset"):
        datasets._same_or_refuse(out, {"key": "b" * 64, "for_model": "gpt2", "record_length": 8})
    assert json.loads((out / datasets.CARD_NAME).read_text())["key"] == "a" * 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b", "ds"]  # the loser's files are its caller's to remove


# -- 3. full disks ---------------------------------------------------------------------------------------------------
def test_a_full_disk_while_writing_the_token_cache_is_one_line(capsys, tmp_path, full_disk, corpus, tiny_gpt2_config):
    disk = full_disk(32)
    out = tmp_path / "run"
    argv = flags(out, disk / "cache", tiny_gpt2_config)
    argv[argv.index("--train_file") + 1] = str(corpus)
    code, _, err = launch(capsys, *argv)
    assert code == 2
    line = one_line(err)
    assert "token cache" in line and "no space left" in line and str(disk / "cache") in line, line
    assert not list((disk / "cache").rglob("*.json")) and not list((disk / "cache").rglob("*.tmp-*"))


def test_a_full_disk_while_preparing_a_dataset_is_one_line(capsys, full_disk, corpus, gpt2_tokenizer):
    disk = full_disk(32)
    out = disk / "ds"
    code = prepare_main(
        [
            "--tokenizer",
            str(gpt2_tokenizer),
            "--for_model",
            "gpt2",
            "--block_size",
            "16",
            "--workers",
            "1",
            "--out",
            str(out),
            str(corpus),
        ]
    )
    err = "\n".join(ln for ln in capsys.readouterr().err.splitlines() if "INFO" not in ln)
    assert code == 2
    line = one_line(err)
    assert "no space left" in line and str(out) in line, line
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # neither the dataset nor its temp dir


def test_a_full_disk_while_exporting_is_one_line_and_a_rerun_recovers(capsys, full_disk, trained):
    disk = full_disk(128)  # the model's tensors are about 0.5 MB
    out = disk / "hf"
    code = export_main(["--checkpoint", str(trained), "--out", str(out)])
    assert code == 2
    line = one_line(capsys.readouterr().err)
    assert "no space left" in line and str(out) in line, line
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]  # nothing partial, no temp dir
    (disk / "filler").unlink()
    assert export_main(["--checkpoint", str(trained), "--out", str(out)]) == 0
    assert hf_export.export_complete(out) and (out / "tokenizer.json").is_file()


# -- TensorBoard on a full disk -----------------------------------------------------------------------------------
def test_a_failed_tensorboard_write_stops_the_run_in_one_line(
    capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config
):
    """tensorboardX's writer thread died on a full disk and the run then blocked forever on its queue; events are
    written on the run's own thread now, so the failure is reported (and the checkpoints before it are kept)."""
    from tensorboardX.event_file_writer import EventsWriter

    from spmdlm import checkpoint

    original, written = EventsWriter.write_event, []

    def fills_the_disk(self, event):
        written.append(event.step)
        if event.step >= 3:
            raise OSError(28, "No space left on device")
        return original(self, event)

    monkeypatch.setattr(EventsWriter, "write_event", fills_the_disk)
    out = tmp_path / "run"
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--logging_steps", "1"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"cannot write TensorBoard events in {out / 'tensorboard'}: No space left on device" in err
    assert checkpoint.make_manager(out, read_only=True).all_steps() == [2]  # saved before the failure


# -- what a run may delete -----------------------------------------------------------------------------------------
def test_outputs_without_a_checkpoint_are_refused_not_replaced(capsys, trained, tmp_path, cache_dir, tiny_gpt2_config):
    """A finished run whose checkpoints the user removed to save space: a plain run used to empty the dir and
    replace its export. Now it is refused; --overwrite_output_dir replaces it."""
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    shutil.rmtree(out / "checkpoints")
    export_bytes = (out / "hf" / "model.safetensors").read_bytes()
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "holds outputs of an earlier run but no checkpoint to resume" in err and "hf" in err
    assert (out / "hf" / "model.safetensors").read_bytes() == export_bytes  # nothing touched
    code, _, _ = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--overwrite_output_dir"))
    assert code == 0 and export_done(out)


def test_checkpoints_set_aside_as_damaged_are_never_deleted(capsys, trained, tmp_path, cache_dir, tiny_gpt2_config):
    from spmdlm import checkpoint

    out = tmp_path / "run"
    shutil.copytree(trained, out)
    aside = out / checkpoint.DAMAGED_DIR
    aside.mkdir()
    for step in (out / "checkpoints").iterdir():  # as if every checkpoint had failed verification
        shutil.move(str(step), aside / step.name)
    kept = sorted(p.name for p in aside.iterdir())
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 2 and f"({checkpoint.DAMAGED_DIR}/ is kept either way)" in err
    code, _, _ = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--overwrite_output_dir"))
    assert code == 0 and sorted(p.name for p in aside.iterdir()) == kept  # still there after a fresh start


# -- fingerprints of what a run depends on ----------------------------------------------------------------------
@pytest.mark.slow
def test_a_resume_on_changed_data_or_tokenizer_is_refused(capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config):
    from conftest import run_killed_after_first_checkpoint

    corpus = tmp_path / "corpus.txt"
    corpus.write_text((FIXTURES / "overfit.txt").read_text())
    out = tmp_path / "run"
    run = lambda *extra: launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--train_file", str(corpus), *extra))
    run_killed_after_first_checkpoint(monkeypatch, run)
    saved = json.loads((out / "run_config.json").read_text())["fingerprints"]
    assert saved["train_data"] and saved["tokenizer"]

    original = corpus.read_text()
    corpus.write_text(original + "one more document, appended after the run started\n")
    code, _, err = run()
    assert code == 2 and "the training data changed since it started" in err and "--allow_data_change" in err
    corpus.write_text(original)
    tokenizer = json.loads((out / "tokenizer.json").read_text())  # another tokenizer of the same size
    vocab = tokenizer["model"]["vocab"]
    a, b = sorted(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    code, _, err = run()
    assert code == 2 and "the tokenizer changed" in err
    code, stdout, _ = run("--allow_data_change")
    assert code == 0 and "resuming on changed data (--allow_data_change)" in stdout


def test_max_steps_below_the_checkpoint_is_refused(capsys, trained, tmp_path, cache_dir, tiny_gpt2_config):
    out = tmp_path / "run"
    shutil.copytree(trained, out)
    results = (out / "eval_results.json").read_bytes()
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config, "--max_steps", "2"))
    assert code == 2 and "holds a checkpoint at step 4, past this run's 2 steps" in err
    assert (out / "eval_results.json").read_bytes() == results


# -- workers of a killed preparation ------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_workers_of_a_killed_preparation_leave_with_it(tmp_path, gpt2_tokenizer):
    import os
    import signal
    import time

    big = tmp_path / "big.txt"
    big.write_text("\n".join(DOCS * 60) + "\n")  # a few seconds of tokenizing on two workers
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spmdlm.prepare",
            "--tokenizer",
            str(gpt2_tokenizer),
            "--for_model",
            "gpt2",
            "--block_size",
            "64",
            "--workers",
            "2",
            "--out",
            str(tmp_path / "ds"),
            str(big),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    children = lambda pid: [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    deadline = time.monotonic() + 120
    while len(children(proc.pid)) < 3 and time.monotonic() < deadline:  # two workers and the resource tracker
        time.sleep(0.2)
    workers = children(proc.pid)
    assert len(workers) >= 2, "the preparation started no workers"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 20
    alive = lambda: [
        w for w in workers if os.path.exists(f"/proc/{w}") and open(f"/proc/{w}/stat").read().split()[2] != "Z"
    ]
    while alive() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(), f"workers still running after their preparation was killed: {alive()}"


def test_a_full_disk_at_the_loss_plot_names_the_path(capsys, monkeypatch, tmp_path, cache_dir, tiny_gpt2_config):
    from matplotlib.figure import Figure

    def full(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    out = tmp_path / "run"
    code, _, err = launch(capsys, *flags(out, cache_dir, tiny_gpt2_config))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"cannot write {out / 'loss_curve.png'}: No space left on device" in err


# -- a corpus of one very long line -------------------------------------------------------------------------------
@pytest.mark.parametrize("model, mode", [("gpt2", "stream"), ("t5", "stream"), ("bart", "sentences")])
def test_a_long_document_is_tokenized_in_pieces_with_the_same_records(model, mode, monkeypatch):
    """A 50 MB single-line file, tokenized whole, peaked at 9.6 GB of RAM; pieces of PIECE_CHARS cut at single
    spaces give the same ids (and sentence ends) as the whole document, so the records do not change."""
    from spmdlm.data import records

    words = " ".join(DOCS[:400]).split()
    rng = np.random.default_rng(3)
    doc = " ".join(rng.choice(words, 3000)) + "  two  spaces.  Then a sentence! " + " ".join(rng.choice(words, 500))
    family = get_family(model)
    tok = train_tokenizer(family, DOCS[:300], 500)
    ids = special_token_ids(tok, family)
    cut = records.Cut(64, ids["eos"], mode, ids.get("pad"))
    whole = records._tokenize_chunk(tok, [doc, "a short one."], cut)
    monkeypatch.setattr(records, "PIECE_CHARS", 500)
    assert len(records._pieces(doc)) > 20
    pieces = records._tokenize_chunk(tok, [doc, "a short one."], cut)
    np.testing.assert_array_equal(pieces["train"][0], whole["train"][0])
    assert pieces["train"][1:] == whole["train"][1:]
