"""Batched generation under jit: a prefill, then a decode loop over a preallocated KV cache, for every family whose
`generation` is decoder-only or encoder-decoder (families/base.py: the two protocols); fill-mask for masked LMs.

Shapes are static: the cache has `slots` positions (prompt + new tokens, rounded up to a bucket), so the prefill
compiles once per (batch, prompt bucket, slots) and the decode loop once per (batch, slots), whatever the prompts,
the number of new tokens and the sampling settings (all traced). The decode loop is a `lax.while_loop` of one-token
steps inside one jitted call: no per-token dispatch, and it stops as soon as every row has emitted EOS. Finished rows
emit padding meanwhile, as transformers' generate does.

Decoder-only prompts are left-padded (every row then writes its next token to the same slot; positions come from
the attention mask, `kv_cache.Cache.advance`); encoder inputs are right-padded. The jitted functions take the model's
parameters as arguments (its graph definition is static), so calling `generate` again on an updated model, e.g.
during training, reuses the compiled code.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from spmdlm.errors import GenerateError
from spmdlm.families import get_family
from spmdlm.families.base import Generation
from spmdlm.generation.sampling import Sampling, choose
from spmdlm.mesh import constrain
from spmdlm.models.kv_cache import Cache

PROMPT_BUCKET = 16  # prompt lengths are rounded up to a multiple of this (left padding), ...
SLOT_BUCKET = 64  # ... and cache lengths to a multiple of this: fewer shapes to compile


@dataclasses.dataclass(frozen=True)
class Specials:
    """The token ids generation uses (static: part of the compiled code)."""

    eos: int
    pad: int
    decoder_start: int | None  # encoder-decoders: the decoder's first token
    forced_eos: int | None  # BART: the last new token is forced to EOS (transformers' forced_eos_token_id)
    vocab: int | None = None  # ids the tokenizer assigns (the model's vocabulary may be larger): only these are chosen

    @classmethod
    def of(cls, config, generation: Generation, vocab: int | None = None) -> Specials:
        pad = getattr(config, "pad_token_id", None)
        start = config.decoder_start_token_id if generation is Generation.ENCODER_DECODER else None
        return cls(
            config.eos_token_id,
            config.eos_token_id if pad is None else pad,  # GPT-2 pads with EOS, as HF
            start,
            getattr(config, "forced_eos_token_id", None),
            vocab,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Settings:
    """Per-call values, traced."""

    sampling: Sampling
    key: jax.Array  # the seed's key; each new token's slot is folded in
    end: jax.Array  # the slot after the last new token


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class State:
    cache: Cache  # keys and values of slots [0, cache.index)
    logits: jax.Array  # [B, V] float32: what follows slot cache.index - 1
    tokens: jax.Array  # [B, slots] int32: every slot's token (the prompt or the decoder start, then new tokens)
    finished: jax.Array  # [B] bool: the row has emitted EOS


@functools.partial(jax.jit, static_argnames=("graphdef", "slots", "specials"))
def prefill(graphdef, params, input_ids, attention_mask, *, slots: int, specials: Specials) -> State:
    """Encode (encoder-decoders) and run the decoder's first tokens (the prompt, or decoder_start) into a fresh
    cache."""
    model = nnx.merge(graphdef, params)
    batch = input_ids.shape[0]
    if specials.decoder_start is not None:  # an EncoderDecoderGenerator
        cache = model.init_cache(model.encode(input_ids, attention_mask), attention_mask, slots)
        first = jnp.full((batch, 1), specials.decoder_start, jnp.int32)
        logits, cache = model.extend(first, cache)
    else:  # a DecoderOnlyGenerator
        first = input_ids
        logits, cache = model.extend(first, model.init_cache(batch, slots), attention_mask)
    tokens = jnp.full((batch, slots), specials.pad, jnp.int32).at[:, : first.shape[1]].set(first)
    return State(cache, logits[:, -1].astype(jnp.float32), tokens, jnp.zeros(batch, bool))


@functools.partial(jax.jit, static_argnames=("graphdef", "specials"))
def decode(graphdef, params, state: State, settings: Settings, *, specials: Specials) -> jax.Array:
    """One-token steps until slot `settings.end` or until every row has finished: each chooses the token of slot
    cache.index from the state's logits, then runs it. The last token's run is wasted: the price of having the
    sampling rule once in the compiled code (the prefill does not sample). Returns every slot's token [B, slots],
    replicated (each process of a multi-host run reads them all)."""

    def step(carry):  # the parameters ride in the carry: nnx refuses a model closed over from the outer trace
        params, state = carry
        slot, logits = state.cache.index, state.logits
        if specials.vocab is not None and specials.vocab < logits.shape[-1]:  # never an id the tokenizer lacks
            logits = jnp.where(jnp.arange(logits.shape[-1]) < specials.vocab, logits, -jnp.inf)
        if specials.forced_eos is not None:
            only_eos = jnp.where(jnp.arange(logits.shape[-1]) == specials.forced_eos, 0.0, -jnp.inf)
            logits = jnp.where(slot == settings.end - 1, only_eos, logits)
        token = choose(logits, jax.random.fold_in(settings.key, slot), settings.sampling)
        token = jnp.where(state.finished, specials.pad, token)
        logits, cache = nnx.merge(graphdef, params).extend(token[:, None], state.cache)
        tokens = jax.lax.dynamic_update_slice_in_dim(state.tokens, token[:, None], slot, axis=1)
        return params, State(cache, logits[:, -1].astype(jnp.float32), tokens, state.finished | (token == specials.eos))

    going = lambda carry: (carry[1].cache.index < settings.end) & ~jnp.all(carry[1].finished)
    return constrain(jax.lax.while_loop(going, step, (params, state))[1].tokens, None, None)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _on_params_mesh(params):
    """The mesh the parameters are sharded on (generation runs under it, as training does), if any."""
    for leaf in jax.tree.leaves(params):
        if isinstance(getattr(leaf, "sharding", None), NamedSharding):
            return jax.set_mesh(leaf.sharding.mesh)
    return contextlib.nullcontext()


def encode_prompts(config, tokenizer, prompts: list[str]) -> list[list[int]]:
    """Token ids with the family's framing (T5: `</s>` appended; BART, RoBERTa: `<s> ... </s>`), checked."""
    if isinstance(prompts, str):
        raise TypeError("prompts must be a list of strings")
    if not prompts:
        raise GenerateError("no prompt given")
    encoded = [tokenizer.encode(prompt).ids for prompt in prompts]
    for prompt, ids in zip(prompts, encoded):
        if not prompt.strip() or not ids:
            raise GenerateError("a prompt is empty: give some text to continue")
        if len(ids) > config.max_length:
            raise GenerateError(
                f"a prompt has {len(ids)} tokens, more than the {config.max_length} positions of this model; shorten it"
            )
    return encoded


@dataclasses.dataclass(frozen=True)
class Request:
    """What to generate: how many new tokens and continuations, and how each token is chosen (`temperature` 0:
    greedily). `generate`, `generate_ids` and `generate_tokens` take one, or its fields as keywords."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_samples: int = 1

    def sampling(self) -> Sampling:
        sampling = Sampling(float(self.temperature), int(self.top_k), float(self.top_p))
        try:
            sampling.check()
        except ValueError as e:
            raise GenerateError(str(e)) from None
        if self.max_new_tokens < 1:
            raise GenerateError(f"max_new_tokens ({self.max_new_tokens}) must be at least 1")
        if self.num_samples < 1:
            raise GenerateError(f"num_samples ({self.num_samples}) must be at least 1")
        return sampling


def _request(request: Request | None, fields: dict) -> Request:
    return dataclasses.replace(request or Request(), **fields)


def generate_ids(
    model, config, tokenizer, prompts: list[str], request: Request | None = None, **fields
) -> list[list[int]]:
    """The new token ids of each prompt's `num_samples` continuations (prompt-major), each up to and including its
    EOS if it emitted one. `fields`: those of `Request`, over `request`'s."""
    request = _request(request, fields)
    request.sampling()
    rows = [ids for ids in encode_prompts(config, tokenizer, prompts) for _ in range(request.num_samples)]
    return generate_tokens(model, config, rows, vocab=tokenizer.get_vocab_size(), request=request)


def generate_tokens(
    model, config, rows: list[list[int]], *, vocab: int | None = None, request: Request | None = None, **fields
) -> list[list[int]]:
    """`generate_ids` of prompts given as token ids (framed as the family frames them; one continuation each: a
    request's num_samples is the caller's); only ids below `vocab` (the tokenizer's) are chosen. One compiled program
    per (rows, prompt bucket, cache slots)."""
    generation = get_family(config.model_type).generation
    if generation not in (Generation.DECODER_ONLY, Generation.ENCODER_DECODER):
        use = "use fill-mask" if generation is Generation.FILL_MASK else "it is trained only"
        raise GenerateError(f"a {config.model_type} model does not generate text; {use}")
    request = _request(request, fields)
    sampling = request.sampling()
    specials = Specials.of(config, generation, vocab)
    ids, mask, first = _prompt_batch(config, rows, specials, request.max_new_tokens)
    settings = Settings(sampling, jax.random.key(request.seed), jnp.int32(first + request.max_new_tokens))
    graphdef, params = nnx.split(model)
    with _on_params_mesh(params):
        slots = _round_up(first + request.max_new_tokens, SLOT_BUCKET)
        state = prefill(graphdef, params, ids, mask, slots=slots, specials=specials)
        tokens = decode(graphdef, params, state, settings, specials=specials)
    new = np.asarray(tokens)[:, first : first + request.max_new_tokens]
    ends = [np.flatnonzero(row == specials.eos) for row in new]
    return [row[: end[0] + 1].tolist() if len(end) else row.tolist() for row, end in zip(new, ends)]


def _prompt_batch(config, rows: list[list[int]], specials: Specials, max_new_tokens: int):
    """The prompts as one padded batch: (ids, mask, the slot of the first new token)."""
    longest = max(map(len, rows))
    ids = np.full((len(rows), min(_round_up(longest, PROMPT_BUCKET), config.max_length)), specials.pad, np.int32)
    mask = np.zeros(ids.shape, np.int32)
    if specials.decoder_start is None:  # the prompt is the decoder's: left padding, then the new tokens
        if longest + max_new_tokens > config.max_length:
            raise GenerateError(
                f"a prompt of {longest} tokens plus {max_new_tokens} new ones exceeds the "
                f"{config.max_length} positions of this model; shorten the prompt or ask for fewer"
            )
        for row, prompt in enumerate(rows):
            ids[row, ids.shape[1] - len(prompt) :], mask[row, ids.shape[1] - len(prompt) :] = prompt, 1
        return ids, mask, ids.shape[1]
    # the prompt is the encoder's (right padding); the decoder starts from decoder_start
    if max_new_tokens > config.max_length:
        raise GenerateError(
            f"{max_new_tokens} new tokens exceed the {config.max_length} positions of this "
            f"model's decoder; ask for fewer"
        )
    for row, prompt in enumerate(rows):
        ids[row, : len(prompt)], mask[row, : len(prompt)] = prompt, 1
    return ids, mask, 1


def generate(model, config, tokenizer, prompts: list[str], request: Request | None = None, **fields) -> list[str]:
    """The text of each prompt's `num_samples` continuations (prompt-major), without the prompt and without EOS,
    BOS and padding (T5's sentinels are kept: span corruption generates them). `fields`: those of `Request`."""
    rows = generate_ids(model, config, tokenizer, prompts, _request(request, fields))
    return [continuation_text(config, tokenizer, row) for row in rows]


def continuation_text(config, tokenizer, ids: list[int]) -> str:
    pad = getattr(config, "pad_token_id", None)
    drop = {config.eos_token_id, pad, getattr(config, "bos_token_id", None)}
    return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False)


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _probabilities(graphdef, params, input_ids):
    return jax.nn.softmax(nnx.merge(graphdef, params)(input_ids).astype(jnp.float32), axis=-1)


def mask_token(config) -> str | None:
    """The mask token of the model's tokenizer (its family's: RoBERTa's `<mask>`, ModernBERT's `[MASK]`), the one
    `fill_mask` fills and its output is labelled with; None for a family without one."""
    return get_family(config.model_type).tokenizer.specials.get("mask")


def fill_mask(model, config, tokenizer, text: str, top_k: int = 5) -> list[list[tuple[str, int, float]]]:
    """For each mask token of `text` (`mask_token`), its `top_k` most likely tokens as (text, id, probability), most
    likely first (transformers' fill-mask pipeline: the softmax over the vocabulary at the masked position)."""
    family = get_family(config.model_type)
    mask = mask_token(config)
    if family.generation is not Generation.FILL_MASK:
        raise GenerateError(f"fill-mask needs a masked language model; a {config.model_type} model generates text")
    if top_k < 1:
        raise GenerateError(f"--top_k {top_k}: fill-mask needs at least 1 candidate")
    (ids,) = encode_prompts(config, tokenizer, [text])
    where = [i for i, token in enumerate(ids) if token == tokenizer.token_to_id(mask)]
    if not where:
        raise GenerateError(f"the text has no {mask} to fill")
    graphdef, params = nnx.split(model)
    with _on_params_mesh(params):
        probs = np.asarray(_probabilities(graphdef, params, np.asarray([ids], np.int32))[0, where])
    best = np.argsort(-probs, axis=-1, kind="stable")[:, :top_k]
    return [[(tokenizer.decode([int(i)]), int(i), float(p[i])) for i in row] for p, row in zip(probs, best)]
