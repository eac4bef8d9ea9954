#!/usr/bin/env bash
# GPT-2 124M, bf16 compute, 8 x 1024 tokens per step on one NVIDIA GPU: tokens/s, MFU against the dense bf16 peak
# (spmdlm/devices.py CHIPS), peak device memory, with the launcher's --attention choices: xla (einsums), dot_product
# (jax.nn.dot_product_attention's XLA path) and cudnn (its cuDNN flash attention), all three in one process with
# their steps interleaved; then --remat and --loss_chunk_size against cudnn; then the launcher itself with
# --attention auto (which must pick cudnn) on the embedded corpus. One JSON line per benchmark under $OUT.
#
#   bash benchmarks/gpu_gpt2_124m.sh            # on the GPU machine, from the repository root; ~6 min
#
# Needs JAX with CUDA: it installs the project with its cuda extra into .venv-gpu unless SPMDLM_PYTHON names a
# Python that has both.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
PY=${SPMDLM_PYTHON:-}
if [ -z "$PY" ]; then
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  pip install -q -e '.[cuda]'
  PY=python
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import jax; print(jax.devices())"
common=(--model gpt2 --config gpt2 --dtype bfloat16 --mesh data=1 --batch_size 8 --seq_len 1024)
"$PY" benchmarks/bench_train.py "${common[@]}" --steps 20 --warmup 3 \
  --compare attention=dot_product --compare attention=cudnn | tee "$OUT/gpt2-124m-attention.json"
"$PY" benchmarks/bench_train.py "${common[@]}" --steps 20 --warmup 3 --attention cudnn \
  --compare loss_chunk=256 --compare remat=none --compare remat=full | tee "$OUT/gpt2-124m-loss-chunk.json"
# The launcher as a user runs it: --attention auto on the GPU with bf16 is cudnn (run_config.json records it).
"$PY" -m spmdlm.launch --config_name gpt2 --dtype bfloat16 --mesh data=1 --per_device_train_batch_size 8 \
  --block_size 1024 --max_steps 60 --logging_steps 20 --eval_steps 1000 --save_steps 1000 --export_hf false \
  --overwrite_output_dir --output_dir "$OUT/launch" --attention auto
"$PY" - "$OUT" <<'EOF'
import json, sys, pathlib
out = pathlib.Path(sys.argv[1]) / "launch"
print("launcher: attention", json.loads((out / "run_config.json").read_text())["attention_implementation"])
for m in (json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()):
    if "loss" in m:
        print(f"  step {m['step']}: {m['tokens_per_second']:,.0f} tok/s, MFU {m.get('mfu', float('nan')):.3f}")
EOF
"$PY" - "$OUT" <<'EOF'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("gpt2-124m-*.json")):
    r = json.loads(path.read_text().strip().splitlines()[-1])
    for arm in [r, *r.get("variants", [])]:
        memory = arm.get("memory_per_device_bytes") or {}
        print(f"{arm.get('variant', 'base')[:70]:<70} {arm['tokens_per_s']['median']:>10,.0f} tok/s  "
              f"MFU {arm['mfu']:.3f}  temp {memory.get('temp_bytes', 0) / 2**30:.2f} GiB")
    print("  device peak memory (whole process):", r.get("device_memory"))
EOF
