#!/usr/bin/env bash
# Create the ms-swift interop virtual environment: `bash scripts/setup_interop_env.sh VENV_DIR` (the
# Makefile's `interop-env` target makes .venv-interop). It holds ms-swift 4.6.0 with its declared
# dependencies, torch 2.13.0 (the local CPU wheel, through constraints-cpu.txt) and msgspec, which
# swift.rlhf_trainers imports without declaring it (vLLM brings it in swift's usual installs). It does not
# hold stagectl: the `tests/interop` tier runs in stagectl's own venv and runs swift's side (its client,
# its response models) in subprocesses of this one, so the two sides never share an interpreter.
#
# ms-swift's dependencies pull no torchvision, torchaudio or CUDA wheels (checked below: the build fails
# if any appears). Idempotent: an environment that is already complete is left as it is.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/setup_interop_env.sh VENV_DIR" >&2
    exit 2
fi
VENV=$(realpath -m "$1")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PYTHON=${PYTHON:-python3}
SWIFT="ms-swift==4.6.0"
SECONDS=0

log() { echo "setup_interop_env: $*"; }

run_pip() {
    "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# True when VENV has the pinned ms-swift and CPU torch, imports swift's client and protocol modules, and
# holds no torchvision/torchaudio/CUDA wheels.
complete() {
    [[ -x "$VENV/bin/python" ]] || return 1
    (cd / && "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import importlib.util
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

ok = version("ms-swift") == "4.6.0" and version("torch") == "2.13.0+cpu"
ok = ok and all(importlib.util.find_spec(m) is None for m in ("torchvision", "torchaudio"))
ok = ok and not any((d.metadata["Name"] or "").lower().startswith("nvidia-") for d in md.distributions())
import swift.rlhf_trainers.vllm_client  # noqa: F401  (swift's /infer/ client)
import swift.infer_engine.protocol  # noqa: F401  (its request and response models)
sys.exit(0 if ok else 1)
EOF
    ) >/dev/null 2>&1
}

if complete; then
    log "$VENV is already complete (ms-swift 4.6.0, torch 2.13.0+cpu)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi

log "installing $SWIFT, torch 2.13.0+cpu and msgspec (a few minutes on a fresh machine)"
run_pip install -q -c "$ROOT/constraints-cpu.txt" "torch==2.13.0+cpu" "$SWIFT" msgspec

if ! complete; then
    log "FAILED: $VENV is incomplete after the install (swift's client does not import, or a CUDA/vision wheel came in)" >&2
    exit 1
fi
log "done in ${SECONDS} s: $("$VENV/bin/python" --version), ms-swift 4.6.0, torch 2.13.0+cpu"
