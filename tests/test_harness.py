"""LM-harness tasks on spmdlm's JAX models (spmdlm/generation/harness.py) equal lm-eval's own `hf` backend on the
transformers export: a multiple-choice task, a rolling-loglikelihood task (a document longer than the window too)
and a generate_until task, from local YAMLs and jsonl files written here, for GPT-2 and T5, request by request; the
training loop's --eval_tasks writes the task metrics at its steps; the refusals are one line.

Models are tiny and random (test_generate.random_model), their vocabulary exactly the tokenizer's (so generation
chooses among the same ids in both), exported and loaded back as a user would.
"""

import json
import math

import jax
import pytest
import transformers
from conftest import read_metrics
from family_fixtures import FIXTURES
from lm_eval.models.huggingface import HFLM
from test_generate import WORDS, corpus, random_model
from test_train import launch

from spmdlm import hf_export
from spmdlm.cli import evaluate
from spmdlm.data.tokenization import load_tokenizer, special_token_ids, train_tokenizer
from spmdlm.errors import TasksError
from spmdlm.families import get_family
from spmdlm.generation.harness import harness_lm, run_tasks, task_manager
from spmdlm.launch import main
from spmdlm.mesh import make_mesh

REQUESTS = {"tiny_mc": "loglikelihood", "tiny_ppl": "loglikelihood_rolling", "tiny_gen": "generate_until"}
TASKS = list(REQUESTS)
MAX_LENGTH = 32  # shorter than the long document: several rolling windows
# float32 both, summed differently: T5's logits differ by up to ~2e-4 (RMSNorm, no attention scaling), so a sum of
# tens of log-probabilities by ~1e-3
TOLERANCE = dict(rel=1e-5, abs=2e-3)


def write_tasks(folder) -> str:
    """Three tasks as local YAMLs over jsonl files (lm-eval's dataset_path: json), in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = corpus(12, seed=3)
    data = {
        "mc": [
            {"q": f"the {word} sees the", "choices": ["cat", " big dog", "river of stone"], "label": i % 3}
            for i, word in enumerate(WORDS[:6])
        ],
        "ppl": [{"text": text} for text in texts[:4]] + [{"text": " ".join(texts[4:])}],
        "gen": [{"q": f"a {word} and", "answer": " the cat"} for word in WORDS[6:10]],
    }
    for name, rows in data.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    specs = {
        "tiny_mc": 'output_type: multiple_choice\ndoc_to_text: "Q: {{q}}"\ndoc_to_choice: "{{choices}}"\n'
        "doc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n",
        "tiny_ppl": 'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n",
        "tiny_gen": 'output_type: generate_until\ndoc_to_text: "{{q}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 6\n  do_sample: false\n'
        "metric_list:\n  - metric: exact_match\n",
    }
    for (task, spec), data_file in zip(specs.items(), ("mc", "ppl", "gen")):
        (folder / f"{task}.yaml").write_text(f"task: {task}\n" + common.format(folder / f"{data_file}.jsonl") + spec)
    return str(folder)


class Recorder:
    """lm_eval's cache hook, kept in a dict: every answer a backend gives, by (request type, request)."""

    def __init__(self):
        self.answers = {}

    def add_partial(self, attr, request, answer):
        self.answers[(attr, json.dumps(request, sort_keys=True))] = answer


def recorded(lm, tasks: list[str], tasks_dir) -> tuple[dict, dict]:
    recorder = Recorder()
    lm.set_cache_hook(recorder)
    return run_tasks(lm, tasks, manager=task_manager(tasks, [tasks_dir])), recorder.answers


def hf_backend(path, config_json: dict) -> HFLM:
    model = (
        transformers.AutoModelForSeq2SeqLM.from_pretrained(path)
        if config_json.get("is_encoder_decoder")
        else transformers.AutoModelForCausalLM.from_pretrained(path)
    )
    # HFLM calls tie_weights(), and transformers 5 reads every T5 config as tied (docs/architecture.md §5): told what
    # the export's config.json says, the head stays the exported one (docs/harness.md).
    model.config.tie_word_embeddings = config_json.get("tie_word_embeddings", True)
    return HFLM(
        pretrained=model.eval(),
        tokenizer=transformers.AutoTokenizer.from_pretrained(path),
        batch_size=4,
        max_length=MAX_LENGTH,
    )


# GPT-2 sharded over data and tensor axes with all three tasks; T5 on one device (its compiles are the slow ones)
# without generation, whose encoder-decoder path the hf backend lets run on past max_gen_toks (docs/harness.md);
# Qwen3 (grouped key/value heads over the tensor axis, a sliding window) with all three
@pytest.mark.slow
@pytest.mark.parametrize(
    "family_name, devices, mesh_spec, tasks",
    [("gpt2", 8, "data=4,tensor=2", TASKS), ("t5", 1, "data=1", TASKS[:2]), ("qwen3", 8, "data=4,tensor=2", TASKS)],
)
def test_tasks_equal_lm_eval_hf_backend_on_the_export(family_name, devices, mesh_spec, tasks, tmp_path, capsys):
    family = get_family(family_name)
    tokenizer = train_tokenizer(family, corpus(), 300)
    config = family.config_class.from_dict(
        {**FIXTURES[family_name].tiny_config, "vocab_size": tokenizer.get_vocab_size()}
    )
    config = config.replace(
        **{
            f"{role}_token_id": i
            for role, i in special_token_ids(tokenizer, family).items()
            if i is not None and hasattr(config, f"{role}_token_id")
        }
    )  # as training does
    path = hf_export.save_hf(random_model(family, config), config, tmp_path / "hf", tokenizer=tokenizer)
    tasks_dir = write_tasks(tmp_path / "tasks")
    mesh = make_mesh(mesh_spec, jax.devices()[:devices])
    model, _ = hf_export.load_hf(path, mesh=mesh)
    ours, our_answers = recorded(
        harness_lm(family, model, load_tokenizer(path), mesh, batch_size=4, max_length=MAX_LENGTH), tasks, tasks_dir
    )
    theirs, their_answers = recorded(hf_backend(path, json.loads((path / "config.json").read_text())), tasks, tasks_dir)

    assert our_answers.keys() == their_answers.keys()
    assert {kind for kind, _ in our_answers} == {REQUESTS[task] for task in tasks}
    for key, answer in our_answers.items():
        if key[0] == "loglikelihood":
            assert answer[0] == pytest.approx(their_answers[key][0], **TOLERANCE), key
            assert answer[1] == their_answers[key][1], key
        elif key[0] == "loglikelihood_rolling":
            assert answer == pytest.approx(their_answers[key], **TOLERANCE), key
        else:
            assert answer == their_answers[key], key
    assert "tiny_gen" not in tasks or any(
        answer for (kind, _), answer in our_answers.items() if kind == "generate_until"
    )  # text came out
    assert ours.keys() == theirs.keys() == set(tasks)
    for task in tasks:
        assert ours[task] == pytest.approx(theirs[task], rel=1e-4), task
    assert math.isfinite(ours["tiny_ppl"]["bits_per_byte"]) and ours["tiny_ppl"]["bits_per_byte"] > 0
    if family_name == "gpt2":  # python -m spmdlm.evaluate --tasks: the same adapter from the command line
        capsys.readouterr()
        assert (
            evaluate.main(
                [
                    "--model_name_or_path",
                    str(path),
                    "--tasks",
                    "tiny_mc",
                    "--tasks_dir",
                    tasks_dir,
                    "--mesh",
                    mesh_spec,
                    "--per_device_eval_batch_size",
                    "1",
                ]
            )
            == 0
        )
        found = json.loads(capsys.readouterr().out)
        assert found["kind"] == "export" and "loss" not in found  # tasks only: no held-out text given
        assert found["tasks"]["tiny_mc"] == pytest.approx(ours["tiny_mc"], rel=1e-5)


def test_families_without_likelihood_say_so():
    with pytest.raises(TasksError, match="a roberta model has no LM-harness likelihood"):
        harness_lm(get_family("roberta"), None, None, None)


@pytest.mark.slow
def test_eval_tasks_in_the_training_loop(tmp_path, tiny_gpt2_config, cache_dir):
    """test_train's bigger run of test_gradient_accumulation_matches_a_bigger_batch (the suite compiles its steps
    once), with two tasks every 2 steps and at the end (step 3)."""
    out = tmp_path / "run"
    assert (
        launch(
            out,
            tiny_gpt2_config,
            cache_dir,
            "--mesh",
            "data=8",
            "--max_steps",
            "3",
            "--per_device_train_batch_size",
            "4",
            "--eval_tasks",
            "tiny_mc,tiny_ppl",
            "--eval_tasks_dir",
            write_tasks(tmp_path / "tasks"),
            "--eval_tasks_steps",
            "2",
            "--eval_tasks_limit",
            "3",
        )
        == 0
    )
    records = {m["step"]: m for m in read_metrics(out) if "eval_tasks/tiny_mc/acc" in m}
    assert sorted(records) == [2, 3]
    results = json.loads((out / "eval_results.json").read_text())
    for key in (
        "eval_tasks/tiny_mc/acc",
        "eval_tasks/tiny_mc/acc_norm",
        "eval_tasks/tiny_ppl/bits_per_byte",
        "eval_tasks/tiny_ppl/word_perplexity",
    ):
        assert results[key] == records[3][key]
    assert records[2]["eval_tasks/tiny_ppl/bits_per_byte"] != records[3]["eval_tasks/tiny_ppl/bits_per_byte"]
    assert "eval_loss" in results  # the held-out evaluation as before


def test_unknown_task_names_where_it_looked(tmp_path, monkeypatch):
    import lm_eval.tasks

    local_only = lm_eval.tasks.TaskManager  # lm-eval's own thousands of tasks take ~20 s to index: not here
    monkeypatch.setattr(
        lm_eval.tasks,
        "TaskManager",
        lambda include_path=None, include_defaults=True: local_only(include_path=include_path, include_defaults=False),
    )
    with pytest.raises(TasksError, match=r"^unknown task nonesuch: not a task in .*tasks or among lm-eval's; check"):
        task_manager("tiny_mc, nonesuch", [write_tasks(tmp_path / "tasks")])
    assert "tiny_mc" in task_manager("tiny_mc", [tmp_path / "tasks"]).all_tasks


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model_type", "roberta", "--eval_tasks", "tiny_mc"], "--eval_tasks: a roberta model has no LM-harness"),
        (
            ["--eval_tasks", "tiny_mc", "--eval_tasks_dir", "/nonesuch"],
            "--eval_tasks: task directory /nonesuch: no such directory",
        ),
        (["--eval_tasks_steps", "5"], "--eval_tasks_steps apply to --eval_tasks"),
        (
            ["--eval_tasks", "tiny_mc", "no_lm_eval"],
            "--eval_tasks: LM-harness tasks need the lm-eval package, which is "
            "not installed: pip install 'spmdlm[eval]'",
        ),
    ],
)
def test_eval_tasks_refused_in_one_line_before_any_work(flags, message, tmp_path, capsys, monkeypatch):
    if "no_lm_eval" in flags:
        flags = flags[:-1]
        find_spec = __import__("importlib.util").util.find_spec
        monkeypatch.setattr(
            "importlib.util.find_spec", lambda name, *rest: None if name == "lm_eval" else find_spec(name, *rest)
        )
    out = tmp_path / "run"
    code = main(["--output_dir", str(out), *flags])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {message}" in err and "Traceback" not in err
    assert not out.exists()
