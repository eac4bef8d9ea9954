"""Per-op profile of the HF Flax peer's train step (the HF example scripts' step on transformers' Flax models), for
a side-by-side with ours (`bench_train.py --profile`). Runs in the peer's virtualenv with the peers harness's code:

    PEERS=path/to/peers   # the harness directory (hf_flax_bench.py, peer_common.py)
    $PEER_FLAX_VENV/bin/python benchmarks/profile_peer.py --peers $PEERS --model gpt2 --out /tmp/prof/hf_gpt2
    .venv/bin/python benchmarks/bench_train.py --model gpt2 --config CONFIG.json --batch_size 8 --seq_len 256 \
        --mesh data=1 --profile /tmp/prof/ours_gpt2
    python benchmarks/op_profile.py /tmp/prof/hf_gpt2/report.json /tmp/prof/ours_gpt2/report.json

CONFIG.json is the peer's shape as an spmdlm config (`dict(peer_common.MODELS[m]["hf"], model_type=m)`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", required=True, help="the peers harness directory (hf_flax_bench.py)")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="trace directory; the report goes to OUT/report.json")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    sys.path.insert(0, args.peers)
    import hf_flax_bench as peer  # noqa: E402  (the peer's own build, loss, decay mask and schedule)
    import jax
    import op_profile
    import optax

    model = peer.build(args.model)
    lr_fn = peer.make_lr_fn()
    tx = optax.adamw(learning_rate=lr_fn, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01, mask=peer.decay_mask_fn)
    state = peer.TrainState.create(
        apply_fn=model.__call__, params=model.params, tx=tx, dropout_rng=jax.random.PRNGKey(1)
    )
    loss_fn, inputs = peer.loss_fn_for(args.model), peer.MODEL_INPUTS[args.model]

    def train_step(state, batch):  # hf_flax_bench.main's step, verbatim in effect
        dropout_rng, new_dropout_rng = jax.random.split(state.dropout_rng)

        def compute_loss(params):
            logits = state.apply_fn(
                **{k: batch[k] for k in inputs}, params=params, dropout_rng=dropout_rng, train=True
            )[0]
            return loss_fn(logits, batch["labels"])

        loss, grad = jax.value_and_grad(compute_loss)(state.params)
        return state.apply_gradients(grads=grad, dropout_rng=new_dropout_rng), {"loss": loss}

    batch = peer.make_batches(args.model, n=1)[0]
    compiled = jax.jit(train_step, donate_argnums=(0,)).lower(state, batch).compile()
    holder = {"state": state}

    def step():
        holder["state"], metrics = compiled(holder["state"], batch)
        jax.block_until_ready((holder["state"], metrics))

    for _ in range(args.warmup):
        step()
    op_profile.trace_steps(step, args.steps, args.out)
    report = op_profile.report(args.out, compiled.as_text(), args.steps, "hf-flax")
    with open(os.path.join(args.out, "step.hlo.txt"), "w") as f:
        f.write(compiled.as_text())
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1)
    op_profile.print_reports([report])


if __name__ == "__main__":
    main()
