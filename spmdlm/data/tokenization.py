"""Train, load and save tokenizers (HF `tokenizers`), and the special-token facts each model type relies on.

GPT-2, RoBERTa and BART use byte-level BPE; T5 uses a SentencePiece-style Unigram model with T5's 100 sentinels.
`save_tokenizer` writes a directory that `transformers.AutoTokenizer.from_pretrained` loads to exactly the ids that
the `tokenizers.Tokenizer` gives during data preparation.

Which tokens are BOS, EOS, UNK, PAD and MASK is what the tokenizer's own files say, kept with the tokenizer that
`load_tokenizer` returns; a family's table is the default (spmdlm/data/special_tokens.py).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from spmdlm import storage
from spmdlm.crashpoints import crash_point
from spmdlm.data.records import in_pieces
from spmdlm.data.special_tokens import ROLES as ROLES
from spmdlm.data.special_tokens import TokenizerSpec as TokenizerSpec
from spmdlm.data.special_tokens import all_special_ids as all_special_ids
from spmdlm.data.special_tokens import declared_files, with_declared
from spmdlm.data.special_tokens import from_checkpoint as from_checkpoint
from spmdlm.data.special_tokens import special_token_ids as special_token_ids
from spmdlm.data.special_tokens import special_tokens_of as special_tokens_of
from spmdlm.data.special_tokens import token_roles as token_roles
from spmdlm.data.special_tokens import tokenizer_spec as tokenizer_spec
from spmdlm.errors import TokenizerError

_GENERIC_HF_CLASS = "PreTrainedTokenizerFast"


def _counted(texts: Iterable[str], seen: list[int]) -> Iterator[str]:
    # Counts texts as the trainer consumes them, so an empty corpus is caught without materialising it.
    for text in texts:
        seen[0] += 1
        yield text


def train_tokenizer(
    family,
    texts: Iterable[str],
    vocab_size: int,
    *,
    min_frequency: int = 2,
    lowercase: bool = False,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a tokenizer for a family (or model_type name) on `texts`. The result is deterministic for the same texts.

    `texts` may be any iterable (a generator over files: the corpus is never held in memory, only the trainer's
    word counts); `show_progress` shows the Rust trainer's own progress bars (on stderr).

    `vocab_size` is the size of the whole vocabulary, specials included; for T5 that includes the 100 sentinels, so
    the Unigram model gets `vocab_size - 100` pieces (the HF recipe trained 32000 and let transformers append 100,
    giving 32100). A corpus too small to support that many pieces gives a smaller vocabulary, as the trainers do.
    `min_frequency` applies to BPE merges only (the Unigram trainer has no such knob).
    """
    spec = tokenizer_spec(family)
    specials = list(spec.trained_order)
    seen = [0]
    if spec.kind == "unigram":
        tok = _unigram_t5(specials, lowercase)
        unigram_size = vocab_size - spec.num_sentinels
        if unigram_size <= len(specials):
            raise TokenizerError(
                f"vocab_size {vocab_size} leaves no room for pieces after {spec.num_sentinels} sentinels and "
                f"{len(specials)} specials: raise --vocab_size"
            )
        trainer = trainers.UnigramTrainer(
            vocab_size=unigram_size, special_tokens=specials, unk_token="<unk>", show_progress=show_progress
        )
    else:
        tok = _byte_level_bpe(specials, lowercase)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
        if vocab_size < len(alphabet) + len(specials):
            raise TokenizerError(
                f"vocab_size {vocab_size} is below the {len(alphabet)}-byte alphabet plus {len(specials)} specials: "
                "raise --vocab_size"
            )
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=specials,
            initial_alphabet=alphabet,  # every byte is encodable, so BPE never needs an unk
            show_progress=show_progress,
        )
    # documents cut as the record writer cuts them: the same word counts, and memory bounded by a piece (one 50 MB
    # document trained whole peaked at 5 GB)
    tok.train_from_iterator(_counted(in_pieces(texts), seen), trainer=trainer)
    if seen[0] == 0:
        raise TokenizerError("no training text for the tokenizer: check --train_file / --dataset_name")
    if spec.kind == "unigram":
        tok = _canonical_unigram(tok, num_specials=len(specials))
    if spec.num_sentinels:
        # Google's order: <extra_id_0> is the last id (len-1), <extra_id_99> is len-100.
        tok.add_special_tokens([f"<extra_id_{k}>" for k in reversed(range(spec.num_sentinels))])
    return tok


def _byte_level_bpe(specials: list[str], lowercase: bool) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    if lowercase:
        tok.normalizer = normalizers.Lowercase()
    # GPT-2 and RobertaTokenizerFast both default to add_prefix_space=False.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if "<s>" in specials:  # RoBERTa and BART frame every text as <s> ... </s>
        tok.post_processor = processors.RobertaProcessing(
            ("</s>", specials.index("</s>")), ("<s>", specials.index("<s>")), trim_offsets=True, add_prefix_space=False
        )
    elif "[CLS]" in specials:  # ModernBERT frames every text as [CLS] ... [SEP]
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]",
            pair="[CLS] $A [SEP] $B [SEP]",
            special_tokens=[(token, specials.index(token)) for token in ("[CLS]", "[SEP]")],
        )
    else:  # GPT-2 adds nothing
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _unigram_t5(specials: list[str], lowercase: bool) -> Tokenizer:
    # The recipe's t5_tokenizer_model.py pipeline, written against the current API (Metaspace prepend_scheme).
    steps = [normalizers.Nmt(), normalizers.NFKC(), normalizers.Replace(Regex(" {2,}"), " ")]
    if lowercase:
        steps.append(normalizers.Lowercase())
    tok = Tokenizer(models.Unigram())
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always"),
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.Punctuation(),
        ]
    )
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    # T5 appends only EOS.
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", specials.index("</s>"))]
    )
    return tok


def _canonical_unigram(tok: Tokenizer, num_specials: int) -> Tokenizer:
    """Make a trained Unigram model a function of the texts alone.

    The trainer iterates randomly ordered hash maps, so between runs (1) its float sums differ in the last bits and
    ids sorted by score swap places, and (2) characters it saw but pruned get the scores min, min+1e-4,
    min+2e-4, ... in a random order. So: hand those ladder scores out in character order, round all scores far below
    anything that changes a segmentation, and give ids in code-point order after the specials.
    """
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    scores = {piece: score for piece, score in vocab[num_specials:]}
    floor, step, ladder = min(scores.values()), 0.0, set()
    for _ in scores:  # the trainer's own float arithmetic, so the ladder matches bit for bit
        ladder.add(floor + step)
        step += 0.0001
    laddered = sorted(piece for piece, score in scores.items() if len(piece) == 1 and score in ladder)
    scores.update(zip(laddered, sorted((scores[piece] for piece in laddered), reverse=True)))
    spec["model"]["vocab"] = vocab[:num_specials] + [[piece, round(scores[piece], 6)] for piece in sorted(scores)]
    return Tokenizer.from_str(json.dumps(spec))


SPIECE_NAME = "spiece.model"
SPM_BPE_NAME = "sentencepiece.bpe.model"
# How a transformers checkpoint ships its tokenizer, in the order transformers prefers them; all but the first are
# converted by transformers itself (its slow -> fast conversion, which reads SentencePiece models through protobuf).
TOKENIZER_LAYOUTS = (("tokenizer.json",), ("vocab.json", "merges.txt"), (SPIECE_NAME,), (SPM_BPE_NAME,))
# Read beside a layout's files: the special tokens, added tokens and the class to build (transformers' own rules).
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "config.json")


def tokenizer_layout(folder) -> tuple[str, ...] | None:
    """The files of the tokenizer a directory holds (the first layout of TOKENIZER_LAYOUTS found), or None."""
    if not folder.is_dir():
        return None
    return next((layout for layout in TOKENIZER_LAYOUTS if all((folder / name).is_file() for name in layout)), None)


def load_tokenizer(path: str | os.PathLike, family=None) -> Tokenizer:
    """Load a tokenizer.json file, a SentencePiece `.model` file, or the tokenizer of a directory in any layout a
    transformers checkpoint ships (TOKENIZER_LAYOUTS). Files other than tokenizer.json are converted by transformers
    with the class tokenizer_config.json names, else the layout's class for `family` (a family or TokenizerSpec):
    vocab.json + merges.txt -> GPT-2's or RoBERTa's byte-level BPE, spiece.model -> T5's (100 sentinels appended),
    sentencepiece.bpe.model -> XLM-R's (fairseq ids). A gs:// path is read from the bucket (only the files needed)."""
    path = storage.path(path, "--tokenizer_name")
    file = path
    if path.is_dir():
        layout = tokenizer_layout(path) or ("tokenizer.json",)
        if layout != ("tokenizer.json",):
            return with_declared(converted_tokenizer(path, layout, family), path)
        file = path / "tokenizer.json"
    if file.is_file() and file.suffix == ".model":
        return spiece_tokenizer(file)
    if not file.is_file():
        raise TokenizerError(
            f"no tokenizer at {path}: expected a tokenizer.json file, vocab.json + merges.txt, a SentencePiece "
            f"{SPIECE_NAME} or {SPM_BPE_NAME}, or a directory holding one; fix --tokenizer_name or train a new "
            "tokenizer"
        )
    try:
        tok = Tokenizer.from_str(file.read_text()) if storage.is_remote(file) else Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception on malformed JSON
        raise TokenizerError(f"cannot read tokenizer {file}: {e}") from e
    return with_declared(tok, path) if path.is_dir() else tok


def _layout_class(folder, layout: tuple[str, ...], family) -> str | None:
    """The transformers tokenizer class for a layout; None: AutoTokenizer decides (tokenizer_config.json names the
    class, or config.json's model_type gives it)."""
    config = folder / "tokenizer_config.json"
    if config.is_file() and json.loads(config.read_text()).get("tokenizer_class"):
        return None
    if layout == (SPIECE_NAME,):
        return "T5Tokenizer"
    if layout == (SPM_BPE_NAME,):
        return "XLMRobertaTokenizer"
    if family is None:
        return None
    return "RobertaTokenizer" if tokenizer_spec(family).frames_with_bos else "GPT2Tokenizer"


def converted_tokenizer(folder, layout: tuple[str, ...], family=None) -> Tokenizer:
    """The `tokenizers.Tokenizer` transformers builds from a checkpoint's tokenizer files (vocab.json + merges.txt,
    a SentencePiece model), with the special and added tokens its side files declare."""
    files = {name: folder / name for name in layout + TOKENIZER_SIDE_FILES if (folder / name).is_file()}
    return _through_transformers(files, _layout_class(folder, layout, family), folder)


def spiece_tokenizer(model_file: str | os.PathLike) -> Tokenizer:
    """A SentencePiece model as the `tokenizers.Tokenizer` of `T5TokenizerFast.from_pretrained` on a directory that
    holds only that model (T5's defaults: 100 <extra_id_k> sentinels, <extra_id_0> last; EOS appended)."""
    return _through_transformers({SPIECE_NAME: storage.path(model_file)}, "T5Tokenizer", model_file)


def _through_transformers(files: dict, class_name: str | None, source) -> Tokenizer:
    """transformers' tokenizer of `files` (name in a private directory -> where it is), as a tokenizers.Tokenizer.

    transformers is needed here only (no torch). In transformers 5 a tokenizer class given `vocab_file=` ignores the
    file, and only `from_pretrained` converts it: hence the private copy (also of a bucket's files)."""
    import logging
    import tempfile

    import sentencepiece
    import transformers
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity(logging.ERROR)
    try:
        with tempfile.TemporaryDirectory(prefix="spmdlm-tokenizer-") as folder:
            for name, file in files.items():
                (Path(folder) / name).write_bytes(file.read_bytes())
                if name.endswith(".model"):  # a readable model, or one line saying why not
                    try:
                        sentencepiece.SentencePieceProcessor(model_file=str(Path(folder) / name))
                    except Exception as e:  # RuntimeError/OSError with a multi-line message
                        raise TokenizerError(f"cannot read SentencePiece model {file}: {_one_line(e)}") from None
            cls = (
                transformers.AutoTokenizer
                if class_name is None
                else getattr(transformers, f"{class_name}Fast", None) or getattr(transformers, class_name)
            )
            converted = cls.from_pretrained(folder, local_files_only=True)
    except TokenizerError:
        raise
    except Exception as e:  # noqa: BLE001 - transformers' conversion errors come in many types
        raise TokenizerError(
            f"cannot convert the tokenizer of {source}: {_one_line(e)}{_unknown_class_note(files)}"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return Tokenizer.from_str(converted.backend_tokenizer.to_str())


def _one_line(error: Exception, limit: int = 600) -> str:
    """An error's whole message on one line (transformers' list the choices over several lines), at most `limit`
    characters."""
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _unknown_class_note(files: dict) -> str:
    """Where tokenizer_config.json names a tokenizer_class transformers does not have (it then tries a generic class,
    which reads only tokenizer.json): that class, and the fix."""
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = files.get("tokenizer_config.json")
    try:
        name = json.loads(config.read_text()).get("tokenizer_class") if config is not None else None
    except (OSError, ValueError, AttributeError):
        return ""
    if not isinstance(name, str) or any(tokenizer_class_from_name(n) for n in (name, name.removesuffix("Fast"))):
        return ""
    return (
        f" (its tokenizer_config.json names tokenizer_class {name!r}, which this transformers does not have: set it "
        "to the model's class, e.g. GPT2Tokenizer, or remove it)"
    )


def save_tokenizer(
    tok: Tokenizer, out_dir: str | os.PathLike, family, model_max_length: int, *, pad_with_eos: bool = False
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for transformers' AutoTokenizer.

    A tokenizer loaded with files that name its special tokens (special_tokens_of) gets them back as they were: the
    same special tokens, class and settings (`pad_with_eos`: special_tokens.declared_files). Otherwise AutoTokenizer
    gives GPT2/Roberta/BartTokenizerFast for byte-level BPE tokenizers, and the generic PreTrainedTokenizerFast
    (TokenizersBackend in transformers 5) for t5 and lowercased BPE (see `_hf_class`), with the same ids as `tok` in
    every case.
    """
    spec = tokenizer_spec(family)
    files = declared_files(tok, spec, pad_with_eos=pad_with_eos)
    if files is not None:
        with storage.writing_dir(out_dir) as folder:
            for name, obj in files.items():
                (folder / name).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
            crash_point("tokenizer.during_write", folder / "tokenizer.json")
            tok.save(str(folder / "tokenizer.json"))
        return
    special_token_ids(tok, spec)  # fail before writing anything
    special_map = {f"{role}_token": token for role, token in spec.specials.items() if token is not None}
    config = {
        "tokenizer_class": _hf_class(tok, spec),
        "model_max_length": model_max_length,
        "model_input_names": list(spec.model_input_names),
        **special_map,
    }
    if spec.num_sentinels:
        sentinel_ids(tok, spec.num_sentinels)
        sentinels = [f"<extra_id_{k}>" for k in range(spec.num_sentinels)]
        special_map["additional_special_tokens"] = sentinels
        # Explicitly no extra ids: T5TokenizerFast would append any of its 100 missing from the vocab (with
        # <extra_id_0> lowest, the reverse of Google's order); ours are all there already.
        config.update(additional_special_tokens=sentinels, extra_ids=0)
    else:
        config["add_prefix_space"] = False
        if spec.frames_with_bos:
            framing = {"sep_token": spec.specials["eos"], "cls_token": spec.specials["bos"]}
            special_map.update(framing)
            config.update(framing, trim_offsets=True)
    # tokenizer.json last: a run that finds it in its output dir takes the tokenizer there as whole
    with storage.writing_dir(out_dir) as folder:  # a bucket's files are uploaded at the end
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2, ensure_ascii=False) + "\n")
        crash_point("tokenizer.during_write", folder / "tokenizer.json")
        tok.save(str(folder / "tokenizer.json"))


def _hf_class(tok: Tokenizer, spec: TokenizerSpec) -> str:
    """The tokenizer class to name in tokenizer_config.json.

    transformers 5's model-specific classes rebuild the pipeline from tokenizer.json's vocab alone: GPT2/Roberta
    keep no normalizer and a ByteLevel pre-tokenizer; T5Tokenizer keeps only the vocab, the post-processor and a
    Precompiled normalizer, so it drops our Nmt/NFKC/space-run normalizer and replaces the Digits/Punctuation
    pre-tokenizer with WhitespaceSplit + Metaspace, which changes ids (digits, punctuation, the space before a sentinel,
    NFKC forms). Where the rebuild would differ, name the generic class, which loads tokenizer.json as written.
    """
    saved = json.loads(tok.to_str())
    pre = saved.get("pre_tokenizer") or {}
    rebuilt_identically = (
        spec.hf_class is not None
        and saved["model"]["type"] == "BPE"
        and saved.get("normalizer") is None
        and pre.get("type") == "ByteLevel"
        and pre.get("add_prefix_space") is False
    )
    return spec.hf_class if rebuilt_identically else _GENERIC_HF_CLASS


_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def token_byte_lengths(tok: Tokenizer, size: int) -> np.ndarray:
    """int32 [size]: the UTF-8 bytes of text each id stands for, what bits per byte divides by (docs/evaluation.md).
    Byte-level BPE: one byte per character of the token (each character stands for one byte, so a token holding part
    of a character counts its part); otherwise the piece's UTF-8 with '▁' as one space, a byte-fallback piece
    <0xNN> one byte. Special tokens (sentinels, EOS, <unk>, ...) and ids past the tokenizer's vocabulary 0; an added
    token that is not special: its text."""
    saved = json.loads(tok.to_str())
    byte_level = "ByteLevel" in json.dumps(saved.get("decoder"))
    byte_fallback = bool((saved.get("model") or {}).get("byte_fallback"))
    added = tok.get_added_tokens_decoder()
    lengths = np.zeros(size, np.int32)
    for piece, i in tok.get_vocab(with_added_tokens=True).items():
        if i >= size or (i in added and added[i].special):
            continue
        if i in added:
            lengths[i] = len(piece.encode())
        elif byte_level:
            lengths[i] = len(piece)
        elif byte_fallback and _BYTE_FALLBACK.fullmatch(piece):
            lengths[i] = 1
        else:
            lengths[i] = len(piece.replace("▁", " ").encode())
    return lengths


def sentinel_ids(tok: Tokenizer, count: int = 100) -> np.ndarray:
    """int32 array whose [k] is the id of <extra_id_k>."""
    ids = [tok.token_to_id(f"<extra_id_{k}>") for k in range(count)]
    missing = [k for k, i in enumerate(ids) if i is None]
    if missing:
        raise TokenizerError(
            f"the tokenizer lacks {len(missing)} of {count} sentinels (first: <extra_id_{missing[0]}>): "
            "use a T5 tokenizer or let spmdlm train one with --model_type t5"
        )
    return np.asarray(ids, dtype=np.int32)
