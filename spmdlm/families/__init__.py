"""The model families, by model_type. Each is one `Family` object (named FAMILY) in one file of this package: every
module here except `base` is a family, so adding a model adds a file and touches nothing else here."""

from __future__ import annotations

from spmdlm.families.base import Family
from spmdlm.models.config import ConfigError



def _load() -> dict[str, Family]:
    import importlib
    import pkgutil

    families = {}
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base"):
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        families[family.name] = family
    return families


FAMILIES: dict[str, Family] = _load()


def get_family(model_type: str | None) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported; choose one of {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def load_config(config_name: str, model_type: str | None = None, **overrides):
    """A config from a preset name, JSON file or HF directory; `model_type` in the file wins over the argument."""
    from spmdlm.models.config import read_config_source

    values = read_config_source(config_name)
    found = values.get("model_type", model_type)
    if model_type and found and found != model_type and model_type in FAMILIES:
        raise ConfigError(f"--config_name {config_name} is a {found!r} config but --model_type is {model_type!r}")
    family = get_family(found or model_type or "gpt2")
    values.update({k: v for k, v in overrides.items() if v is not None})
    return family.config_class.from_dict(values)


def objective_for_shapes(family: Family, config, seq_len: int | None = None, *, args=None):
    """The family's objective at the run's shapes, for synthetic batches (benchmarks, compile checks).

    Built from a small tokenizer trained on a few words: only lengths and special ids matter for shapes. `args`: the
    run's flags (all of its objective flags); without them, the defaults with `seq_len` as the family's first
    sequence flag (--block_size for GPT-2, --max_seq_length for the others).
    """
    from spmdlm.config import RunArgs
    from spmdlm.data.tokenizer import train_tokenizer

    words = [" ".join(f"w{i}{j}" for j in range(50)) for i in range(20)]
    tokenizer = train_tokenizer(family, words, min(config.vocab_size, 512))
    if args is None:
        args = RunArgs(**({family.sequence_flags[0]: seq_len} if seq_len else {}))
    return family.build_objective(args, config, tokenizer)
