#!/usr/bin/env bash
# Run one specjax training command on every host of a Cloud TPU pod slice.
#
#   launch/tpu_pod.sh create  NAME ZONE ACCELERATOR [VERSION]   # e.g. my-pod us-east5-a v5p-64
#   launch/tpu_pod.sh setup   NAME ZONE                         # clone/copy + install on all hosts
#   launch/tpu_pod.sh train   NAME ZONE CONFIG [key=value ...]  # same command on all hosts
#   launch/tpu_pod.sh delete  NAME ZONE
#   launch/tpu_pod.sh --dry-run COMMAND ...   # print the commands (and each worker's), run nothing
#
# On a pod, jax.distributed finds the coordinator itself (SPECJAX_DISTRIBUTED=auto); every host
# reads the same config, runs the same data iterator and feeds its own rows of each global batch.
# The repository is copied from this machine to ~/specjax on every worker.
set -euo pipefail

usage() { sed -n '2,13p' "$0"; exit 2; }
dry_run=0
if [[ ${1:-} == --dry-run ]]; then
  dry_run=1
  shift
fi
[[ $# -ge 3 ]] || usage
cmd=$1 name=$2 zone=$3
shift 3

run() {  # run a command here, or with --dry-run print it (shell-quoted, one line) instead
  if (( dry_run )); then
    printf 'local:'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}

on_all() {  # run a shell snippet on every worker of the slice (--dry-run: also print the snippet)
  run gcloud compute tpus tpu-vm ssh "$name" --zone "$zone" --worker=all --command "$1"
  if (( dry_run )); then
    printf 'each worker (--worker=all): %s\n' "$1"
  fi
}

case "$cmd" in
  create)
    [[ $# -ge 1 ]] || usage
    accel=$1 version=${2:-v2-alpha-tpuv5}
    run gcloud compute tpus tpu-vm create "$name" --zone "$zone" --accelerator-type "$accel" --version "$version"
    ;;
  setup)
    repo=$(cd "$(dirname "$0")/.." && pwd)
    if (( dry_run )); then tarball=$(mktemp -u --suffix .tar.gz); else tarball=$(mktemp --suffix .tar.gz); fi
    run tar -C "$repo" --exclude .git --exclude .venv --exclude runs -czf "$tarball" .
    run gcloud compute tpus tpu-vm scp "$tarball" "$name:~/specjax.tar.gz" --zone "$zone" --worker=all
    run rm -f "$tarball"
    on_all 'mkdir -p ~/specjax && tar -C ~/specjax -xzf ~/specjax.tar.gz && cd ~/specjax && python3 -m venv .venv && .venv/bin/pip install -q -e . "jax[tpu]"'
    ;;
  train)
    [[ $# -ge 1 ]] || usage
    config=$1
    shift
    overrides=""
    for kv in "$@"; do overrides+=" $(printf '%q' "$kv")"; done
    on_all "cd ~/specjax && SPECJAX_DISTRIBUTED=auto .venv/bin/python -m specjax.launch --config $(printf '%q' "$config")$overrides"
    ;;
  delete)
    run gcloud compute tpus tpu-vm delete "$name" --zone "$zone" --quiet
    ;;
  *)
    usage
    ;;
esac
