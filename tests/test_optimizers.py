"""The optimizers and schedules of --optim and --lr_scheduler_type (docs/optimizers.md): each optimizer learns and
resumes bitwise from a checkpoint, Muon's split by parameter, the decay masks, the schedules against optax's, the
schedule-free evaluation parameters, and the flags' errors."""

import functools
import math

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from spmdlm import checkpoint
from spmdlm.cli.launch import parse_args
from spmdlm.engine.optim import (
    MUON_CONSISTENT_RMS,
    evaluation_params,
    learning_rate_schedule,
    make_optimizer,
    muon_dimension_numbers,
)
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.engine.step import Stepper, Training, model_for_evaluation
from spmdlm.errors import ArgumentError
from spmdlm.families import get_family, load_config
from spmdlm.mesh import make_mesh
from spmdlm.models.layers import Bias, Dense, Embed, LayerNorm, Scale
from spmdlm.run_args import RunArgs
from spmdlm.run_args.sections import OptimizationArgs

GPT2 = get_family("gpt2")
TINY_GPT2 = load_config("gpt2-tiny", "gpt2").replace(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
# rates each optimizer learns the tiny problem at in a few steps (Lion: its paper's 3-10x below AdamW's)
RATES = {"lion": 3e-3, "muon": 1e-2, "schedule_free_adamw": 1e-2}
NEW = tuple(RATES)  # AdamW's and Adafactor's resumes: test_train.py, test_families.py
STEPS, SPLIT = 8, 4


def tiny_gpt2():
    return GPT2.make_model(TINY_GPT2, rngs=nnx.Rngs(0))


class Toy(nnx.Module):
    """One of each kind of parameter, small enough to update eagerly: an embedding, a hidden matrix with a bias, a
    norm, an LM head."""

    def __init__(self, rngs):
        self.embed = Embed(8, 4, rngs=rngs)
        self.dense = Dense(4, 4, ("embed", "mlp"), rngs=rngs)
        self.norm = LayerNorm(4, rngs=rngs)
        self.head = Dense(4, 8, ("embed", "vocab"), rngs=rngs, use_bias=False)


def flat_leaves(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def flat(tree) -> dict:
    return {k: np.asarray(v) for k, v in flat_leaves(tree).items()}


def by_name(tree) -> dict:
    """{'a/b/c': leaf} of an nnx.State (None leaves kept)."""
    return {"/".join(map(str, path)): v for path, v in nnx.to_flat_state(tree)}


# -- each optimizer learns, and resumes bitwise from a checkpoint -------------------------------------------------
@functools.cache
def run(name: str, tmp_dir: str):
    """One uninterrupted run of STEPS steps, and one saved at SPLIT and restored (orbax, into an abstract target as
    a resume does) before the rest: (losses, final state) of each. One device: compiling is most of the time
    (sharded optimizer states: test_muon_states_are_sharded_like_their_parameters)."""
    cfg = OptimizationArgs(
        learning_rate=RATES[name], optim=name, warmup_steps=2, weight_decay=0.01, lr_scheduler_type="constant"
    )
    mesh = make_mesh("data=1", jax.devices()[:1])
    graphdef, state = build_train_state(
        GPT2, TINY_GPT2, mesh, optim=cfg, total_steps=STEPS, compute=Compute(remat="none")
    )
    stepper = Stepper(
        graphdef, state, mesh, GPT2.forward, training=Training(schedule=learning_rate_schedule(cfg, STEPS))
    )
    ids = np.random.default_rng(0).integers(0, 64, (4, 16)).astype(np.int32)
    spec = {k: jax.ShapeDtypeStruct(ids.shape, ids.dtype) for k in ("input_ids", "labels")}
    batch = jax.device_put({k: ids for k in spec}, stepper.batch_shardings(spec))  # again and again: the loss falls
    stepper.compile_train(state, spec)

    def steps(state, start, stop):
        losses = []
        for step in range(start, stop):
            state, metrics = stepper.train_step(state, batch, step)
            losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
        return state, losses

    whole, losses = steps(jax.tree.map(jnp.copy, state), 0, STEPS)
    first, resumed_losses = steps(state, 0, SPLIT)
    manager = checkpoint.make_manager(f"{tmp_dir}/{name}", async_save=False)
    checkpoint.save(manager, SPLIT, first, iter(grain.MapDataset.range(4).to_iter_dataset()), {})
    manager.wait_until_finished()
    restored, _ = checkpoint.restore(manager, SPLIT, checkpoint.abstract_of(first))
    checkpoint.close(manager)
    resumed, more = steps(restored, SPLIT, STEPS)
    return cfg, graphdef, (losses, whole), (resumed_losses + more, resumed)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("optimizers"))
    return lambda name: run(name, tmp)


@pytest.mark.slow
@pytest.mark.parametrize("name", NEW)
def test_each_optimizer_learns_and_resumes_bitwise(name, runs):
    _, _, (losses, whole), (resumed_losses, resumed) = runs(name)
    assert losses[-1] < losses[0] - 0.3, losses
    assert resumed_losses == losses
    expected, got = flat(nnx.to_pure_dict(whole)), flat(nnx.to_pure_dict(resumed))
    assert expected.keys() == got.keys()
    for key in expected:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)


@pytest.mark.slow
def test_muon_states_are_sharded_like_their_parameters():
    """Under fsdp each of Muon's and its AdamW's moments is sharded as its parameter, not replicated on every device
    (optax's partition leaves placeholders that must not sit in nnx Variables: optim._plain_masked_nodes)."""
    mesh = make_mesh("data=2,fsdp=2", jax.devices()[:4])
    _, state = build_train_state(GPT2, TINY_GPT2, mesh, optim=OptimizationArgs(optim="muon"), abstract=True)
    params = {k: v for k, v in flat_leaves(state[0]).items() if v.ndim > 1}
    assert any("fsdp" in str(v.sharding.spec) for v in params.values())
    matched = set()
    for key, leaf in flat_leaves(state[1]["opt_state"]).items():
        if leaf.ndim > 1:
            param = next(p for p in params if key.endswith(p))
            assert leaf.sharding.spec == params[param].sharding.spec, key
            matched.add(param)
    assert matched == set(params)


@pytest.mark.slow
def test_schedule_free_evaluates_the_average_as_optax_does(runs):
    cfg, graphdef, (_, state), _ = runs("schedule_free_adamw")
    model, optimizer = nnx.merge(graphdef, state)
    params = nnx.state(model, nnx.Param)
    x = evaluation_params(cfg, optimizer.opt_state, params)
    (sf_state,) = [
        s
        for s in jax.tree.leaves(
            nnx.as_pure(optimizer.opt_state), is_leaf=lambda s: isinstance(s, optax.contrib.ScheduleFreeState)
        )
        if isinstance(s, optax.contrib.ScheduleFreeState)
    ]
    expected = flat(optax.contrib.schedule_free_eval_params(sf_state, nnx.as_pure(params)))
    got, iterate = flat(x), flat(nnx.as_pure(params))
    assert got.keys() == expected.keys() == iterate.keys()
    for key in got:
        np.testing.assert_array_equal(got[key], expected[key], err_msg=key)
    assert any(not np.allclose(got[k], iterate[k]) for k in got)  # y, where gradients are taken, is not x

    # inside the jitted eval step as outside; it loads into the model (what evaluation, export and samples do)
    def jitted(state):
        model, optimizer = nnx.merge(graphdef, state)
        return evaluation_params(cfg, optimizer.opt_state, nnx.state(model, nnx.Param))

    for key, value in flat(jax.jit(jitted)(state)).items():
        np.testing.assert_allclose(value, got[key], rtol=1e-6, atol=1e-7, err_msg=key)
    # model_for_evaluation's averaged model leaves the train state it was given as it was (sampling, task evaluation
    # and hub pushes call it mid-run, and training goes on from that state)
    before = {k: np.asarray(v) for k, v in flat_leaves(state).items()}
    evaluated, _ = model_for_evaluation(graphdef, state, cfg)
    np.testing.assert_array_equal(np.asarray(evaluated.wte.embedding[...]), got["['wte']['embedding']"])
    for key, value in flat_leaves(state).items():
        np.testing.assert_array_equal(np.asarray(value), before[key], err_msg=key)
    nnx.update(model, x)
    np.testing.assert_array_equal(np.asarray(model.wte.embedding[...]), got["['wte']['embedding']"])
    # the other optimizers' parameters pass through
    adamw = OptimizationArgs(optim="adamw")
    assert evaluation_params(adamw, optimizer.opt_state, params) is params


@pytest.mark.slow
def test_our_schedule_free_adamw_is_optax_s_with_a_decay_mask():
    """Decayed parameters follow optax.contrib.schedule_free_adamw(weight_decay=wd), masked ones its wd=0."""
    model = Toy(nnx.Rngs(0))
    cfg = OptimizationArgs(
        learning_rate=0.1, weight_decay=0.3, optim="schedule_free_adamw", warmup_steps=2, max_grad_norm=0
    )
    schedule = learning_rate_schedule(cfg, 10)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    ours = make_optimizer(cfg, model, 10)
    theirs = {
        wd: optax.contrib.schedule_free_adamw(
            schedule, b1=cfg.adam_beta1, b2=cfg.adam_beta2, eps=cfg.adam_epsilon, weight_decay=wd
        )
        for wd in (0.0, 0.3)
    }
    states = {"ours": ours.init(params), **{wd: tx.init(params) for wd, tx in theirs.items()}}
    p = {"ours": params, 0.0: params, 0.3: params}
    updates_of = {key: jax.jit(tx.update) for key, tx in (("ours", ours), *theirs.items())}
    for step in range(4):
        grads = jax.tree.map(lambda x: jnp.sin(x * (step + 1)), p["ours"])
        for key, update in updates_of.items():
            updates, states[key] = update(grads, states[key], p[key])
            p[key] = optax.apply_updates(p[key], updates)
    got, decayed, undecayed = (by_name(p[k]) for k in ("ours", 0.3, 0.0))
    for key in ("dense/kernel", "embed/embedding", "head/kernel"):
        np.testing.assert_array_equal(got[key], decayed[key], err_msg=key)
    for key in ("dense/bias", "norm/scale", "norm/bias"):
        np.testing.assert_array_equal(got[key], undecayed[key], err_msg=key)


# -- Muon: which parameters, seen as which matrices ---------------------------------------------------------------
def muon_split(model) -> dict:
    return {
        k: (None if v is None else (v.reduction_axis, v.output_axis))
        for k, v in by_name(muon_dimension_numbers(model)).items()
    }


def test_muon_takes_gpt2_s_hidden_matrices_per_layer_and_q_k_v_apart():
    split = muon_split(nnx.eval_shape(tiny_gpt2))
    muon = {k: v for k, v in split.items() if v is not None}
    # axes: 0 is the scanned layers axis; qkv (layers, embed, 3, heads): the 3 is a batch axis too
    assert muon == {
        "h/layers/attn/qkv/kernel": (1, (3,)),
        "h/layers/attn/out/kernel": (1, (2,)),
        "h/layers/mlp/wi/kernel": (1, (2,)),
        "h/layers/mlp/wo/kernel": (1, (2,)),
    }
    adamw = {k for k, v in split.items() if v is None}
    assert {"wte/embedding", "wpe/embedding", "ln_f/scale", "h/layers/attn/qkv/bias", "h/layers/ln_1/scale"} <= adamw


def test_muon_takes_t5_s_attention_and_mlp_matrices_not_embeddings_or_the_head():
    t5 = get_family("t5")
    model = nnx.eval_shape(lambda: t5.make_model(load_config("t5-v1_1-tiny", "t5"), rngs=nnx.Rngs(0)))
    split = muon_split(model)
    layers = [
        f"{stack}/block/layers/{part}/{m}/kernel"
        for stack, parts in (("encoder", ("self_attention",)), ("decoder", ("self_attention", "cross_attention")))
        for part in parts
        for m in ("query", "key", "value", "out")
    ]
    layers += [
        f"{stack}/block/layers/mlp/{m}/kernel" for stack in ("encoder", "decoder") for m in ("wi_0", "wi_1", "wo")
    ]
    assert {k for k, v in split.items() if v is not None} == set(layers)
    assert all(split[k] == (1, (2,)) for k in layers)
    for k in (
        "shared/embedding",
        "lm_head/kernel",
        "encoder/relative_attention_bias/embedding",
        "decoder/relative_attention_bias/embedding",
        "encoder/final_layer_norm/scale",
    ):
        assert split[k] is None, k


def test_muon_orthogonalises_each_layer_and_each_of_q_k_v_on_its_own():
    """GPT-2's stacked qkv kernel with a gradient 100x larger in one layer's query than elsewhere: orthogonalised
    matrix by matrix, every layer's query, key and value still gets an update of the same size (one matrix over the
    whole stack would leave the others near zero), with near-equal singular values."""
    model = nnx.eval_shape(tiny_gpt2)
    dims = muon_dimension_numbers(model)["h"]["layers"]["attn"]["qkv"]["kernel"]
    shape = model.h.layers.attn.qkv.kernel.shape  # (layers, d, 3, d)
    grad = jax.random.normal(jax.random.key(1), shape).at[0, :, 0].multiply(100.0)
    tx = optax.contrib.muon(1.0, muon_weight_dimension_numbers={"qkv": dims}, consistent_rms=MUON_CONSISTENT_RMS)
    params = {"qkv": jnp.zeros(shape)}
    updates, _ = jax.jit(tx.update)({"qkv": grad}, tx.init(params), params)
    update = np.asarray(updates["qkv"])
    norms = np.linalg.norm(update, axis=(1, 3))  # one per (layer, q/k/v) matrix
    assert norms.max() / norms.min() < 1.5, norms
    s = np.linalg.svd(update[1, :, 2, :], compute_uv=False)
    assert s.max() / s.min() < 3, s


# -- weight decay: which parameters decay, per optimizer ----------------------------------------------------------
@pytest.mark.parametrize("name", ["lion", "muon", "schedule_free_adamw"])
def test_weight_decay_masks(name):
    """With zero gradients only weight decay moves a parameter: by lr x wd where it applies."""
    model = Toy(nnx.Rngs(0))
    kinds = by_name(nnx.state(model, nnx.Param))
    before = by_name(nnx.as_pure(nnx.state(model, nnx.Param)))
    cfg = OptimizationArgs(learning_rate=0.1, weight_decay=0.5, optim=name, lr_scheduler_type="constant")
    optimizer = nnx.Optimizer(model, make_optimizer(cfg, model, 10), wrt=nnx.Param)
    optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    after = by_name(nnx.as_pure(nnx.state(model, nnx.Param)))
    muon = {k for k, v in by_name(muon_dimension_numbers(model)).items() if v is not None}
    assert muon == {"dense/kernel"}
    for key in before:
        # Muon: only its matrices, not the embeddings either; the others: all but biases and norm scales
        decays = key in muon if name == "muon" else not isinstance(kinds[key], (Bias, Scale))
        expected = before[key] * (1 - 0.1 * 0.5) if decays else before[key]
        np.testing.assert_allclose(after[key], expected, rtol=1e-6, atol=0, err_msg=key)


# -- schedules ----------------------------------------------------------------------------------------------------
TOTAL, WARMUP, PEAK = 110, 10, 2.0
STEPS_TO_CHECK = np.arange(TOTAL + 5)


def values(schedule) -> np.ndarray:
    return np.array([float(schedule(s)) for s in STEPS_TO_CHECK])


def ours(kind, warmup=WARMUP, **kw):
    return values(
        learning_rate_schedule(
            OptimizationArgs(learning_rate=PEAK, warmup_steps=warmup, lr_scheduler_type=kind, **kw), TOTAL
        )
    )


def warmed(after, warmup=WARMUP):
    return optax.join_schedules([optax.linear_schedule(0.0, PEAK, warmup), after], [warmup]) if warmup else after


@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_the_earlier_schedules_are_bitwise_unchanged(warmup):
    """linear, cosine and constant as earlier versions built them: resumed runs depend on it."""
    decay = TOTAL - warmup
    earlier = {
        "linear": optax.linear_schedule(PEAK, 0.0, decay),
        "cosine": optax.cosine_decay_schedule(PEAK, decay),
        "constant": optax.constant_schedule(PEAK),
    }
    for kind, after in earlier.items():
        np.testing.assert_array_equal(ours(kind, warmup), values(warmed(after, warmup)), err_msg=kind)
        np.testing.assert_array_equal(ours(kind, warmup, min_lr_ratio=0.0), values(warmed(after, warmup)))


def test_schedules_match_optax_s_own():
    floor = 0.1
    np.testing.assert_allclose(
        ours("cosine", min_lr_ratio=floor),
        values(optax.warmup_cosine_decay_schedule(0.0, PEAK, WARMUP, TOTAL, end_value=PEAK * floor)),
        rtol=1e-6,
    )
    np.testing.assert_array_equal(
        ours("linear", min_lr_ratio=floor), values(warmed(optax.linear_schedule(PEAK, PEAK * floor, TOTAL - WARMUP)))
    )
    for kind in ("constant", "constant_with_warmup"):
        np.testing.assert_array_equal(ours(kind), values(optax.warmup_constant_schedule(0.0, PEAK, WARMUP)))
    for kw, decay in (({}, 11), ({"decay_ratio": 0.3}, 33), ({"decay_steps": 40}, 40)):  # default: 10% of 110
        wsd = optax.join_schedules(
            [
                optax.linear_schedule(0.0, PEAK, WARMUP),
                optax.constant_schedule(PEAK),
                optax.linear_schedule(PEAK, PEAK * floor, decay),
            ],
            [WARMUP, TOTAL - decay],
        )
        np.testing.assert_allclose(ours("wsd", min_lr_ratio=floor, **kw), values(wsd), rtol=1e-6, err_msg=str(kw))
    assert ours("linear")[TOTAL] == ours("cosine")[TOTAL] == ours("wsd")[TOTAL] == 0.0  # default floor: 0


@pytest.mark.parametrize("warmup", [0, WARMUP])
def test_inverse_sqrt_is_transformers_schedule(warmup):
    """transformers' get_inverse_sqrt_schedule (timescale = the warmup, or 10000 without), here with a floor."""
    timescale = warmup or 10_000
    hf = [
        s / max(1, warmup) if s < warmup else 1 / math.sqrt((s + timescale - warmup) / timescale)
        for s in STEPS_TO_CHECK
    ]
    np.testing.assert_allclose(ours("inverse_sqrt", warmup), PEAK * np.array(hf), rtol=1e-6)
    np.testing.assert_allclose(
        ours("inverse_sqrt", warmup, min_lr_ratio=0.5),
        PEAK * np.array([h if s < warmup else max(h, 0.5) for s, h in zip(STEPS_TO_CHECK, hf)]),
        rtol=1e-6,
    )


# -- flags ----------------------------------------------------------------------------------------------------------
def test_optimizer_flags_reach_the_optimizer_config():
    args, _ = parse_args(
        [
            "--train_file",
            "x.txt",
            "--optim",
            "muon",
            "--lr_scheduler_type",
            "wsd",
            "--min_lr_ratio",
            "0.1",
            "--decay_steps",
            "50",
            "--adam_beta2",
            "0.95",
        ]
    )
    cfg = args.optimization
    assert (
        cfg.optimizer,
        cfg.lr_scheduler_type,
        cfg.min_lr_ratio,
        cfg.decay_steps,
        cfg.decay_ratio,
        cfg.adam_beta2,
    ) == ("muon", "wsd", 0.1, 50, None, 0.95)
    assert args.to_json()["optim"] == "muon"  # run_config.json records the choice
    assert RunArgs.of_run(args.to_json()).optimization == cfg  # and reads it back as it was


def test_adafactor_is_the_old_spelling_of_optim_adafactor():
    for argv in (["--adafactor"], ["--optim", "adafactor"], ["--optim", "adafactor", "--adafactor"]):
        args, _ = parse_args(["--train_file", "x.txt", *argv])
        assert (
            args.optimization.optim == "adafactor"
            and args.optimization.adafactor
            and args.optimization.optimizer == "adafactor"
        )
    args, _ = parse_args(["--train_file", "x.txt"])
    assert args.optimization.optim == "adamw" and not args.optimization.adafactor
    # the T5 quick start's Adafactor gives way to a given --optim
    args, _ = parse_args(["--model_type", "t5", "--optim", "lion"])
    assert args.optimization.optim == "lion" and not args.optimization.adafactor
    assert parse_args(["--model_type", "t5"])[0].optimization.optim == "adafactor"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim", "sgd"], "--optim 'sgd' is not supported; use one of adamw, adafactor, lion, muon"),
        (["--optim", "lion", "--adafactor"], "--adafactor means --optim adafactor, not --optim lion; give one of them"),
        (["--lr_scheduler_type", "polynomial"], "--lr_scheduler_type 'polynomial' is not supported; use one of"),
        (["--min_lr_ratio", "1.5"], r"--min_lr_ratio must be in \[0, 1\], got 1.5 \(a fraction of --learning_rate\)"),
        (["--lr_scheduler_type", "constant", "--min_lr_ratio", "0.1"], "--min_lr_ratio applies to the decaying"),
        (["--decay_ratio", "0.2"], "--decay_ratio applies to --lr_scheduler_type wsd only"),
        (["--lr_scheduler_type", "wsd", "--decay_steps", "5", "--decay_ratio", "0.2"], "give one of --decay_steps"),
        (["--lr_scheduler_type", "wsd", "--decay_steps", "0"], "--decay_steps must be at least 1"),
        (["--lr_scheduler_type", "wsd", "--decay_ratio", "0"], r"--decay_ratio must be in \(0, 1\], got 0.0"),
        (
            ["--lr_scheduler_type", "wsd", "--decay_steps", "95", "--warmup_steps", "10", "--max_steps", "100"],
            "exceed --max_steps 100",
        ),
        (["--adam_beta2", "1.0"], r"--adam_beta2 must be in \[0, 1\)"),
        (["--optim", "schedule_free_adamw", "--adam_beta1", "0"], "needs --adam_beta1 above 0"),
    ],
)
def test_bad_optimizer_flags(argv, message):
    with pytest.raises(ArgumentError, match=message):
        parse_args(["--train_file", "x.txt", *argv])


def test_the_optimisation_section_refuses_what_it_cannot_build():
    with pytest.raises(ArgumentError, match="--optim 'sgd'"):
        OptimizationArgs(optim="sgd")
    with pytest.raises(ArgumentError, match="--adafactor means --optim adafactor"):
        OptimizationArgs(optim="muon", adafactor=True)
    assert RunArgs().optimization.optimizer == "adamw"  # unresolved: the defaults
