#!/usr/bin/env bash
# Thin wrapper around `stagectl stage-b`:
#   gpus=0,1,2,3 config=path/to.yaml bash scripts/stage_b.sh [extra args]
#   nproc=2 config=path/to.yaml bash scripts/stage_b.sh        # N processes without naming devices (CPU: gloo)
# One device -> one process; several -> single-node torchrun with CUDA_VISIBLE_DEVICES from the list.
set -euo pipefail
: "${config:?set config=path/to/stage_b.yaml}"
args=("$config")
if [[ -n "${gpus:-}" ]]; then
  args+=(--gpus "$gpus")
fi
if [[ -n "${nproc:-}" ]]; then
  args+=(--nproc "$nproc")
fi
exec stagectl stage-b "${args[@]}" "$@"
