#!/usr/bin/env bash
# Run spmdlm as N processes on one machine, as a multi-host job would (each process = one "host").
# On a CPU-only machine each process simulates DEVICES_PER_PROCESS devices; the mesh spans all of them.
#   launch/local_multiprocess.sh [NUM_PROCESSES] [DEVICES_PER_PROCESS] -- <spmdlm.launch flags>
# e.g. launch/local_multiprocess.sh 2 4 -- --mesh data=2,fsdp=4 --max_steps 20 --output_dir runs/mp
set -euo pipefail
NUM_PROCESSES=${1:-2}
DEVICES_PER_PROCESS=${2:-4}
shift 2 || true
[ "${1:-}" = "--" ] && shift
PORT=${SPMDLM_COORDINATOR_PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < NUM_PROCESSES; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}" JAX_PLATFORMS=cpu \
    python -m spmdlm.launch --coordinator_address "127.0.0.1:${PORT}" --num_processes "$NUM_PROCESSES" \
    --process_id "$i" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
