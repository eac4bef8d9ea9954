"""Special tokens: which token of a tokenizer is BOS, EOS, UNK, PAD and MASK, and the token ids a checkpoint's
config.json and generation_config.json give them.

What the tokenizer's own files say (tokenizer_config.json, special_tokens_map.json: `SpecialTokens`, kept with the
tokenizer `spmdlm.data.tokenization.load_tokenizer` returns) decides; a family's table (`TokenizerSpec.specials`) is
the default, for a tokenizer spmdlm trains and for one whose files name none (`token_roles`). A role the family's
objective needs and the tokenizer lacks is refused in one line that says how to add it (`special_token_ids`). A
checkpoint's config.json and generation_config.json ids travel with its tokenizer (`from_checkpoint`), so that the
export (spmdlm.hf_export) says what the checkpoint said, an EOS list as a list.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from tokenizers import Tokenizer

from spmdlm.errors import TokenizerError

log = logging.getLogger("spmdlm")

ROLES = ("bos", "eos", "unk", "pad", "mask")


@dataclasses.dataclass(frozen=True)
class TokenizerSpec:
    """The tokenizer a model family trains and the special tokens it relies on."""

    kind: str  # "bpe" (byte-level BPE) or "unigram" (SentencePiece-style, T5)
    specials: dict[str, str | None]  # role (bos/eos/unk/pad/mask) -> token, None where the model has none
    trained_order: tuple[str, ...]  # specials in id order when we train a tokenizer (ids 0, 1, 2, ...)
    hf_class: str | None = None  # tokenizer_config.json class when transformers rebuilds it identically
    num_sentinels: int = 0  # T5's <extra_id_k>
    frames_with_bos: bool = False  # RoBERTa/BART: every text is <s> ... </s>
    # What the tokenizer returns (tokenizer_config.json): the model's inputs. transformers 4.x's generic tokenizer
    # class adds token_type_ids otherwise, which T5 and the others do not take.
    model_input_names: tuple[str, ...] = ("input_ids", "attention_mask")
    # The roles the model's objective cannot do without (None: every role `specials` names); a tokenizer lacking
    # one is refused in one line that says how to add it (special_token_ids)
    required: tuple[str, ...] | None = None

    @property
    def needs(self) -> tuple[str, ...]:
        if self.required is not None:
            return self.required
        return tuple(role for role, token in self.specials.items() if token is not None)


def tokenizer_spec(family_or_spec) -> TokenizerSpec:
    """A TokenizerSpec, given itself or a model family (anything with a `tokenizer` spec)."""
    return family_or_spec if isinstance(family_or_spec, TokenizerSpec) else family_or_spec.tokenizer


# -- special tokens: what the tokenizer's own files say ----------------------------------------------------------------
SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # where transformers keeps the special tokens
NAME_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "mask_token", "cls_token", "sep_token")
CONFIG_ROLES = ("bos", "eos", "pad")  # the roles config.json and generation_config.json give ids (`*_token_id`)
_ATTRIBUTE = "spmdlm_special_tokens"  # where a loaded tokenizer keeps its SpecialTokens


@dataclasses.dataclass(frozen=True)
class CheckpointIds:
    """The token ids a checkpoint's config.json and generation_config.json give, as they were (an EOS list stays
    a list), and the roles the run's tokenizer changes from the checkpoint's (--tokenizer_name): what the export
    writes (hf_export)."""

    config: dict[str, Any]  # config.json's `*_token_id` entries
    generation: dict[str, Any] | None  # generation_config.json, whole
    changed: dict[str, int | None]  # role (bos/eos/pad) -> the run tokenizer's id, where it is not the checkpoint's


@dataclasses.dataclass(frozen=True)
class SpecialTokens:
    """What a tokenizer directory's own files say of its special tokens, kept with the tokenizer loaded from it."""

    names: dict[str, str | None] | None  # NAME_KEYS found in the files -> token (None: declared null); None: none
    files: dict[str, dict]  # SIDE_FILES found -> their JSON object, written back as they were (save_tokenizer)
    checkpoint: CheckpointIds | None = None


def special_tokens_of(tok) -> SpecialTokens | None:
    """The SpecialTokens a tokenizer was loaded with (load_tokenizer), or None: spmdlm trained it, or its folder said
    nothing of them."""
    return getattr(tok, _ATTRIBUTE, None)


def _keep(tok, tokens: SpecialTokens | None):
    if tokens is not None:
        setattr(tok, _ATTRIBUTE, tokens)
    return tok


def _json_object(file) -> dict | None:
    try:
        value = json.loads(file.read_text()) if file.is_file() else None
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _token_text(value) -> str | None:
    """A special token as the files write it: a string, an AddedToken's dict ({"content": ...}), or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def declared_tokens(folder) -> SpecialTokens | None:
    """The special tokens a tokenizer directory's files declare (tokenizer_config.json, then special_tokens_map.json
    over it, as transformers reads them), or None where it has neither file."""
    files = {name: obj for name in SIDE_FILES if (obj := _json_object(folder / name)) is not None}
    if not files:
        return None
    names: dict[str, str | None] = {}
    for obj in files.values():
        names.update({key: _token_text(obj[key]) for key in NAME_KEYS if key in obj})
    return SpecialTokens(names or None, files)


def with_declared(tok, folder):
    """`tok` keeping the special tokens its directory's files declare (special_tokens_of)."""
    return _keep(tok, declared_tokens(folder))


def _role_keys(spec: TokenizerSpec, role: str) -> tuple[str, ...]:
    """The tokenizer_config.json keys that name a role, the first declared wins: an encoder that frames its texts
    (RoBERTa, ModernBERT) frames them with its cls and sep tokens."""
    framing = {"bos": "cls_token", "eos": "sep_token"}
    return ((framing[role],) if spec.frames_with_bos and role in framing else ()) + (f"{role}_token",)


def token_roles(tok, family, declared: SpecialTokens | None = None) -> dict[str, str | None]:
    """Which token of `tok` is each of bos/eos/unk/pad/mask (None: it has none): what its own files declare
    (`declared`, default those it was loaded with); a role they do not name, and every role of a tokenizer whose files
    name none (one spmdlm trained), is the family's (`family`: a family or TokenizerSpec), where `tok` has that
    token. A declared token `tok` lacks is no token."""
    spec = tokenizer_spec(family)
    tokens = declared or special_tokens_of(tok)
    if tokens is None or tokens.names is None:
        return dict(spec.specials)
    roles = {}
    for role, default in spec.specials.items():
        key = next((k for k in _role_keys(spec, role) if k in tokens.names), None)
        token = tokens.names[key] if key else default
        roles[role] = token if token is not None and tok.token_to_id(token) is not None else None
    return roles


_PURPOSE = {"bos": "to open each example", "eos": "to end each document", "pad": "to pad examples"}
_PURPOSE.update(unk="for unknown text", mask="to mask the tokens it learns from")


def special_token_ids(tok: Tokenizer, family) -> dict[str, int | None]:
    """Ids of bos/eos/unk/pad/mask (token_roles; None where the tokenizer has no such token). A role the family's
    objective needs (TokenizerSpec.needs) and the tokenizer lacks is refused in one line that says how to add it."""
    spec = tokenizer_spec(family)
    roles = token_roles(tok, spec)
    ids = {role: None if token is None else tok.token_to_id(token) for role, token in roles.items()}
    missing = [role for role in spec.needs if ids.get(role) is None]
    if missing:
        named = lambda role: spec.specials.get(role) or f"<{role}>"
        lacks = ", ".join(f"{role} token {named(role)!r} ({_PURPOSE[role]})" for role in missing)
        added = ", ".join(f"'{_role_keys(spec, role)[-1]}': {named(role)!r}" for role in missing)
        raise TokenizerError(
            f"the tokenizer has no {lacks}, which this model needs: add {'it' if len(missing) == 1 else 'them'} "
            f"with transformers (tok = AutoTokenizer.from_pretrained(DIR); tok.add_special_tokens({{{added}}}); "
            "tok.save_pretrained(NEW)) and pass --tokenizer_name NEW (beside --model_name_or_path the embedding "
            "grows by the new rows), or let spmdlm train a tokenizer"
        )
    return ids


def from_checkpoint(tok, folder, family, *, own=None, given: str | None = None):
    """`tok`, the run's tokenizer over the checkpoint in `folder` whose own tokenizer is `own` (None: it has none;
    `tok` may be it, or one given that extends it), keeping the token ids of the checkpoint's config.json and
    generation_config.json for the export. A tokenizer whose files name no special tokens takes the checkpoint's;
    one that names others (`given`: which, for the log) changes the checkpoint's: one line says which, and the
    export's ids follow it."""
    config = _json_object(folder / "config.json")
    if config is None:
        return tok
    theirs_declared = special_tokens_of(own) if own is not None else None
    tokens = special_tokens_of(tok)
    if (tokens is None or tokens.names is None) and theirs_declared is not None:
        tokens = theirs_declared  # e.g. a bare tokenizer.json that extends the checkpoint's: its tokens are theirs
    run_roles = token_roles(tok, family, tokens)
    theirs = token_roles(own, family) if own is not None else run_roles  # the old tokens keep their ids in `tok`
    id_of = lambda token: None if token is None else tok.token_to_id(token)
    pairs = {role: (theirs.get(role), run_roles.get(role)) for role in ROLES}
    moved = {role: (old, new) for role, (old, new) in pairs.items() if id_of(old) != id_of(new)}
    if moved and given:
        log.warning(
            "%s changes the special tokens of the checkpoint %s: %s; the export's tokenizer, config.json and "
            "generation_config.json say so",
            given,
            folder,
            ", ".join(f"{role} {old!r} -> {new!r}" for role, (old, new) in moved.items()),
        )
    checkpoint = CheckpointIds(
        {k: v for k, v in config.items() if k.endswith("_token_id")},
        _json_object(folder / "generation_config.json"),
        {role: id_of(new) for role, (_, new) in moved.items() if role in CONFIG_ROLES},
    )
    return _keep(tok, dataclasses.replace(tokens or SpecialTokens(None, {}), checkpoint=checkpoint))


def declared_files(tok, family, *, pad_with_eos: bool = False) -> dict[str, dict] | None:
    """The side files (SIDE_FILES) to write for `tok` as its own files had them, or None where they name no special
    tokens (the family's files are written then). `pad_with_eos` (an export of a decoder): where a checkpoint's
    tokenizer names no pad token, the EOS pads, as Llama 3 users set `tokenizer.pad_token = tokenizer.eos_token`, so
    that `tokenizer(texts, padding=True)` works (one line says so; config.json keeps the checkpoint's ids)."""
    tokens = special_tokens_of(tok)
    if tokens is None or tokens.names is None:
        return None
    files = {name: dict(obj) for name, obj in tokens.files.items()}
    roles = token_roles(tok, family)
    if pad_with_eos and tokens.checkpoint is not None and roles["pad"] is None and roles["eos"] is not None:
        for obj in files.values():
            obj["pad_token"] = roles["eos"]
        log.info(
            "the tokenizer names no pad token: the export's pads with its EOS %r (as tokenizer.pad_token = "
            "tokenizer.eos_token), so that tokenizer(texts, padding=True) works; its config.json and "
            "generation_config.json keep the checkpoint's ids",
            roles["eos"],
        )
    return files


def all_special_ids(tok: Tokenizer, family) -> tuple[int, ...]:
    """Every special id: the family's roles and any other token the tokenizer marks special (never masked)."""
    roles = {i for i in special_token_ids(tok, family).values() if i is not None}
    added = {i for i, token in tok.get_added_tokens_decoder().items() if token.special}
    return tuple(sorted(roles | added))
