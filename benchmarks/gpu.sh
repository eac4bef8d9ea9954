#!/usr/bin/env bash
# The accelerator figures on one NVIDIA GPU, each benchmark one JSON line under $OUT (bench_train.py's record:
# tokens/s, compile time, MFU against the chip's dense bf16 peak in spmdlm/devices.py, per-arm compiled memory and
# the process's peak device memory):
#   1. GPT-2 124M, bf16, 8 x 1024: --attention xla (einsums) against dot_product (jax.nn.dot_product_attention's XLA
#      path) and cudnn (its cuDNN flash kernel), and cudnn with --remat none against the default (dots);
#   2. GPT-2 124M at llm.c's per-GPU batch, 64 x 1024: cudnn with --remat none and dots, then a 3-step profile of
#      the first (where the step's time goes, by XLA op: $OUT/profile-report.json);
#   3. T5 v1.1 base, bf16, 128 x (512 + 114) as nanoT5: cudnn against xla;
#   4. the launcher's own default run (the embedded corpus, tokenizer training included) with --attention auto.
#
#   bash benchmarks/gpu.sh                          # from the repository root, on the GPU machine: ~7 min
#   SMOKE=1 bash benchmarks/gpu.sh                  # the same sequence with tiny models on a CPU: checks the script
#
# Python: $SPMDLM_PYTHON if set, else `python3` when it already imports jax with a GPU backend, else a fresh
# .venv-gpu with `pip install -e '.[cuda]'` (the install's time is printed). WHEELS=DIR installs the wheels in DIR
# offline first (for a machine without a package index that lacks some of spmdlm's dependencies).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-bench}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
export PYTHONUNBUFFERED=1
stamp() { echo "[$(date +%T)] $*"; }
stamp start
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"

PY=${SPMDLM_PYTHON:-python3}
if [ -n "${WHEELS:-}" ]; then
  start=$SECONDS
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  stamp "wheels installed in $((SECONDS - start)) s"
elif ! "$PY" -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null && [ -z "${SMOKE:-}" ]; then
  start=$SECONDS
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate && pip install -q -e '.[cuda]' && PY=python
  stamp "pip install -e '.[cuda]' took $((SECONDS - start)) s"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c "import jax, flax, spmdlm; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"

if [ -n "${SMOKE:-}" ]; then  # tiny models, two steps: the script's own check on a CPU
  gpt2=(--model gpt2 --config gpt2-tiny --mesh data=1 --steps 2 --warmup 1)
  t5=(--model t5 --config t5-v1_1-tiny --mesh data=1 --steps 2 --warmup 1 --batch_size 4 --seq_len 64)
  small=(--batch_size 2 --seq_len 128) big=(--batch_size 4 --seq_len 128) attention=xla launch_steps=(--max_steps 4)
else
  gpt2=(--model gpt2 --config gpt2 --mesh data=1 --steps 20 --warmup 3)
  t5=(--model t5 --config t5-v1_1-base --mesh data=1 --steps 10 --warmup 2 --batch_size 128 --seq_len 512)
  small=(--batch_size 8 --seq_len 1024) big=(--batch_size 64 --seq_len 1024) attention=cudnn launch_steps=()
fi
bench() {  # NAME SECONDS ARGS...: one benchmark, its JSON line in $OUT/NAME.json; a failure does not stop the rest
  local name=$1 limit=$2; shift 2
  stamp "$name"
  timeout "$limit" "$PY" benchmarks/bench_train.py --dtype bfloat16 "$@" > "$OUT/$name.json" || stamp "$name FAILED ($?)"
  tail -c 3000 "$OUT/$name.json"; echo
}
bench gpt2-124m-8x1024 200 "${gpt2[@]}" "${small[@]}" --attention xla \
  --compare attention=dot_product --compare attention=$attention --compare attention=$attention,remat=none
WORK=${WORK:-/tmp/gpu-bench-work}  # traces and the launcher's run; $OUT gets their summaries
rm -rf "$WORK" && mkdir -p "$WORK/profile"
bench gpt2-124m-64x1024 130 "${gpt2[@]}" "${big[@]}" --attention $attention --remat none --compare remat=dots \
  --profile "$WORK/profile" --profile_label "gpt2 64x1024"
cp "$WORK/profile/report.json" "$OUT/profile-report.json" && gzip -c "$WORK/profile/step.hlo.txt" > "$OUT/step.hlo.txt.gz"
bench t5-base-128x512 120 "${t5[@]}" --attention $attention --compare attention=xla

stamp "launcher default run, bf16, --attention auto"
timeout 100 "$PY" -m spmdlm.launch --mesh data=1 --dtype bfloat16 --attention auto --output_dir "$WORK/launch" \
  --overwrite_output_dir "${launch_steps[@]}" || stamp "launcher FAILED ($?)"
cp "$WORK/launch/metrics.jsonl" "$OUT/launch-metrics.jsonl" 2>/dev/null
"$PY" - "$OUT" "$WORK" <<'PYEOF'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
for path in sorted(out.glob("*.json")):
    lines = path.read_text().strip().splitlines()
    if not lines or not lines[-1].startswith("{"):
        continue
    r = json.loads(lines[-1])
    print(f"{path.stem}  ({r['device_kind']}, {r['tokens_per_step']:,} tokens a step; process peak "
          f"{(r.get('device_memory') or {}).get('peak_bytes_in_use', 0) / 2**30:.1f} GiB)")
    for arm in [r, *r.get("variants", [])]:
        memory = arm.get("memory_per_device_bytes") or {}
        settings = dict(kv.split("=", 1) for kv in arm["variant"].split(",") if "=" in kv)
        name = f"attention={settings.get('attention')} remat={arm['layer_plan']['remat']}"
        print(f"  {name:<32} {arm['tokens_per_s']['median']:>10,.0f} tok/s  "
              f"step {1e3 * arm['step_time_s']['median']:7.1f} ms  "
              f"MFU {arm['mfu'] or float('nan'):.3f}  compile {arm['compile_s']:.0f} s  "
              f"temp {memory.get('temp_bytes', 0) / 2**30:.2f} GiB")
launch = pathlib.Path(sys.argv[2]) / "launch"
if (launch / "run_config.json").exists():
    config = json.loads((launch / "run_config.json").read_text())
    print("launcher: attention", config.get("attention_implementation"), "| layer plan", config.get("layer_plan"))
    for m in map(json.loads, (launch / "metrics.jsonl").read_text().splitlines()):
        if "loss" in m and "tokens_per_second" in m:
            print(f"  step {m['step']}: loss {m['loss']:.3f}, {m['tokens_per_second']:,.0f} tok/s, MFU {m.get('mfu')}")
PYEOF
stamp end
