"""Packed rows (segment ids): every family, every attention implementation this CPU runs.

A row packing several documents must give each document the logits (and so the loss) it gets alone in a row of its
own, and changing one document's tokens must change no other document's logits at all (exactly zero difference).
The fused paths run here as on an accelerator, except that splash runs in Pallas' interpret mode; its blocks are
128 wide, so the rows are 128 tokens long.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from family_fixtures import FIXTURES
from flax import nnx

from spmdlm.data.objectives import segments
from spmdlm.families import families
from spmdlm.models.attention import segment_positions

LENGTH = 128  # the splash kernel's block width
IMPLEMENTATIONS = ("xla", "dot_product", "splash")
# Documents per packed row: lengths (encoder, decoder for encoder-decoders) with a 1-token one and padding after.
SINGLE_STACK_DOCS = [40, 1, 57]
ENCODER_DECODER_DOCS = [(50, 20), (3, 1), (45, 38)]
LONGER_POSITIONS = {
    "gpt2": dict(n_positions=LENGTH),
    "roberta": dict(max_position_embeddings=LENGTH + 2),
    "bart": dict(max_position_embeddings=LENGTH),
    "t5": {},
    "modernbert": {},
    "llama": {},
    "qwen3": {},
}


def make_model(name: str, implementation: str):
    family = families()[name]
    values = {k: v for k, v in FIXTURES[name].tiny_config.items() if k != "model_type"}
    config = family.config_class(**{**values, **LONGER_POSITIONS[name]})
    return family, family.make_model(config, rngs=nnx.Rngs(0), attention=implementation)


def pack(docs: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """One row of `docs` back to back, right-padded to LENGTH: (ids, segment ids counted from 1, 0 = padding)."""
    ids = np.full(LENGTH, pad_id, np.int32)
    segments = np.zeros(LENGTH, np.int32)
    at = 0
    for k, doc in enumerate(docs, 1):
        ids[at : at + len(doc)], segments[at : at + len(doc)] = doc, k
        at += len(doc)
    return ids[None], segments[None]


def alone(docs: list[np.ndarray], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Each doc in a row of its own, right-padded: (ids, attention mask)."""
    ids = np.full((len(docs), LENGTH), pad_id, np.int32)
    mask = np.zeros((len(docs), LENGTH), np.int32)
    for row, doc in enumerate(docs):
        ids[row, : len(doc)], mask[row, : len(doc)] = doc, 1
    return ids, mask


def spans(lengths: list[int]) -> list[slice]:
    starts = np.cumsum([0, *lengths[:-1]])
    return [slice(int(s), int(s) + n) for s, n in zip(starts, lengths)]


def batches(family, config, rng):
    """(packed batch, batch of each document alone, the lengths the logits are read over) for the family."""
    pad_id = getattr(config, "pad_token_id", None) or 0  # GPT-2 and Llama have none
    vocab = config.vocab_size
    if not family.is_encoder_decoder:
        docs = [rng.integers(3, vocab, n, dtype=np.int32) for n in SINGLE_STACK_DOCS]
        ids, segments = pack(docs, pad_id)
        single, mask = alone(docs, pad_id)
        return (
            {"input_ids": ids, "attention_mask": (segments > 0).astype(np.int32), "segment_ids": segments},
            {"input_ids": single, "attention_mask": mask},
            SINGLE_STACK_DOCS,
        )
    encoder = [rng.integers(3, vocab, n, dtype=np.int32) for n, _ in ENCODER_DECODER_DOCS]
    decoder = [rng.integers(3, vocab, n, dtype=np.int32) for _, n in ENCODER_DECODER_DOCS]
    (ids, segments), (dec, dec_segments) = pack(encoder, pad_id), pack(decoder, pad_id)
    (single, mask), (single_dec, dec_mask) = alone(encoder, pad_id), alone(decoder, pad_id)
    packed = {
        "input_ids": ids,
        "attention_mask": (segments > 0).astype(np.int32),
        "segment_ids": segments,
        "decoder_input_ids": dec,
        "decoder_attention_mask": (dec_segments > 0).astype(np.int32),
        "decoder_segment_ids": dec_segments,
    }
    return (
        packed,
        {
            "input_ids": single,
            "attention_mask": mask,
            "decoder_input_ids": single_dec,
            "decoder_attention_mask": dec_mask,
        },
        [n for _, n in ENCODER_DECODER_DOCS],
    )


def compiled_forward(family, model):
    """batch (numpy) -> logits, the model's forward jitted the way the train step calls it."""
    graphdef, state = nnx.split(model)
    run = jax.jit(lambda state, batch: family.forward(nnx.merge(graphdef, state), batch))
    return lambda batch: run(state, {k: jnp.asarray(v) for k, v in batch.items()})


def document_losses(logits: np.ndarray, labels: np.ndarray) -> float:
    log_probs = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32), axis=-1)
    return float(-jnp.take_along_axis(log_probs, jnp.asarray(labels)[:, None], axis=-1).mean())


@pytest.mark.slow
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_a_packed_row_gives_each_document_its_own_logits_and_nothing_leaks(name, implementation):
    family, model = make_model(name, implementation)
    rng = np.random.default_rng(3)
    packed, single, lengths = batches(family, model.config, rng)
    forward = compiled_forward(family, model)
    packed_logits, single_logits = np.asarray(forward(packed)), np.asarray(forward(single))
    assert np.isfinite(packed_logits).all()

    for row, (where, n) in enumerate(zip(spans(lengths), lengths)):
        np.testing.assert_allclose(
            packed_logits[0, where], single_logits[row, :n], rtol=1e-4, atol=1e-4, err_msg=f"document {row + 1}"
        )
        labels = rng.integers(0, model.config.vocab_size, n)
        assert (
            abs(document_losses(packed_logits[0, where], labels) - document_losses(single_logits[row, :n], labels))
            < 1e-5
        ), f"document {row + 1}"

    # Another second document (encoder and decoder tokens alike): the other documents' logits do not move at all.
    changed = {k: v.copy() for k, v in packed.items()}
    for field, segment_field in (("input_ids", "segment_ids"), ("decoder_input_ids", "decoder_segment_ids")):
        if field in changed:
            second = changed[segment_field][0] == 2
            changed[field][0, second] = (changed[field][0, second] + 7) % model.config.vocab_size
    changed_logits = np.asarray(forward(changed))
    where = spans(lengths)
    assert not np.array_equal(changed_logits[0, where[1]], packed_logits[0, where[1]])  # the change reached it
    for k in (0, 2):
        np.testing.assert_array_equal(
            changed_logits[0, where[k]], packed_logits[0, where[k]], err_msg=f"document {k + 1} saw document 2"
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(FIXTURES))
def test_positions_the_objectives_give_equal_the_ones_the_model_counts(name):
    """Packed batches may leave `positions` out: the model counts them from the segment ids as the objectives'
    `segments` does (padding aside, whose outputs nobody reads)."""
    family, model = make_model(name, "xla")
    packed, _, _ = batches(family, model.config, np.random.default_rng(4))
    given = dict(packed)
    for ids, positions in (("segment_ids", "positions"), ("decoder_segment_ids", "decoder_positions")):
        if ids in packed:
            starts = np.diff(packed[ids], axis=1, prepend=-1) != 0
            given[positions] = segments(starts, packed[ids] > 0)[1]
    forward = lambda batch: np.asarray(compiled_forward(family, model)(batch))
    real = (packed.get("decoder_segment_ids", packed["segment_ids"]) > 0)[0]
    np.testing.assert_array_equal(forward(packed)[0, real], forward(given)[0, real])


def test_segment_positions_restart_at_each_segment():
    segments = jnp.asarray([[1, 1, 1, 2, 3, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    np.testing.assert_array_equal(segment_positions(segments), [[0, 1, 2, 0, 0, 1, 0, 1], list(range(8))])
