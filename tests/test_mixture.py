"""Weighted mixtures of corpora: parsing, exact shares, host slices, per-source evaluation, exact resume."""

import json

import numpy as np
import pytest
from conftest import final_params, read_metrics, run_argv, run_killed_after_first_checkpoint

from spmdlm.data import mixture, pipeline
from spmdlm.data.mixture import MixedSplit, MixtureOrder, Source
from spmdlm.data.objectives.clm import CausalLM
from spmdlm.data.records import PreparedSplit
from spmdlm.errors import ArgumentError
from spmdlm.launch import main

RECORD = 4  # tokens a record in the synthetic sources: [source, record index, 0, 0]


def synthetic_source(folder, k: int, num_records: int) -> PreparedSplit:
    """A token file whose record i of source k is [k, i, 0, 0]: a batch row says where it came from."""
    tokens = np.zeros((num_records, RECORD), dtype="<i4")
    tokens[:, 0], tokens[:, 1] = k, np.arange(num_records)
    path = folder / f"source{k}.tokens"
    path.write_bytes(tokens.tobytes())
    return PreparedSplit(path, num_records, tokens.size, RECORD, f"source{k}")


@pytest.fixture(scope="module")
def three_sources(tmp_path_factory) -> MixedSplit:
    folder = tmp_path_factory.mktemp("mixture")
    sizes, weights = (700, 300, 50), (0.6, 0.3, 0.1)
    sources = tuple(Source(f"s{k}", w, train_file=f"s{k}.txt") for k, w in enumerate(weights))
    return MixedSplit(sources, tuple(synthetic_source(folder, k, n) for k, n in enumerate(sizes)))


def mixture_batches(mixed, *, steps, global_batch=40, process_index=0, process_count=1):
    source = pipeline.MixtureBatches(
        mixed,
        seed=7,
        global_batch=global_batch,
        num_epochs=30,
        process_index=process_index,
        process_count=process_count,
    )
    return np.concatenate([source[s].records for s in range(steps)])


# -- (a) exact shares ---------------------------------------------------------------------------------------------
def test_three_sources_get_their_shares_of_20000_examples(three_sources):
    rows = mixture_batches(three_sources, steps=500)  # 500 x 40 = 20,000 examples
    shares = np.bincount(rows[:, 0], minlength=3) / len(rows)
    np.testing.assert_allclose(shares, [0.6, 0.3, 0.1], atol=0.01)
    # each source repeats on its own: every epoch of a source reads each of its records once
    for k, split in enumerate(three_sources.splits):
        taken = rows[rows[:, 0] == k, 1]
        n = split.num_records
        for epoch in range(len(taken) // n):
            assert sorted(taken[epoch * n : (epoch + 1) * n]) == list(range(n))
    epochs = three_sources.epochs_reached(7, len(rows))
    assert epochs == pytest.approx({"s0": 12000 / 700, "s1": 6000 / 300, "s2": 2000 / 50})


def test_the_slot_counts_are_exact_and_sum_to_the_period():
    counts = mixture.slot_counts([1 / 3, 1 / 3, 1 / 3])
    assert counts.sum() == mixture.PERIOD and list(counts) == [3334, 3333, 3333]
    order = MixtureOrder([0.6, 0.3, 0.1], seed=1)
    sources, within = order(np.arange(3 * mixture.PERIOD))
    for k, count in enumerate(order.counts):  # within-source indices run 0, 1, 2, ... without gaps
        np.testing.assert_array_equal(within[sources == k], np.arange(3 * count))
    assert list(order.taken(3 * mixture.PERIOD)) == [3 * c for c in order.counts]
    assert list(order.taken(12345)) == list(np.bincount(sources[:12345], minlength=3))


# -- (b) host slices ----------------------------------------------------------------------------------------------
def test_one_and_two_processes_read_the_same_global_batches(three_sources):
    whole = mixture_batches(three_sources, steps=6)
    halves = [mixture_batches(three_sources, steps=6, process_index=p, process_count=2) for p in range(2)]
    rows = np.stack([h.reshape(6, 20, RECORD) for h in halves], axis=1).reshape(-1, RECORD)
    np.testing.assert_array_equal(rows, whole)


def test_mixture_batches_are_a_grain_iterator_that_resumes_exactly(three_sources):
    objective = CausalLM(RECORD - 1)
    it = pipeline.train_batches(three_sources, objective, seed=3, global_batch=8, num_epochs=2)
    [next(it) for _ in range(3)]
    state = it.get_state()
    expected = [next(it)["input_ids"] for _ in range(3)]
    again = pipeline.train_batches(three_sources, objective, seed=3, global_batch=8, num_epochs=2)
    again.set_state(state)
    for batch in expected:
        np.testing.assert_array_equal(next(again)["input_ids"], batch)


# -- (f) parsing --------------------------------------------------------------------------------------------------
def test_weighted_train_file_parts_are_sources():
    a, b = mixture.parse_train_file("a.txt:0.6,b.txt:0.4")
    assert (a.name, a.weight, a.train_file) == ("a", 0.6, "a.txt") and (b.name, b.weight) == ("b", 0.4)
    (bucket, local) = mixture.parse_train_file("gs://bucket/wiki/*.txt:3,news/:1")
    assert (bucket.name, bucket.train_file, bucket.weight) == ("wiki", "gs://bucket/wiki/*.txt", 0.75)
    assert (local.name, local.weight) == ("news", 0.25)  # weights that do not sum to 1 are normalised
    assert mixture.parse_train_file("gs://bucket/a.txt,b.txt") == ()  # no weights: one corpus, as before


@pytest.mark.parametrize(
    "text, message",
    [
        ("a.txt:0.6,b.txt:0", "source b has weight 0; weights must be positive"),
        ("a.txt:0.6,b.txt:-1", "source b has weight -1; weights must be positive"),
        ("a.txt:0.6,b.txt", "b.txt has no :WEIGHT"),
        ("a.txt:1,b.txt:1e-6", "source b's weight gives it no example in 10,000"),
    ],
)
def test_bad_weights_are_refused_in_one_line(text, message):
    with pytest.raises(ArgumentError, match=message) as e:
        mixture.parse_train_file(text)
    assert "\n" not in str(e.value)


def test_a_mixture_file_names_its_sources_and_paths_beside_it(tmp_path):
    (tmp_path / "mix.yaml").write_text(
        "sources:\n"
        "  - {name: news, train_file: news/*.jsonl, weight: 3,"
        " validation_file: held/news.jsonl}\n"
        "  - {name: wiki, dataset_dir: /data/wiki-gpt2, weight: 1}\n"
    )
    news, wiki = mixture.sources_of(None, str(tmp_path / "mix.yaml"))
    assert (news.name, news.weight, news.train_file) == ("news", 0.75, str(tmp_path / "news/*.jsonl"))
    assert news.validation_file == str(tmp_path / "held/news.jsonl")
    assert (wiki.name, wiki.weight, wiki.dataset_dir, wiki.train_file) == ("wiki", 0.25, "/data/wiki-gpt2", None)


@pytest.mark.parametrize(
    "text, message",
    [
        ("sources:\n  - {name: a, train_file: a.txt, weight: -0.5}\n", "source a has weight -0.5"),
        ("sources:\n  - {name: a, weight: 1}\n", "source a needs one of train_file and dataset_dir"),
        ("sources:\n  - {name: a, train_file: a.txt, weight: 1, wieght: 2}\n", "unknown keys wieght"),
        ("sources: [\n", "is not valid YAML"),
    ],
)
def test_a_bad_mixture_file_is_refused_in_one_line(tmp_path, text, message):
    (tmp_path / "mix.yaml").write_text(text)
    with pytest.raises(ArgumentError, match=message) as e:
        mixture.sources_of(None, str(tmp_path / "mix.yaml"))
    assert "\n" not in str(e.value)


# -- runs: per-source evaluation, exact resume, a changed mixture ---------------------------------------------------
WORDS = (
    "harbour tide gull rope anchor lamp keeper storm sail reef island wave compass chart mast deck fog bell "
    "north south lantern oar keel"
).split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three small text sources of distinct vocabularies (each document a line of 8-20 words)."""
    folder = tmp_path_factory.mktemp("sources")
    for k, name in enumerate(("news", "wiki", "code")):
        rng = np.random.default_rng(k)
        words = WORDS[k * 7 : (k + 1) * 7 + 2]
        lines = [" ".join(rng.choice(words, rng.integers(8, 20))) for _ in range(60)]
        (folder / f"{name}.txt").write_text("\n".join(lines) + "\n")
    return folder


def mixture_flags(corpus, out, cache_dir, config, weights=(0.5, 0.3, 0.2), *extra) -> list[str]:
    train_file = ",".join(f"{corpus / name}.txt:{w}" for name, w in zip(("news", "wiki", "code"), weights))
    flags = dict(block_size=16, per_device_train_batch_size=1, mesh="data=4,fsdp=2", max_steps=4, save_steps=2)
    flags |= dict(logging_steps=2, learning_rate="1e-3", validation_split_percentage=20, export_hf=False)
    return run_argv(out, config, cache_dir, *extra, train_file=train_file, **flags)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, corpus, cache_dir, tiny_gpt2_config):
    out = tmp_path_factory.mktemp("mixture-run") / "run"
    assert main(mixture_flags(corpus, out, cache_dir, tiny_gpt2_config)) == 0
    return out


@pytest.mark.slow
def test_a_mixture_run_reports_each_source_s_evaluation(whole_run):
    results = json.loads((whole_run / "eval_results.json").read_text())
    for name in ("news", "wiki", "code"):
        assert results[f"eval/{name}/perplexity"] == pytest.approx(np.exp(results[f"eval/{name}/loss"]), rel=1e-6)
        assert 0 <= results[f"eval/{name}/accuracy"] <= 1
    # the overall numbers are token-weighted over the sources
    tokens = {name: results[f"eval/{name}/tokens"] for name in ("news", "wiki", "code")}
    assert results["eval_tokens"] == sum(tokens.values())
    assert results["eval_loss"] == pytest.approx(
        sum(results[f"eval/{n}/loss"] * t for n, t in tokens.items()) / results["eval_tokens"], rel=1e-6
    )
    assert set(results["train_source_epochs"]) == {"news", "wiki", "code"}
    evals = [m for m in read_metrics(whole_run) if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4] and all("eval/wiki/loss" in m for m in evals)
    recorded = json.loads((whole_run / "run_config.json").read_text())["mixture"]
    assert [(s["name"], s["weight"]) for s in recorded] == [("news", 0.5), ("wiki", 0.3), ("code", 0.2)]


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory, corpus, cache_dir, tiny_gpt2_config):
    out = tmp_path_factory.mktemp("mixture-killed") / "run"
    monkeypatch = pytest.MonkeyPatch()
    try:
        run_killed_after_first_checkpoint(
            monkeypatch, lambda: main(mixture_flags(corpus, out, cache_dir, tiny_gpt2_config))
        )
    finally:
        monkeypatch.undo()
    return out


def copied(run, tmp_path):
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.slow
def test_a_killed_mixture_run_resumes_to_the_same_weights(
    whole_run, killed_run, tmp_path, corpus, cache_dir, tiny_gpt2_config, capsys
):
    out = copied(killed_run, tmp_path)
    assert main(mixture_flags(corpus, out, cache_dir, tiny_gpt2_config)) == 0
    assert "resumed from the checkpoint at step 2" in capsys.readouterr().out
    resumed, whole = final_params(out), final_params(whole_run)
    assert resumed.keys() == whole.keys() and all(np.array_equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.slow
def test_a_changed_weight_is_refused_on_resume_unless_allowed(
    killed_run, tmp_path, corpus, cache_dir, tiny_gpt2_config, capsys
):
    out = copied(killed_run, tmp_path)
    changed = (0.2, 0.3, 0.5)
    assert main(mixture_flags(corpus, out, cache_dir, tiny_gpt2_config, changed)) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another data mixture (news 0.5, wiki 0.3, code 0.2 -> news 0.2" in err
    assert "--allow_mixture_change" in err
    assert main(mixture_flags(corpus, out, cache_dir, tiny_gpt2_config, changed, "--allow_mixture_change")) == 0
    stdout = capsys.readouterr().out
    assert "resuming with a changed data mixture" in stdout and "resumed from the checkpoint at step 2" in stdout
    recorded = json.loads((out / "run_config.json").read_text())["mixture"]
    assert [s["weight"] for s in recorded] == [0.2, 0.3, 0.5]


def test_a_mixture_file_with_a_missing_file_is_refused_in_one_line(
    tmp_path, corpus, cache_dir, tiny_gpt2_config, capsys
):
    (tmp_path / "mix.yaml").write_text(
        f"sources:\n  - {{name: news, train_file: {corpus}/news.txt, weight: 1}}\n"
        "  - {name: gone, train_file: missing/*.txt, weight: 1}\n"
    )
    out = tmp_path / "run"
    argv = mixture_flags(corpus, out, cache_dir, tiny_gpt2_config)
    argv[:2] = ["--data_mixture", str(tmp_path / "mix.yaml")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "source gone" in err and "missing/*.txt matches no file" in err, err
    assert not out.exists()
