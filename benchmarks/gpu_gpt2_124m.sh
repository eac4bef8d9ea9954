#!/usr/bin/env bash
# GPT-2 124M, bf16 compute, 8 x 1024 tokens per step on one NVIDIA GPU: tokens/s, MFU against the dense bf16 peak
# (spmdlm/devices.py CHIPS), peak device memory, with the model's attention option: xla (einsums), dot_product
# (jax.nn.dot_product_attention's XLA path) and cudnn (its cuDNN flash attention), all three in one process with their steps interleaved, and the logits' share
# of memory (--loss_chunk_size). One JSON line per run under $OUT (default /tmp/gpu-bench).
#
#   bash benchmarks/gpu_gpt2_124m.sh            # on the GPU machine, from the repository root; ~5 min
#
# Needs JAX with CUDA: it installs the project with jax[cuda12] into .venv-gpu unless SPMDLM_PYTHON names a Python
# that has both.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
PY=${SPMDLM_PYTHON:-}
if [ -z "$PY" ]; then
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  pip install -q -e . "jax[cuda12]==$(python3 -c 'import importlib.metadata as m; print(m.version("jax"))' 2>/dev/null || echo 0.10.2)"
  PY=python
fi
export PYTHONUNBUFFERED=1
"$PY" -c "import jax; print(jax.devices())"
common=(--model gpt2 --config gpt2 --dtype bfloat16 --mesh data=1 --batch_size 8 --seq_len 1024)
"$PY" benchmarks/bench_train.py "${common[@]}" --steps 20 --warmup 3 \
  --compare attention=dot_product --compare attention=cudnn | tee "$OUT/gpt2-124m-attention.json"
"$PY" benchmarks/bench_train.py "${common[@]}" --steps 20 --warmup 3 --attention cudnn \
  --compare loss_chunk=256 | tee "$OUT/gpt2-124m-loss-chunk.json"
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
