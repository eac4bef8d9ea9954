#!/usr/bin/env bash
# Run spmdlm on every worker of a Cloud TPU pod slice (e.g. v4-32). JAX discovers the pod topology itself
# (jax.distributed.initialize() with no arguments), so every worker runs the same command.
#   launch/tpu_pod.sh TPU_NAME ZONE -- <spmdlm.launch flags>
# e.g. launch/tpu_pod.sh my-v4-32 us-central2-b -- --mesh data=-1 --model_type gpt2 --config_name gpt2 \
#        --train_file 'gs://BUCKET/corpus/*.txt' --output_dir gs://BUCKET/runs/gpt2 ...
# Quote globs: spmdlm expands them itself, on each worker; unquoted, your local shell expands them first.
#
# Data and output: gs:// URLs (the gcs extra, installed below; the workers' service account needs access to the
# bucket), or one filesystem mounted at the same path on every worker (e.g. Filestore over NFS). A prepared
# dataset (--dataset_dir gs://...) is copied once to each worker's disk; see docs/tpu.md, "Buckets".
# Code: the repository must be at SPMDLM_REPO_DIR on every worker (an absolute path; default: spmdlm in the worker's
# home). With SPMDLM_GIT_URL set, each worker clones it there first, or pulls if it is already cloned; without it,
# copy a checkout (without its .venv) yourself, e.g.
#   gcloud compute tpus tpu-vm scp --recurse --worker=all --zone ZONE spmdlm TPU_NAME:~/
# The first run on a worker creates .venv there and installs spmdlm with its tpu (jax[tpu]) and gcs extras.
set -euo pipefail
TPU_NAME=$1
ZONE=$2
shift 2
[ "${1:-}" = "--" ] && shift
ARGS=$(printf ' %q' "$@")
# What each worker runs, single-quoted so that nothing in it ($HOME included) is expanded on this machine.
# shellcheck disable=SC2016
REMOTE='
set -e
REPO_DIR=${REPO_DIR:-$HOME/spmdlm}
if [ -n "$GIT_URL" ]; then
  if [ -d "$REPO_DIR/.git" ]; then git -C "$REPO_DIR" pull --ff-only; else git clone "$GIT_URL" "$REPO_DIR"; fi
fi
if [ ! -d "$REPO_DIR" ]; then
  echo "$(hostname): no spmdlm repository at $REPO_DIR; copy it there or set SPMDLM_GIT_URL" >&2
  exit 1
fi
cd "$REPO_DIR"
[ -d .venv ] || (python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[tpu,gcs]")
. .venv/bin/activate
python -c "import gcsfs" 2>/dev/null || pip install -q -e ".[gcs]"
python -m spmdlm.launch'
gcloud compute tpus tpu-vm ssh "$TPU_NAME" --zone "$ZONE" --worker=all --command \
  "REPO_DIR=$(printf %q "${SPMDLM_REPO_DIR:-}"); GIT_URL=$(printf %q "${SPMDLM_GIT_URL:-}");$REMOTE$ARGS"
