#!/usr/bin/env bash
# Thin wrapper around `stagectl stage-b`:
#   gpus=0,1,2,3 config=path/to.yaml bash scripts/stage_b.sh [extra args]
#   nproc=2 config=path/to.yaml bash scripts/stage_b.sh        # N processes without naming devices (CPU: gloo)
# One device -> one process; several -> single-node torchrun with CUDA_VISIBLE_DEVICES from the list.
# stagectl is the one on the PATH, else the repository's .venv/bin/stagectl (what `make install` builds),
# else STAGECTL=/path/to/stagectl.
set -euo pipefail
: "${config:?set config=path/to/stage_b.yaml}"
args=("$config")
if [[ -n "${gpus:-}" ]]; then
  args+=(--gpus "$gpus")
fi
if [[ -n "${nproc:-}" ]]; then
  args+=(--nproc "$nproc")
fi
stagectl="${STAGECTL:-}"
if [[ -z "$stagectl" ]]; then
  if command -v stagectl >/dev/null 2>&1; then
    stagectl=stagectl
  else
    stagectl="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv/bin/stagectl"
  fi
fi
if [[ "$stagectl" != stagectl && ! -x "$stagectl" ]]; then
  echo "stage_b.sh: stagectl is not on the PATH and $stagectl does not exist: run \`make install\` (or" \
    "\`source .venv/bin/activate\`), or set STAGECTL=/path/to/stagectl" >&2
  exit 127
fi
exec "$stagectl" stage-b "${args[@]}" "$@"
