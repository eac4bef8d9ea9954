#!/usr/bin/env bash
# Run spmdlm on every worker of a Cloud TPU pod slice (e.g. v4-32). JAX discovers the pod topology itself
# (jax.distributed.initialize() with no arguments), so every worker runs the same command.
#   launch/tpu_pod.sh TPU_NAME ZONE -- <spmdlm.launch flags>
# e.g. launch/tpu_pod.sh my-v4-32 us-central2-b -- --mesh data=-1 --model_type gpt2 --config_name gpt2 \
#        --train_file gs://bucket/corpus/*.txt --output_dir /mnt/disks/run/gpt2 ...
# Put the output dir on storage every worker sees (a shared filesystem or a GCS path orbax can write).
set -euo pipefail
TPU_NAME=$1
ZONE=$2
shift 2
[ "${1:-}" = "--" ] && shift
REPO_DIR=${SPMDLM_REPO_DIR:-~/spmdlm}
ARGS=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command "
  set -e
  cd $REPO_DIR
  [ -d .venv ] || (python3 -m venv .venv && . .venv/bin/activate && pip install -e . 'jax[tpu]')
  . .venv/bin/activate
  python -m spmdlm.launch $ARGS
"
