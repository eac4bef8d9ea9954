"""Log-likelihoods of continuations under jit on the model's mesh: what LM-harness tasks ask of a model
(spmdlm/generation/harness.py), for every family whose `generation` is decoder-only or encoder-decoder.

A request is a (context, continuation) pair of token ids; its answer is the summed log-probability of the
continuation given the context, and whether greedy decoding would have produced the continuation. The rows are laid
out as lm-eval's `hf` backend lays them out (docs/harness.md), so the two give the same numbers:

- decoder-only: the last `max_length + 1` tokens of context + continuation, less the last, are the input; the
  continuation's tokens are scored at the last positions;
- encoder-decoder: the context's last `max_length` tokens go to the encoder; the decoder reads the decoder start
  token and the continuation less its last token, and every decoder position is scored.

Shapes are static: rows are padded on the right to a power-of-two length bucket and batches to `batch_size` rows
(sorted by length first), so a task compiles once per bucket it uses. The batch is split over the mesh's batch axes
and the parameters stay as they are sharded; the answers come back replicated (every process reads them all).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from spmdlm.errors import TasksError
from spmdlm.families.base import Family, Generation
from spmdlm.generation.decoding import Specials
from spmdlm.mesh import batch_axis_size, batch_sharding, constrain

SMALLEST_BUCKET = 16  # row lengths are rounded up to a power of two from here, capped at max_length
LIKELIHOOD = (Generation.DECODER_ONLY, Generation.ENCODER_DECODER)


def check_likelihood(family: Family) -> None:
    """One line for a family whose models score no continuation (masked LMs, training-only models)."""
    if family.generation not in LIKELIHOOD:
        raise TasksError(
            f"a {family.name} model has no LM-harness likelihood (it does not predict text left to "
            "right); evaluate it on held-out text instead, or run tasks on a decoder-only or "
            "encoder-decoder model"
        )


def length_bucket(n: int, limit: int) -> int:
    size = SMALLEST_BUCKET
    while size < n:
        size *= 2
    return min(size, limit)


@dataclasses.dataclass(frozen=True)
class Row:
    """One request laid out for the model: the scored stream (the decoder-only input, or the decoder's input),
    the token each of its positions predicts, how many of its last positions are scored, and the encoder's input."""

    stream: list[int]
    targets: list[int]
    scored: int
    encoder: list[int] | None = None


class Scorer:
    """Continuation log-likelihoods of `model` (of `family`), `batch_size` rows at a time (rounded up to a multiple
    of the mesh's batch axes), rows of at most `max_length` tokens."""

    def __init__(self, family: Family, model, mesh, *, batch_size: int, max_length: int):
        check_likelihood(family)
        config = model.config
        self.encoder_decoder = family.generation is Generation.ENCODER_DECODER
        self.decoder_start = Specials.of(config, family.generation).decoder_start
        self.pad = config.eos_token_id if getattr(config, "pad_token_id", None) is None else config.pad_token_id
        self.forward, self.mesh, self.max_length = family.forward, mesh, max_length
        self.graphdef, self.params = nnx.split(model)
        ways = batch_axis_size(mesh)
        self.batch_size = -(-max(batch_size, 1) // ways) * ways

    def row(self, context: list[int], continuation: list[int]) -> Row:
        if not continuation or len(continuation) > self.max_length:
            raise TasksError(
                f"a continuation of {len(continuation)} tokens cannot be scored with max_length "
                f"{self.max_length}; it needs 1 to max_length tokens"
            )
        if self.encoder_decoder:
            return Row(
                [self.decoder_start] + continuation[:-1], continuation, len(continuation), context[-self.max_length :]
            )
        whole = (context + continuation)[-(self.max_length + 1) :]
        return Row(whole[:-1], whole[1:], len(continuation))

    def score(
        self, pairs: Sequence[tuple[list[int], list[int]]], interrupt: Callable[[], None] | None = None
    ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each (context ids, continuation ids); `interrupt` is called before each
        batch (it may raise to abandon the work)."""
        rows = [self.row(list(context), list(continuation)) for context, continuation in pairs]
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i].stream), -len(rows[i].encoder or ())))
        answers: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        for start in range(0, len(order), self.batch_size):
            if interrupt is not None:
                interrupt()
            chunk = order[start : start + self.batch_size]
            logprobs, greedy = self.run([rows[i] for i in chunk])
            for i, logprob, hit in zip(chunk, logprobs, greedy):
                answers[i] = (float(logprob), bool(hit))
        return answers

    def run(self, rows: list[Row]) -> tuple[np.ndarray, np.ndarray]:
        rows = rows + [rows[0]] * (self.batch_size - len(rows))  # a full batch: one shape per bucket
        batch, targets, weights = self.arrays(rows)
        put = lambda x: jax.make_array_from_callback(x.shape, batch_sharding(self.mesh, x.ndim), lambda i: x[i])
        with jax.set_mesh(self.mesh):
            logprobs, greedy = continuation_scores(
                self.graphdef, self.params, jax.tree.map(put, batch), put(targets), put(weights), forward=self.forward
            )
        return np.asarray(logprobs), np.asarray(greedy)

    def arrays(self, rows: list[Row]) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """The model's batch (right-padded to the buckets), each position's target and the scored positions."""
        stream, stream_mask = self.padded([row.stream for row in rows])
        targets = self.padded([row.targets for row in rows], length=stream.shape[1])[0]
        weights = np.zeros(stream.shape, np.float32)
        for i, row in enumerate(rows):
            weights[i, len(row.stream) - row.scored : len(row.stream)] = 1.0
        if not self.encoder_decoder:
            return {"input_ids": stream, "attention_mask": stream_mask}, targets, weights
        encoder, encoder_mask = self.padded([row.encoder for row in rows])
        return (
            {
                "input_ids": encoder,
                "attention_mask": encoder_mask,
                "decoder_input_ids": stream,
                "decoder_attention_mask": stream_mask,
            },
            targets,
            weights,
        )

    def padded(self, sequences: list[list[int]], length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        length = length or length_bucket(max(map(len, sequences)), self.max_length)
        ids = np.full((len(sequences), length), self.pad, np.int32)
        mask = np.zeros((len(sequences), length), np.int32)
        for i, sequence in enumerate(sequences):
            ids[i, : len(sequence)], mask[i, : len(sequence)] = sequence, 1
        return ids, mask


@functools.partial(jax.jit, static_argnames=("graphdef", "forward"))
def continuation_scores(graphdef, params, batch, targets, weights, *, forward):
    """Per row: the summed log-probability of the scored targets (a softmax over the model's whole vocabulary, in
    float32) and whether each is the most likely token; replicated."""
    logits = forward(nnx.merge(graphdef, params), batch).astype(jnp.float32)
    target_logits = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    logprobs = target_logits - jax.nn.logsumexp(logits, axis=-1)
    scored = weights > 0
    total = jnp.sum(jnp.where(scored, logprobs, 0.0), axis=-1)
    greedy = jnp.all((jnp.argmax(logits, axis=-1) == targets) | ~scored, axis=-1)
    return constrain(total, None), constrain(greedy, None)
