"""LM-harness tasks (the `lm-eval` package) on spmdlm's own JAX models: no PyTorch, batched and sharded on a mesh.

    lm = harness_lm(family, model, tokenizer, mesh, batch_size=8)   # an lm_eval LM (GPT-2, T5, BART)
    results = run_tasks(lm, ["my_task"], task_dirs=["tasks/"], limit=100)   # {task: {metric: value}}

The adapter tokenizes as lm-eval's `hf` backend does on the exported model (lm_eval's own TemplateLM code splits
context and continuation; see docs/harness.md), scores through spmdlm/generation/scoring.py and generates through
spmdlm/generation/decoding.py. lm-eval is an optional extra (`pip install 'spmdlm[eval]'`), imported only when tasks
are asked for.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from spmdlm import network, storage
from spmdlm.errors import TasksError
from spmdlm.families.base import Family, Generation
from spmdlm.generation.decoding import generate_tokens
from spmdlm.generation.scoring import Scorer, check_likelihood

INSTALL_HINT = "pip install 'spmdlm[eval]'"
MAX_GEN_TOKS = 256  # generate_until's default number of new tokens, as lm-eval's hf backend
TASK_METRICS = "eval_tasks"  # the prefix of task metrics in metrics.jsonl, the trackers and eval_results.json
OFFLINE_ENVS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")  # huggingface_hub's and datasets' switches
HUB_PROBE_S = 3.0  # how long the Hub may take to accept a connection before task data is read from the cache only


def require_lm_eval(flag: str = "LM-harness tasks") -> None:
    """One line naming the extra when lm-eval is not installed (checked without importing it)."""
    if importlib.util.find_spec("lm_eval") is None:
        raise TasksError(f"{flag} need the lm-eval package, which is not installed: {INSTALL_HINT}")


class HarnessModel:
    """The methods of `SpmdlmLM`, lm_eval's TemplateLM joined with these by `lm_class` when lm-eval is imported.

    `interrupt`, if given, is called before each batch; what it raises ends the tasks (training gives way to a
    checkpoint that way)."""

    def __init__(
        self,
        family: Family,
        model,
        tokenizer,
        mesh,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        interrupt: Callable[[], None] | None = None,
        seed: int = 0,
    ):
        check_likelihood(family)
        super().__init__()
        config = model.config
        if max_length is not None and not 1 < max_length <= config.max_length:
            raise TasksError(f"max_length {max_length}: the model takes 2 to {config.max_length} tokens")
        self.model, self.config, self.tokenizer, self.seed = model, config, tokenizer, seed
        self.max_length = max_length or config.max_length
        self.scorer = Scorer(family, model, mesh, batch_size=batch_size, max_length=self.max_length)
        self.backend = "seq2seq" if family.generation is Generation.ENCODER_DECODER else "causal"  # TemplateLM's
        self.interrupt = interrupt
        bos = getattr(config, "bos_token_id", None) if family.tokenizer.specials.get("bos") else None
        self._prefix = config.eos_token_id if bos is None else bos  # the hf backend's: BOS, else EOS
        self._prefix_text = tokenizer.decode([self._prefix], skip_special_tokens=False)

    @property
    def eot_token_id(self) -> int:
        return self.config.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix

    @property
    def batch_size(self) -> int:
        return self.scorer.batch_size

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As the hf backend: the tokenizer's own framing unless told otherwise or the text starts with the
        prefix token."""
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self._prefix_text)
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids

    def loglikelihood(self, requests, disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        return super().loglikelihood(requests, disable_tqdm=disable_tqdm)

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = True, **kwargs) -> list[tuple[float, bool]]:
        answers = self.scorer.score([(context, continuation) for _, context, continuation in requests], self.interrupt)
        for (strings, _, _), answer in zip(requests, answers):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return answers

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = True) -> list[float]:
        """Each text's log-likelihood in windows of max_length tokens, the first after the prefix token (lm_eval's
        own windowing, as the hf backend)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for window in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self._prefix, max_seq_len=self.max_length, context_len=1
            ):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self.scorer.score(windows, self.interrupt)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = True) -> list[str]:
        """Continuations up to a stop sequence or EOS, requests with the same generation settings batched together
        (greedy unless the task samples)."""
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        texts = [""] * len(requests)
        for indices in groups.values():
            for index, text in zip(
                indices, self._generate([requests[i].args[0] for i in indices], requests[indices[0]].args[1])
            ):
                texts[index] = text
                self.cache_hook.add_partial("generate_until", requests[index].args, text)
        return texts

    def _generate(self, contexts: list[str], gen_kwargs: dict) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        kwargs = normalize_gen_kwargs(gen_kwargs, MAX_GEN_TOKS)
        until = handle_stop_sequences(
            kwargs.pop("until", None), eos=self.tokenizer.decode([self.eot_token_id], skip_special_tokens=False)
        )
        new_tokens = kwargs.pop("max_gen_toks")
        budget = self.max_length if self.backend == "seq2seq" else self.max_length - new_tokens
        if budget < 1:
            raise TasksError(
                f"a task asks for {new_tokens} new tokens, which leave no room for its prompt in "
                f"max_length {self.max_length}"
            )
        sampling = (
            dict(
                temperature=float(kwargs.get("temperature", 0.0)),
                top_k=int(kwargs.get("top_k") or 0),
                top_p=float(kwargs.get("top_p") or 1.0),
            )
            if kwargs.get("do_sample")
            else {}
        )
        rows = [self.tok_encode(context)[-budget:] for context in contexts]
        out = []
        for start in range(0, len(rows), self.batch_size):
            if self.interrupt is not None:
                self.interrupt()
            chunk = rows[start : start + self.batch_size]
            ids = generate_tokens(
                self.model,
                self.config,
                chunk + [chunk[0]] * (self.batch_size - len(chunk)),
                vocab=self.tokenizer.get_vocab_size(),
                max_new_tokens=new_tokens,
                seed=self.seed,
                **sampling,
            )
            out += [
                postprocess_generated_text(self.tokenizer.decode(row, skip_special_tokens=True), until, None)
                for row in ids[: len(chunk)]
            ]
        return out


@functools.cache
def lm_class() -> type:
    """`SpmdlmLM`: HarnessModel's methods on lm_eval's TemplateLM (lm-eval imported here, on first use)."""
    require_lm_eval()
    from lm_eval.api.model import TemplateLM

    return type("SpmdlmLM", (HarnessModel, TemplateLM), {"__module__": __name__, "__doc__": HarnessModel.__doc__})


def harness_lm(
    family: Family,
    model,
    tokenizer,
    mesh,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    interrupt: Callable[[], None] | None = None,
    seed: int = 0,
):
    """An lm_eval `LM` (loglikelihood, loglikelihood_rolling, generate_until) of a loaded model: its family, the NNX
    model (sharded on `mesh`), its `tokenizers.Tokenizer`; `batch_size` rows per call (a multiple of the mesh's
    batch axes), rows of at most `max_length` tokens (default: the model's positions, as the hf backend)."""
    check_likelihood(family)
    return lm_class()(
        family, model, tokenizer, mesh, batch_size=batch_size, max_length=max_length, interrupt=interrupt, seed=seed
    )


# -- tasks ------------------------------------------------------------------------------------------------------------
def task_names(tasks: str | Sequence[str]) -> list[str]:
    names = [name.strip() for name in (tasks.split(",") if isinstance(tasks, str) else tasks)]
    if not names or not all(names):
        raise TasksError(f"no task in {tasks!r}: give task names separated by commas")
    return names


def task_manager(tasks: str | Sequence[str], task_dirs: Sequence[str | Path] = ()):
    """lm_eval's TaskManager for `tasks`, checked: the local YAML directories only when they hold every task
    (indexing lm-eval's thousands of own tasks takes a while), else with lm-eval's own tasks too."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    dirs = [storage.path(d) for d in task_dirs]
    for folder in dirs:
        if not folder.is_dir():
            raise TasksError(f"task directory {folder}: no such directory; give the folder of your task YAMLs")
    names = task_names(tasks)
    manager = TaskManager(include_path=[str(d) for d in dirs], include_defaults=False) if dirs else None
    if manager is None or not set(names) <= set(manager.all_tasks):
        manager = TaskManager(include_path=[str(d) for d in dirs] or None)
    unknown = [name for name in names if name not in manager.all_tasks]
    if unknown:
        where = f" in {', '.join(map(str, dirs))} or" if dirs else ""
        raise TasksError(
            f"unknown task{'s' * (len(unknown) > 1)} {', '.join(unknown)}: not a task{where} among "
            "lm-eval's; check the name (a local YAML's `task:` field) and the task directory"
        )
    if (why := hub_unreachable()) is not None:  # the data must be on this host: checked now, before any work
        load_offline(manager, names, why)
    return manager


def hub_unreachable() -> str | None:
    """Why lm-eval's task data can come only from this host (its files, the datasets cache), in words; None where
    the Hub may be asked: HF_HUB_OFFLINE or HF_DATASETS_OFFLINE set, or the Hub (HF_ENDPOINT) not accepting a
    connection within HUB_PROBE_S seconds."""
    given = [name for name in OFFLINE_ENVS if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE")]
    if given:
        return f"{given[0]} is set"
    endpoint = os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    return None if network.reachable(endpoint, HUB_PROBE_S) else f"the Hub ({endpoint}) is unreachable from here"


@contextlib.contextmanager
def hub_offline():
    """datasets and huggingface_hub offline for a while: data not in the cache fails at once, instead of after
    ~25 s of retries with two warnings each. They read HF_HUB_OFFLINE when imported, so their flags are set, then
    restored."""
    import datasets.config
    import huggingface_hub.constants

    flags = [
        (m, name) for m in (datasets.config, huggingface_hub.constants) for name in OFFLINE_ENVS if hasattr(m, name)
    ]
    saved = [getattr(m, name) for m, name in flags]
    for m, name in flags:
        setattr(m, name, True)
    try:
        yield
    finally:
        for (m, name), value in zip(flags, saved):
            setattr(m, name, value)


def load_tasks(manager, names: list[str]) -> dict:
    """`manager.load(names)` (lm-eval reads each task's data then); offline where the Hub cannot be asked
    (hub_unreachable)."""
    why = hub_unreachable()
    return manager.load(names) if why is None else load_offline(manager, names, why)


def load_offline(manager, names: list[str], why: str) -> dict:
    """`manager.load(names)` from this host's files and cache only (`why`: the Hub cannot be asked): data that is
    not here is one line at once."""
    try:
        with hub_offline():
            return manager.load(names)
    except Exception as e:  # noqa: BLE001 - datasets' ConnectionError, FileNotFoundError, lm-eval's own
        first = " ".join(str(e).split())[:300] or type(e).__name__
        raise TasksError(
            f"the data of task{'s' * (len(names) > 1)} {', '.join(names)} is not on this host ({first}) and {why}; "
            "give tasks over local files (--eval_tasks_dir, dataset_path: json: docs/harness.md), or run them "
            "once where the Hub is reachable (the datasets cache keeps their data)"
        ) from None


def run_tasks(
    lm,
    tasks: str | Sequence[str],
    *,
    task_dirs: Sequence[str | Path] = (),
    limit: int | float | None = None,
    num_fewshot: int | None = None,
    seed: int = 0,
    manager=None,
    bootstrap_iters: int = 0,
) -> dict[str, dict[str, float]]:
    """{task or group: {metric: value}} of `tasks` on `lm` (lm_eval's evaluator; stderr only with
    `bootstrap_iters`). `num_fewshot` overrides the tasks' own (except those fixed at 0, as simple_evaluate does);
    few-shot examples are drawn with `seed`. `manager`: a `task_manager` to reuse."""
    from lm_eval.evaluator import evaluate

    manager = manager or task_manager(tasks, task_dirs)
    loaded = load_tasks(manager, task_names(tasks))
    for task in loaded["tasks"].values():
        default = task.get_config("num_fewshot")
        if num_fewshot is not None and default != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif default is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
    results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=bootstrap_iters, log_samples=False)
    return {name: metrics_of(values) for name, values in results["results"].items()}


def metrics_of(values: dict[str, Any]) -> dict[str, float]:
    """lm-eval's "metric,filter" entries as "metric" (filter "none") or "metric/filter"; numbers only."""
    out = {}
    for key, value in values.items():
        metric, _, kept = key.partition(",")
        if kept and isinstance(value, (int, float)) and not isinstance(value, bool):
            out[metric if kept == "none" else f"{metric}/{kept}"] = float(value)
    return out


def flat_metrics(results: dict[str, dict[str, float]], prefix: str = TASK_METRICS) -> dict[str, float]:
    """{prefix/task/metric: value}: the keys of metrics.jsonl, the trackers and eval_results.json."""
    return {
        f"{prefix}/{task}/{metric}": value for task, metrics in results.items() for metric, value in metrics.items()
    }
