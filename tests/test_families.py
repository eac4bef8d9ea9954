"""One suite over every registered model family (fixtures in family_fixtures.py): transformers parity both ways,
lossless round trips, golden shardings, every preset's shapes, equal losses on two meshes (pure data parallel,
fsdp x tensor), exact resume through the launcher (with bf16, remat and sample prompts on fsdp x tensor; and with
packed rows). A --dry_run of each: test_train.py."""

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from conftest import (
    INVOLUNTARY_REMAT,
    final_params,
    read_metrics,
    run_argv,
    run_killed_after_first_checkpoint,
    uncached_compiles,
)
from family_fixtures import ATTENTION_FAMILIES, ENGINE_FAMILIES, FIXTURES
from flax import nnx
from safetensors.numpy import load_file

from spmdlm import checkpoint, hf_export
from spmdlm.engine.state import Compute, build_train_state
from spmdlm.families import families, load_config, preset_names
from spmdlm.launch import main
from spmdlm.mesh import make_mesh
from spmdlm.models.attention import resolve_attention, set_attention

GOLDEN = Path(__file__).parent / "golden"
SHARDED = "data=2,fsdp=2,tensor=2"


def test_every_family_has_fixtures():
    assert set(FIXTURES) == set(families())


CASES = [(family, name) for family in FIXTURES for name in FIXTURES[family].configs]


def random_hf_model(family: str, name: str, tmp_path: Path) -> Path:
    """A random transformers model with every parameter perturbed (so a swapped or dropped tensor shows)."""
    fixture = FIXTURES[family]
    torch.manual_seed(CASES.index((family, name)))
    model = fixture.hf_model_class(fixture.hf_config_class(**fixture.configs[name])).eval()
    fixture.prepare_hf(model)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            param.add_(0.05 * torch.randn_like(param))
            if "norm" in param_name.lower() and param_name.endswith("weight"):
                param.uniform_(0.5, 1.5)
    path = tmp_path / f"{family}-{name}"
    model.save_pretrained(path)
    return path


def torch_logits(family: str, path: Path, batch: dict) -> np.ndarray:
    model = FIXTURES[family].hf_model_class.from_pretrained(path).eval()
    with torch.no_grad():
        return model(**{k: torch.tensor(v) for k, v in batch.items()}).logits.numpy()


def our_logits(model, batch: dict) -> np.ndarray:
    return np.asarray(model(**{k: jnp.asarray(v) for k, v in batch.items()}))


def assert_close_where_read(ours, theirs, batch, family):
    valid = batch[FIXTURES[family].output_mask].astype(bool)
    np.testing.assert_allclose(ours[valid], theirs[valid], atol=1e-4, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family,name", CASES)
def test_logits_match_transformers_both_ways(family, name, tmp_path):
    source = random_hf_model(family, name, tmp_path)
    batch = FIXTURES[family].make_batch(FIXTURES[family].configs[name], np.random.default_rng(0))
    reference = torch_logits(family, source, batch)

    model, config = hf_export.load_hf(source)  # transformers -> ours
    assert_close_where_read(our_logits(model, batch), reference, batch, family)
    auto, _ = resolve_attention(model, "auto", platform=jax.default_backend(), dtype=jnp.float32, training=False)
    for implementation in sorted({auto, "dot_product"}):  # --attention auto, and the other one the CPU runs fast
        assert_close_where_read(our_logits(set_attention(model, implementation), batch), reference, batch, family)
    set_attention(model, "xla")

    out = hf_export.save_hf(model, config, tmp_path / "ours")  # ours -> transformers
    reloaded, info = FIXTURES[family].hf_model_class.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    written, original = load_file(out / "model.safetensors"), load_file(source / "model.safetensors")
    for key, value in written.items():  # bitwise; tied copies are not written
        np.testing.assert_array_equal(value, original[key], err_msg=key)
    assert_close_where_read(torch_logits(family, out, batch), reference, batch, family)


@pytest.mark.slow
@pytest.mark.parametrize("family", FIXTURES)
def test_logits_match_on_a_sharded_mesh(family, tmp_path):
    name = next(iter(FIXTURES[family].configs))
    source = random_hf_model(family, name, tmp_path)
    batch = FIXTURES[family].make_batch(FIXTURES[family].configs[name], np.random.default_rng(1))
    with jax.set_mesh(make_mesh(SHARDED)):
        model, _ = hf_export.load_hf(source)
        specs = [str(v[...].sharding.spec) for _, v in nnx.iter_graph(model) if isinstance(v, nnx.Param)]
        assert any("fsdp" in s for s in specs) and any("tensor" in s for s in specs)
        ours = np.asarray(jax.jit(lambda m, b: m(**b))(model, {k: jnp.asarray(v) for k, v in batch.items()}))
    assert_close_where_read(ours, torch_logits(family, source, batch), batch, family)


# Positions for the 128 tokens the splash kernel's blocks need (its Pallas interpret mode runs it on the CPU).
LONG_POSITIONS = {
    "bart": {"max_position_embeddings": 128},
    "t5": {},
    "modernbert": {"max_position_embeddings": 128},
    "qwen3": {"max_position_embeddings": 128},
}


@pytest.mark.slow
@pytest.mark.parametrize("family", ATTENTION_FAMILIES)  # the four that make every mask (family_fixtures.py)
def test_attention_implementations_compute_the_same(family):
    """The model option `attention`: jax.nn.dot_product_attention's XLA path and the Pallas splash kernel (its
    interpret mode) give the einsums' logits and gradients: padding on both sides, causal masks, cross-attention.
    T5's self-attention, which adds the relative-position bias, keeps the einsums under splash. One length (the 128
    tokens the splash kernel's blocks need) for both, so the einsums' reference is compiled once."""
    name = next(iter(FIXTURES[family].configs))
    hf_kwargs = {**FIXTURES[family].configs[name], **LONG_POSITIONS[family]}
    config = families()[family].config_class.from_dict(FIXTURES[family].hf_config_class(**hf_kwargs).to_dict())
    batch = FIXTURES[family].make_batch(hf_kwargs, np.random.default_rng(3), length=128)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    valid = np.asarray(batch[FIXTURES[family].output_mask]).astype(bool)

    def value_and_grad(attention):
        graph, params = nnx.split(families()[family].make_model(config, rngs=nnx.Rngs(0), attention=attention))

        def loss(p):
            logits = nnx.merge(graph, p)(**batch)
            return jnp.sum(jnp.where(valid[..., None], logits, 0.0) ** 2), logits

        if attention == "splash":  # the kernel is really in the program, not the einsums' fallback
            assert "pallas_call" in str(jax.make_jaxpr(loss)(params))
        return jax.value_and_grad(loss, has_aux=True), params

    # The three in one program: one compilation (the parameters are the same; only the attention call differs)
    steps = {implementation: value_and_grad(implementation) for implementation in ("xla", "dot_product", "splash")}
    results = jax.jit(lambda params: {name: steps[name][0](p) for name, p in params.items()})(
        {name: step[1] for name, step in steps.items()}
    )
    (_, xla_logits), xla_grads = results.pop("xla")
    for implementation, ((_, fused_logits), fused_grads) in results.items():
        np.testing.assert_allclose(
            np.asarray(fused_logits)[valid], np.asarray(xla_logits)[valid], atol=1e-5, rtol=0, err_msg=implementation
        )
        for g, w in zip(jax.tree.leaves(fused_grads), jax.tree.leaves(xla_grads)):
            np.testing.assert_allclose(
                g, w, atol=1e-5 * (float(jnp.abs(w).max()) + 1.0), rtol=0, err_msg=implementation
            )


@pytest.mark.slow
@pytest.mark.parametrize("family", FIXTURES)
def test_unrolled_layers_compute_the_same(family):
    """--scan_unroll 0 unrolls the layer scan over the same stacked parameters: same logits."""
    name = next(iter(FIXTURES[family].configs))
    hf_config = FIXTURES[family].hf_config_class(**FIXTURES[family].configs[name])
    config = families()[family].config_class.from_dict(hf_config.to_dict())
    batch = {
        k: jnp.asarray(v)
        for k, v in FIXTURES[family].make_batch(FIXTURES[family].configs[name], np.random.default_rng(2)).items()
    }
    logits = [
        np.asarray(families()[family].make_model(config, rngs=nnx.Rngs(0), scan_unroll=unroll)(**batch))
        for unroll in (1, True)
    ]
    np.testing.assert_allclose(logits[0], logits[1], atol=1e-5, rtol=0)


def partition_specs(family: str, mesh_spec: str) -> tuple[dict[str, str], dict[str, int]]:
    config = load_config(tiny_preset(family))
    with jax.set_mesh(make_mesh(mesh_spec)):
        state = jax.jit(lambda: nnx.state(families()[family].make_model(config, rngs=nnx.Rngs(0)), nnx.Param))()
    specs, sizes = {}, {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(state):
        parts = [getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path[:-1]]  # [-1]: .value
        name = ".".join(str(p) for p in parts)
        specs[name], sizes[name] = str(leaf.sharding.spec), leaf.size
    return specs, sizes


def presets_of(family: str) -> list[str]:
    """The shipped presets of a family: the files in its folder's presets/, and any it declares (Family.presets)."""
    return preset_names(family)


def tiny_preset(family: str) -> str:
    return next(name for name in presets_of(family) if name.endswith("tiny"))


@pytest.mark.slow
@pytest.mark.parametrize("family", FIXTURES)
def test_partition_specs_match_golden(family):
    """Regenerate after a deliberate change: python tests/test_families.py"""
    specs, sizes = partition_specs(family, SHARDED)
    assert specs == json.loads((GOLDEN / f"{family}_partition_specs.json").read_text())
    unsharded = sum(sizes[n] for n, s in specs.items() if "fsdp" not in s)
    assert unsharded / sum(sizes.values()) < 0.02  # only vectors (biases, norms) stay whole
    assert all(s == "P()" or s.startswith("P(None") for n, s in specs.items() if ".layers." in n)  # never sharded


@pytest.mark.parametrize("family,preset", [(f, p) for f in FIXTURES for p in presets_of(f)])
def test_every_preset_builds_abstractly(family, preset):
    config = load_config(preset)
    model = nnx.eval_shape(lambda: families()[family].make_model(config, rngs=nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    count = sum(x.size for x in jax.tree.leaves(params))
    stacked = [
        v
        for _, v in nnx.iter_graph(model)
        if isinstance(v, nnx.Param) and v.get_metadata()["logical_axes"][0] == "layers"
    ]
    assert count > 0 and stacked, preset
    assert "base" not in preset or count > 50e6  # the base presets are the real sizes


# -- short runs through the launcher -------------------------------------------------------------------------------
def launch(family: str, out: Path, config: Path, cache_dir: Path, *extra: str) -> int:
    flags = dict(model_type=family, per_device_train_batch_size=2, per_device_eval_batch_size=2, warmup_steps=2)
    flags |= dict(logging_steps=1, save_steps=100, max_eval_samples=16, export_hf=False, seed=7)
    return main(run_argv(out, config, cache_dir, *FIXTURES[family].run_flags, *extra, **flags))


def train_losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_metrics(out) if "loss" in m]


def train_on_mesh(family: str, mesh_spec: str, config_path: Path, output_dir: Path, steps: int = 4) -> list[float]:
    """Losses of `steps` train steps on a fixed global batch of 16 examples of the family's objective (tokenizer
    trained on a small text), on the given mesh: the run's own state and train step, as the launcher builds them."""
    from conftest import FIXTURES as DATA

    from spmdlm.cli.launch import parse_args
    from spmdlm.data.pipeline import batch_spec, to_global
    from spmdlm.data.tokenization import train_tokenizer
    from spmdlm.train.stages.program import setup_state
    from spmdlm.train.stages.resolve import resolve

    args, _ = parse_args(
        ["--model_type", family, "--config_name", str(config_path), *FIXTURES[family].run_flags, "--warmup_steps", "1"]
        + ["--mesh", mesh_spec, "--global_batch_size", "16", "--output_dir", str(output_dir)]
    )
    run = resolve(args, time.perf_counter())
    tok = train_tokenizer(run.family, (DATA / "overfit.txt").read_text().splitlines(), run.config.vocab_size)
    objective = run.family.build_objective(args.objective, run.config, tok)
    rng = np.random.default_rng(0)
    records = rng.integers(5, tok.get_vocab_size() - 100, (16, objective.record_length)).astype(np.int32)
    examples = [objective(r, np.random.default_rng(i)) for i, r in enumerate(records)]
    batch = {k: np.stack([e[k] for e in examples]) for k in examples[0]}
    model = setup_state(run, run.config, objective, steps, abstract=False)
    state = model.state
    assert run.global_batch == 16 and run.stages[0].accumulation == 1
    model.stepper.compile_train(state, batch_spec(objective, run.global_batch))
    losses = []
    for step in range(steps):
        state, metrics = model.stepper.train_step(state, to_global(batch, run.mesh), step)
        losses.append(float(metrics["loss_sum"] / metrics["tokens"]))
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_same_losses_on_a_sharded_mesh(family, tiny_configs, tmp_path, capfd):
    # Pure data parallelism against fsdp x tensor (SHARDED = data=2,fsdp=2,tensor=2); a third mesh (data=2,fsdp=4)
    # added little coverage for a third of this test's time (suite budget).
    losses = {"data=8": np.array(train_on_mesh(family, "data=8", tiny_configs[family], tmp_path / "out"))}
    # The sharded mesh's programs compile here, not from the session's cache, so that XLA's partitioner runs and
    # would warn (test_shardings.py: no involuntary rematerialization; its other meshes are compiled there).
    capfd.readouterr()
    with uncached_compiles():
        losses[SHARDED] = np.array(train_on_mesh(family, SHARDED, tiny_configs[family], tmp_path / "out"))
    warnings = [line[:600] for line in capfd.readouterr().err.splitlines() if INVOLUNTARY_REMAT in line]
    assert warnings == []
    reference = losses["data=8"]
    assert np.isfinite(reference).all() and reference[-1] < reference[0]
    for mesh, values in losses.items():
        assert np.max(np.abs(values - reference) / reference) < 1e-4, (mesh, values, reference)


# Every family through the launcher: each objective's random choices (MLM masking, CLM chunking, T5 spans, BART
# permutation and infilling) must come back from the checkpointed iterator position exactly.
# Packed rows (docs/packing.md): RoBERTa packs its lines, the stream families isolate their documents.
PACKED = {
    "gpt2": {"document_attention": "isolated"},
    "roberta": {"line_by_line": True, "packing": True},
    "t5": {"document_attention": "isolated"},
    "bart": {"document_attention": "isolated"},
    "modernbert": {"line_by_line": True, "packing": True},
    "llama": {"document_attention": "isolated"},
    "qwen3": {"document_attention": "isolated"},
}


def flags_of(values: dict) -> tuple[str, ...]:
    return tuple(
        arg
        for name, value in values.items()
        for arg in ((f"--{name}",) if value is True else (f"--{name}", str(value)))
    )


# Each family resumes once with the bf16 + remat + sample-prompts run it gets through the launcher on the fsdp x tensor
# mesh (one run serves both: suite budget), joined or packed; every objective resumes both ways across its families:
# MLM joined (RoBERTa) and packed lines (ModernBERT), CLM joined (GPT-2, Llama) and isolated documents (Qwen3), and
# T5's and BART's objectives, which have one family each, a second time packed, in float32 on data=2,fsdp=4. (The
# model's side of packing, segment ids in attention and positions, has its tests per family in
# test_packing_models.py.)
RESUMES = [
    *[(family, family in ("modernbert", "qwen3"), True) for family in FIXTURES],
    ("t5", True, False),
    ("bart", True, False),
]
BF16_REMAT = ("--dtype", "bfloat16", "--gradient_checkpointing", "--sample_every", "3")


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,packed,bf16",
    RESUMES,
    ids=[f"{f}-{'packed' if p else 'joined'}{'-bf16' if b else ''}" for f, p, b in RESUMES],
)
def test_resume_continues_exactly(family, packed, bf16, tmp_path, tiny_configs, cache_dir, monkeypatch):
    prompts = families()[family].quickstart["sample_prompts"]  # what the quick start shows while training
    args = (
        *("--max_steps", "6", "--save_steps", "3", "--do_train"),
        *(flags_of(PACKED[family]) if packed else ()),
        *(("--mesh", SHARDED, *BF16_REMAT, "--sample_prompts", prompts) if bf16 else ("--mesh", "data=2,fsdp=4")),
    )
    whole, interrupted = tmp_path / "whole", tmp_path / "interrupted"
    assert launch(family, whole, tiny_configs[family], cache_dir, *args) == 0
    run_killed_after_first_checkpoint(
        monkeypatch, lambda: launch(family, interrupted, tiny_configs[family], cache_dir, *args)
    )
    assert checkpoint.make_manager(interrupted, read_only=True).all_steps() == [3]
    assert launch(family, interrupted, tiny_configs[family], cache_dir, *args) == 0  # the same command resumes
    losses = train_losses(interrupted)
    assert len(losses) == 6 and np.isfinite(losses).all()
    assert losses == train_losses(whole)  # bitwise on CPU
    restored = [final_params(out) for out in (whole, interrupted)]
    assert restored[0].keys() == restored[1].keys()
    for name in restored[0]:
        np.testing.assert_array_equal(restored[0][name], restored[1][name], err_msg=name)
    objective = json.loads((interrupted / "run_config.json").read_text())["objective"]
    assert all(objective[name] == value for name, value in PACKED[family].items()) == packed  # recorded
    if bf16:
        assert_bf16_remat_run(family, whole, interrupted, prompts)


def assert_bf16_remat_run(family: str, whole: Path, resumed: Path, prompts: str) -> None:
    """What a bf16 + --gradient_checkpointing run with --sample_prompts leaves: samples of every prompt at steps 3 and
    6 (the resumed run's last the same as the whole run's), its compile's figures, and the layer plan it chose."""
    logged = [json.loads(line) for line in (whole / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [3, 6]
    for record in logged:
        assert [s["prompt"] for s in record["samples"]] == prompts.split("|")
        for sample in record["samples"]:
            if "fill_mask" in sample:  # RoBERTa: 3 candidates per <mask>
                assert sample["fill_mask"] and all(len(c) == 3 for c in sample["fill_mask"])
            else:
                assert isinstance(sample["greedy"], str) and isinstance(sample["sampled"], str)
    last = json.loads((resumed / "samples.jsonl").read_text().splitlines()[-1])
    assert last == logged[-1]  # the same weights at step 6: the same samples (sampled with the step as its seed)
    compiled = [m for m in read_metrics(whole) if m.get("event") == "compile"]
    assert compiled and compiled[0]["temp_bytes"] > 0
    # --gradient_checkpointing is an explicit remat; --scan_unroll auto unrolls the small encoder-decoders on CPU
    plan = json.loads((whole / "run_config.json").read_text())["layer_plan"]
    assert (plan["remat"], plan["scan_unroll"]) == ("full", 0 if family in ("t5", "bart") else 1)
    assert list(plan["auto"]) == ["scan_unroll"]


def all_equations(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it (scan bodies, remat, custom derivatives)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else (param,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from all_equations(inner)


@pytest.mark.slow
@pytest.mark.parametrize("family", FIXTURES)
def test_bfloat16_runs_the_matmuls_in_bf16_and_keeps_the_rest_float32(family):
    """--dtype bfloat16: float32 parameters and optimizer state; every matmul (attention included) on bf16
    operands; norms, softmax and the logits in float32."""
    config = families()[family].config_class.from_dict(FIXTURES[family].tiny_config)
    graphdef, state = build_train_state(
        families()[family], config, make_mesh("data=8"), compute=Compute(dtype="bfloat16")
    )
    assert {leaf.dtype for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)} == {
        jnp.dtype(jnp.float32)
    }
    model = nnx.merge(graphdef, state)[0]
    batch = {
        k: jnp.asarray(v)
        for k, v in FIXTURES[family].make_batch(FIXTURES[family].tiny_config, np.random.default_rng(0)).items()
    }
    batch = {k: v % 500 if k.endswith("input_ids") else v for k, v in batch.items()}
    closed = jax.make_jaxpr(lambda m: m(**batch))(model)
    assert closed.out_avals[0].dtype == jnp.float32  # logits
    kinds = {}
    for eqn in all_equations(closed.jaxpr):
        kinds.setdefault(eqn.primitive.name, set()).update(
            str(v.aval.dtype) for v in eqn.invars if hasattr(v.aval, "dtype")
        )
    assert kinds["dot_general"] == {"bfloat16"}
    assert kinds["rsqrt"] == {"float32"} and kinds["exp"] == {"float32"}  # norms; softmax (and the loss after it)


if __name__ == "__main__":  # regenerate the golden files: python tests/test_families.py
    import os

    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    for name in FIXTURES:
        (GOLDEN / f"{name}_partition_specs.json").write_text(
            json.dumps(partition_specs(name, SHARDED)[0], indent=1, sort_keys=True) + "\n"
        )
