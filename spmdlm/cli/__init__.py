"""The command lines: python -m spmdlm.<verb> runs spmdlm/cli/<verb>.py.

What the verbs share lives here, and none of it loads JAX:

- `Parser`: an argument error is one line that names the verb's --help, and an unknown flag gets a "did you mean"
  (close spellings of the verb's flags, and `ALIASES`: the names other tools give them, `--lr`, `--num_steps`).
- The quick answer. A verb's module loads JAX, Flax and the model families before it can build its parser (seconds);
  the parser itself needs none of that once it is known. So when a command line builds its parser, `remember` keeps
  a description of it (`describe`: every flag, its type, choices and help as printed) in
  ~/.cache/spmdlm/flags/VERB.json, with a fingerprint of the code that made it (spmdlm's files and those of the
  plugins of its entry-point groups: their paths, sizes and modification times). When this process is
  `python -m spmdlm.VERB` (or the spmdlm-VERB script) and that description is current, this package, which Python
  imports before the verb's module, parses the command line against it first (`answer_early`): --help, an unknown
  flag, a value of the wrong type and a number out of its bounds are answered in a fraction of a second, exactly
  as the verb would (its exit status, its one line); a command line that parses goes on to the verb, which parses
  it again with its own parser and checks the rest (the rules between flags, files, the model). The first command
  line after an install or an edit builds the description, at the verb's own speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from spmdlm import bounds
from spmdlm.errors import ArgumentError, yaml_problem

# -- the parser every verb uses ----------------------------------------------------------------------------------------
_BOOL_TRUE, _BOOL_FALSE = {"true", "1", "yes", "y", "on"}, {"false", "0", "no", "n", "off"}

# The names other tools (the HF Trainer's and scripts', nanoGPT, PyTorch Lightning, ...) give to our flags, by the name
# as written with underscores and in lower case: what an unknown flag's "did you mean" offers first. A target the
# verb lacks is not offered.
ALIASES: Mapping[str, tuple[str, ...]] = {
    **dict.fromkeys(("lr", "learningrate", "base_lr", "max_lr", "peak_lr"), ("learning_rate",)),
    **dict.fromkeys(
        ("num_steps", "steps", "train_steps", "total_steps", "training_steps", "max_iters", "iters", "num_iterations"),
        ("max_steps",),
    ),
    **dict.fromkeys(("epochs", "num_epochs", "max_epochs", "train_epochs"), ("num_train_epochs",)),
    **dict.fromkeys(
        ("batch_size", "bs", "train_batch_size", "micro_batch_size", "per_device_batch_size", "batch"),
        ("per_device_train_batch_size", "global_batch_size"),
    ),
    **dict.fromkeys(("eval_batch_size", "per_device_eval_batch"), ("per_device_eval_batch_size",)),
    **dict.fromkeys(
        ("seq_len", "seq_length", "sequence_length", "max_length", "max_len", "context_length", "ctx_len", "n_ctx"),
        ("max_seq_length", "block_size", "max_new_tokens"),
    ),
    **dict.fromkeys(("max_tokens", "num_tokens", "new_tokens", "length"), ("max_new_tokens",)),
    **dict.fromkeys(("warmup", "warmup_iters", "num_warmup_steps", "warmup_ratio"), ("warmup_steps",)),
    **dict.fromkeys(("wd", "decay"), ("weight_decay",)),
    **dict.fromkeys(("grad_clip", "clip_grad_norm", "gradient_clipping", "clip_norm", "max_norm"), ("max_grad_norm",)),
    **dict.fromkeys(
        ("grad_accum", "accumulation_steps", "gradient_accumulation", "grad_accumulation_steps"),
        ("gradient_accumulation_steps",),
    ),
    **dict.fromkeys(
        ("data", "train_data", "data_path", "train_path", "input", "inputs", "corpus", "text", "file", "dataset"),
        ("train_file", "dataset_dir", "prompt_file", "validation_file"),
    ),
    **dict.fromkeys(
        ("out", "output", "out_dir", "save_dir", "output_path", "outdir", "checkpoint_dir", "save_path"),
        ("output_dir", "out"),
    ),
    **dict.fromkeys(("model", "arch", "architecture", "family", "model_family"), ("model_type", "for_model")),
    **dict.fromkeys(
        ("model_name", "model_path", "pretrained", "init_from", "from_pretrained"), ("model_name_or_path",)
    ),
    **dict.fromkeys(("config", "model_config", "preset"), ("config_name",)),
    **dict.fromkeys(("tokenizer_path", "tok"), ("tokenizer_name", "tokenizer")),
    **dict.fromkeys(("vocab", "n_vocab", "vocabulary_size"), ("vocab_size",)),
    **dict.fromkeys(("log_every", "log_interval", "logging_interval", "log_steps"), ("logging_steps",)),
    **dict.fromkeys(("eval_every", "eval_interval", "evaluation_steps"), ("eval_steps",)),
    **dict.fromkeys(("save_every", "save_interval", "checkpoint_every", "checkpoint_steps"), ("save_steps",)),
    **dict.fromkeys(("optimizer", "optimiser"), ("optim",)),
    **dict.fromkeys(("scheduler", "lr_scheduler", "lr_schedule", "schedule", "lr_decay"), ("lr_scheduler_type",)),
    **dict.fromkeys(("mlm_prob", "mask_prob", "masking_probability", "mask_ratio"), ("mlm_probability",)),
    **dict.fromkeys(("devices", "num_devices", "gpus", "tpus", "n_devices"), ("mesh",)),
    **dict.fromkeys(("random_seed", "rng_seed"), ("seed",)),
    **dict.fromkeys(("checkpoint_step", "ckpt_step"), ("step",)),
}


def to_bool(text: str) -> bool:
    """A boolean flag's value: true/false, 1/0, yes/no, y/n, on/off."""
    if text.lower() in _BOOL_TRUE:
        return True
    if text.lower() in _BOOL_FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def close_flags(name: str, options: Iterable[str]) -> list[str]:
    """The flags among `options` that an unknown `name` (`--lr`, `--max-steps`) probably meant, best first: the same
    flag spelled otherwise, else the flags `ALIASES` gives it, else close spellings."""
    by_key = {option.lstrip("-").lower(): option for option in options if option.startswith("--")}
    key = name.lstrip("-").replace("-", "_").lower()
    if key in by_key:
        return [by_key[key]]
    aliased = [by_key[target] for target in ALIASES.get(key, ()) if target in by_key]
    return aliased or [by_key[k] for k in difflib.get_close_matches(key, list(by_key), n=2, cutoff=0.75)]


def suggestion(unknown: Iterable[str], options: Iterable[str], prefix: str = "--") -> str:
    """'; did you mean --learning_rate?' for the unknown flags among `unknown` (values skipped), '' if nothing is
    close. `prefix`: how a flag is written where the names came from (an arguments file's keys have none)."""
    options = list(options)
    found = []
    for word in unknown:
        name = word.split("=", 1)[0]
        if prefix and not name.startswith(prefix):
            continue  # a value
        close = [option[len("--") :] if not prefix else option for option in close_flags(name, options)]
        if close:
            found.append((name, " or ".join(close)))
    if len(found) == 1:
        return f"; did you mean {found[0][1]}?"
    return "; did you mean " + ", ".join(f"{close} for {name}" for name, close in found) + "?" if found else ""


class Parser(argparse.ArgumentParser):
    """argparse, with an error in one line (a UserError: the verbs print `error: ...` and exit 2) that names the
    verb's --help, and a "did you mean" for an unknown flag."""

    def error(self, message: str):
        raise ArgumentError(f"{message} ({self.prog} --help lists the flags)")

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}{suggestion(extras, self._option_string_actions)}")
        return parsed


# -- the launcher's file of flags (here: the quick answer reads it too) ------------------------------------------------
ARGS_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def args_file_of(argv: list[str]) -> Path | None:
    """The .json/.yaml file of flags a command line starts with, if it does."""
    if argv and not argv[0].startswith("-") and Path(argv[0]).suffix in ARGS_FILE_SUFFIXES:
        return Path(argv[0])
    return None


def read_args_file(path: Path, known: Iterable[str]) -> list[str]:
    """A .json/.yaml mapping of flag names to values, as command-line flags (so values get the flags' types)."""
    if not path.is_file():
        raise ArgumentError(f"argument file {path} does not exist")
    try:
        text = path.read_text()
    except UnicodeDecodeError as e:
        raise ArgumentError(
            f"argument file {path} is not UTF-8 text ({e.reason} at byte {e.start}); give a "
            ".json or .yaml file of flags"
        ) from None
    try:
        values = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as e:
        raise ArgumentError(
            f"argument file {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"argument file {path} is not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(values, dict):
        raise ArgumentError(f"argument file {path} must hold a mapping of flag names to values")
    known = set(known)
    unknown = sorted(set(values) - known)
    if unknown:
        close = suggestion(unknown, [f"--{name}" for name in known], prefix="")
        raise ArgumentError(f"argument file {path}: unknown keys {', '.join(unknown)}{close}")
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items() if v is not None]


# -- a parser as data: what the quick answer rebuilds ------------------------------------------------------------------
_ACTIONS = {
    argparse._StoreAction: "store",
    argparse._StoreTrueAction: "store_true",
    argparse._StoreFalseAction: "store_false",
    argparse._StoreConstAction: "store_const",
    argparse._AppendAction: "append",
    argparse._AppendConstAction: "append_const",
    argparse._CountAction: "count",
    argparse._HelpAction: "help",
    argparse._VersionAction: "version",
}
_TYPES = {None: None, str: "str", int: "int", float: "float", to_bool: "bool"}
_FORMATTERS = {
    cls.__name__: cls
    for cls in (argparse.HelpFormatter, argparse.RawDescriptionHelpFormatter, argparse.RawTextHelpFormatter)
}
ANY_TEXT = "any text"  # a type the quick answer cannot apply (a verb's own parsing function): the verb checks it


class NotDescribable(ValueError):
    """A parser this module cannot write down (a custom action, formatter or value): it gets no quick answer."""


def _plain(value):
    """`value` as JSON has it (tuples as lists), or NotDescribable."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    raise NotDescribable(f"a {type(value).__name__} value")


def _describe_action(parser: argparse.ArgumentParser, action: argparse.Action, where: dict) -> dict:
    kind = _ACTIONS.get(type(action))
    if kind is None:
        raise NotDescribable(f"the action of {action.option_strings or action.dest}: {type(action).__name__}")
    typed = action.type in _TYPES
    help_text = action.help
    if help_text is not None and help_text != argparse.SUPPRESS:  # as --help prints it (defaults filled in)
        help_text = parser._get_formatter()._expand_help(action).replace("%", "%%")
    return {
        "kind": kind,
        "option_strings": list(action.option_strings),
        "dest": action.dest,
        "nargs": _plain(action.nargs),
        "const": _plain(action.const) if kind in ("store", "append", "store_const", "append_const") else None,
        "type": _TYPES[action.type] if typed else ANY_TEXT,
        "choices": _plain(list(action.choices)) if action.choices is not None and typed else None,
        "required": action.required,
        "help": help_text,
        "metavar": _plain(action.metavar),
        "version": getattr(action, "version", None),
        **where,
    }


def describe(parser: argparse.ArgumentParser) -> dict:
    """The parser as JSON data: `rebuild` makes a parser that parses and prints --help as it does (NotDescribable
    where it cannot)."""
    if parser.formatter_class.__name__ not in _FORMATTERS or parser.formatter_class not in _FORMATTERS.values():
        raise NotDescribable(f"the formatter {parser.formatter_class.__name__}")
    groups, exclusive = parser._action_groups, parser._mutually_exclusive_groups
    actions = []
    for action in parser._actions:
        group = next(i for i, g in enumerate(groups) if action in g._group_actions)
        mutex = next((i for i, m in enumerate(exclusive) if action in m._group_actions), None)
        actions.append(_describe_action(parser, action, {"group": group, "exclusive": mutex}))
    return {
        "prog": parser.prog,
        "usage": parser.usage,
        "description": parser.description,
        "epilog": parser.epilog,
        "formatter": parser.formatter_class.__name__,
        "allow_abbrev": parser.allow_abbrev,
        "groups": [{"title": g.title, "description": g.description} for g in groups],
        "exclusive": [
            {"required": m.required, "container": next((i for i, g in enumerate(groups) if g is m._container), None)}
            for m in exclusive
        ],
        "actions": actions,
    }


def _add(target, action: dict) -> None:
    # argparse asks `is SUPPRESS`: the constant itself, not a string read back equal to it
    action = {k: argparse.SUPPRESS if v == argparse.SUPPRESS else v for k, v in action.items()}
    kind, names = action["kind"], action["option_strings"]
    kwargs: dict[str, Any] = {"action": kind, "help": action["help"]}
    if kind in ("help", "version"):
        kwargs["default"] = argparse.SUPPRESS
        if kind == "version":
            kwargs["version"] = action["version"]
    if names and kind not in ("help", "version"):
        kwargs.update(dest=action["dest"], required=action["required"])
    if kind in ("store", "append"):
        kind_type = action["type"]
        kwargs.update(
            nargs=action["nargs"],
            type={"str": str, "int": int, "float": float, "bool": to_bool}.get(kind_type),
            choices=action["choices"],
            metavar=tuple(action["metavar"]) if isinstance(action["metavar"], list) else action["metavar"],
        )
        if action["nargs"] == "?":
            kwargs["const"] = action["const"]
    elif kind in ("store_const", "append_const"):
        kwargs["const"] = action["const"]
    target.add_argument(*(names or [action["dest"]]), **kwargs)


def rebuild(description: Mapping[str, Any]) -> Parser:
    """The parser `describe` wrote down."""
    description = {k: argparse.SUPPRESS if v == argparse.SUPPRESS else v for k, v in description.items()}
    parser = Parser(
        prog=description["prog"],
        usage=description["usage"],
        description=description["description"],
        epilog=description["epilog"],
        formatter_class=_FORMATTERS[description["formatter"]],
        allow_abbrev=description["allow_abbrev"],
        add_help=False,
    )
    groups = parser._action_groups[:2]  # the positionals' and the options', which every parser has
    for i, group in enumerate(description["groups"]):
        if i < 2:
            groups[i].title, groups[i].description = group["title"], group["description"]
        else:
            groups.append(parser.add_argument_group(group["title"], group["description"]))
    exclusive = [
        (parser if m["container"] is None else groups[m["container"]]).add_mutually_exclusive_group(
            required=m["required"]
        )
        for m in description["exclusive"]
    ]
    for action in description["actions"]:
        if action["exclusive"] is not None:
            _add(exclusive[action["exclusive"]], action)
        elif action["group"] < 2:
            _add(parser, action)  # argparse files it under the positionals or the options itself
        else:
            _add(groups[action["group"]], action)
    return parser


# -- remembering a verb's parser ---------------------------------------------------------------------------------------
ENTRY_POINT_GROUPS = ("spmdlm.families", "spmdlm.optimizers", "spmdlm.schedules")  # the registries' plugins
_SOURCE_SUFFIXES = (".py", ".json")  # the files a parser is made from: modules and presets


def flags_folder() -> Path:
    """Where the verbs' parsers are described (beside the token cache's default, ~/.cache/spmdlm)."""
    return Path.home() / ".cache" / "spmdlm" / "flags"


def _code_files(root: Path) -> Iterable[tuple[str, int, int]]:
    if root.is_file():
        stat = root.stat()
        yield str(root), stat.st_mtime_ns, stat.st_size
        return
    for folder, children, files in os.walk(root):
        children[:] = sorted(c for c in children if c != "__pycache__" and not c.startswith("."))
        for name in sorted(files):
            if name.endswith(_SOURCE_SUFFIXES):
                stat = os.stat(os.path.join(folder, name))
                yield os.path.join(folder, name), stat.st_mtime_ns, stat.st_size


def _plugin_roots() -> list[str]:
    """The registries' entry points, and where the code of each lives (its top-level package or module)."""
    found = []
    for group in ENTRY_POINT_GROUPS:
        for entry in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
            found.append(f"{group} {entry.name} = {entry.value}")
            try:
                spec = importlib.util.find_spec(entry.value.split(":")[0].split(".")[0])
            except (ImportError, ValueError):
                spec = None
            if spec is not None:
                found += list(spec.submodule_search_locations or [spec.origin or ""])
    return found


@functools.cache
def fingerprint() -> str:
    """What the verbs' parsers are made from, in one hash: this Python, spmdlm's files and the plugins' (paths,
    sizes and modification times, not contents: a few milliseconds)."""
    digest = hashlib.sha256(f"{sys.version}\0{sys.prefix}\0".encode())
    plugins = _plugin_roots()
    for root in [str(Path(__file__).resolve().parents[1]), *plugins]:
        digest.update(f"{root}\0".encode())
        path = Path(root)
        if root and path.exists():
            for name, mtime, size in _code_files(path):
                digest.update(f"{name}\0{mtime}\0{size}\0".encode())
    return digest.hexdigest()


def verb_of(parser: argparse.ArgumentParser) -> str:
    """The verb a parser is for, from its prog (`python -m spmdlm.launch`: launch)."""
    return parser.prog.rsplit(".", 1)[-1].rsplit("-", 1)[-1]


def save(parser: argparse.ArgumentParser, **extra) -> Path | None:
    """Write the parser's description (and `extra`: what the verb's quick answer also needs) for its verb; None
    where it cannot be described or written (the quick answer is only a speed-up)."""
    try:
        text = json.dumps({"fingerprint": fingerprint(), "parser": describe(parser), **extra})
        folder = flags_folder()
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{verb_of(parser)}.json"
        temporary = path.with_name(f".{path.name}.{os.getpid()}")
        temporary.write_text(text)
        os.replace(temporary, path)  # whole or not at all: two command lines may write at once
        return path
    except Exception:  # not describable, no home, a full disk: the verb still runs, only not as fast next time
        return None


_current: set[str] = set()  # the verbs whose description this process found current, or wrote


def remember(parser: argparse.ArgumentParser, **extra) -> None:
    """In a command line (not a library call), keep the description of the parser it built, once, unless the one
    kept is current."""
    verb = verb_of(parser)
    if command_line_verb() is not None and verb not in _current and save(parser, **extra) is not None:
        _current.add(verb)


def recall(verb: str) -> tuple[Parser, dict] | None:
    """The parser of `verb` as last described and what came with it, if that description is current."""
    try:
        kept = json.loads((flags_folder() / f"{verb}.json").read_text())
        if kept.get("fingerprint") != fingerprint():
            return None
        parser = rebuild(kept.pop("parser"))
    except Exception:  # none, unreadable, of other code, no home: the verb parses at its own speed, as it would
        return None
    _current.add(verb)
    return parser, kept


# -- the quick answer --------------------------------------------------------------------------------------------------
def command_line_verb() -> str | None:
    """The verb this process runs as a command line (`python -m spmdlm.VERB`, the spmdlm-VERB script), or None."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    name = getattr(spec, "name", None) or ""
    if name.startswith("spmdlm.") and name.count(".") == 1:
        return name.split(".")[1]
    script = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else ""
    return script[len("spmdlm-") :] if script.startswith("spmdlm-") else None


def check_bounds(parsed: argparse.Namespace, limits: Mapping[str, Any]) -> None:
    """The numeric flags' bounds (`limits`: name -> a Bounds' fields, or None for any finite number), as the verb
    checks them."""
    for name, value in vars(parsed).items():
        if name in limits:
            bounds.check(name, value, bounds.Bounds(**limits[name]) if limits[name] is not None else None)


def bounds_of(limits: Mapping[str, bounds.Bounds | None]) -> dict[str, Any]:
    """`limits` as `check_bounds` reads them from a description."""
    return {name: dataclasses.asdict(b) if b is not None else None for name, b in limits.items()}


def _parse_run(argv: list[str], launch: tuple[Parser, dict]) -> None:
    """The launcher's command line, as spmdlm.cli.launch.parse_args reads it before the run's sections check it."""
    parser, extra = launch
    path = args_file_of(argv)
    if path is not None:
        argv = read_args_file(path, extra["file_keys"]) + argv[1:]
    check_bounds(parser.parse_args(argv), extra.get("bounds", {}))


def _quick_launch(argv: list[str]) -> None:
    launch = recall("launch")
    if launch is not None:
        _parse_run(argv, launch)


def _quick_evaluate(argv: list[str]) -> None:
    own = recall("evaluate")
    if own is not None:
        _, rest = own[0].parse_known_args(argv)  # --help and its own flags; the rest are the launcher's
        launch = recall("launch")
        if launch is not None:
            _parse_run([*rest, *own[1]["run_flags"]], launch)


def _quick(verb: str, argv: list[str]) -> None:
    kept = recall(verb)
    if kept is not None:
        parser, extra = kept
        check_bounds(parser.parse_args(argv), extra.get("bounds", {}))


QUICK = {"launch": _quick_launch, "evaluate": _quick_evaluate}  # a verb not here: its own parser's description


def answer_early(verb: str | None = None, argv: list[str] | None = None) -> None:
    """Parse this command line against its verb's remembered parser: --help (exit 0) and an argument error (one
    line, exit 2) end the process here; anything else goes on to the verb."""
    verb = verb or command_line_verb()
    if verb is None:
        return
    argv = sys.argv[1:] if argv is None else argv
    try:
        QUICK.get(verb, functools.partial(_quick, verb))(argv)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception:  # a quick answer that cannot be given (a description without what it needs): the verb answers
        return


answer_early()
