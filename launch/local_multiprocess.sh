#!/usr/bin/env bash
# Run spmdlm as N processes on one machine, as a multi-host job would (each process = one "host").
# On a CPU-only machine each process simulates DEVICES_PER_PROCESS devices; the mesh spans all of them.
#   launch/local_multiprocess.sh [NUM_PROCESSES] [DEVICES_PER_PROCESS] -- <spmdlm.launch flags>
# e.g. launch/local_multiprocess.sh 2 4 -- --mesh data=2,fsdp=4 --max_steps 20 --output_dir runs/mp
# If a process dies, the others stop within SPMDLM_HEARTBEAT_TIMEOUT seconds (default 60) with exit code 4 and a
# line naming it; this script then says how each process ended and exits with the first failure's status.
# SIGINT/SIGTERM to this script are passed on to every process (each saves a checkpoint and stops).
set -euo pipefail
NUM_PROCESSES=${1:-2}
DEVICES_PER_PROCESS=${2:-4}
shift 2 || true
[ "${1:-}" = "--" ] && shift
PORT=${SPMDLM_COORDINATOR_PORT:-$((20000 + RANDOM % 20000))}
pids=()
forward() { kill -s "$1" "${pids[@]}" 2>/dev/null || true; }
trap 'forward INT' INT
trap 'forward TERM' TERM
for ((i = 0; i < NUM_PROCESSES; i++)); do
  XLA_FLAGS="--xla_force_host_platform_device_count=${DEVICES_PER_PROCESS}" JAX_PLATFORMS=cpu \
    python -m spmdlm.launch --coordinator_address "127.0.0.1:${PORT}" --num_processes "$NUM_PROCESSES" \
    --process_id "$i" "$@" &
  pids+=($!)
done
status=0
for i in "${!pids[@]}"; do
  code=0
  # `wait` returns early when a trapped signal arrives: wait again until the process has really ended
  while true; do
    wait "${pids[$i]}" && code=0 || code=$?
    kill -0 "${pids[$i]}" 2>/dev/null || break
  done
  if [ "$code" -ne 0 ]; then
    if [ "$code" -gt 128 ]; then
      echo "local_multiprocess.sh: process $i exited with status $code (signal $((code - 128)))" >&2
    else
      echo "local_multiprocess.sh: process $i exited with status $code" >&2
    fi
    [ "$status" -eq 0 ] && status=$code
  fi
done
exit $status
