#!/usr/bin/env bash
# Download, here, the wheels a GPU machine without a package registry needs to run stagectl's GPU tier and
# `python -m bench gpu` (docs/development.md, "A GPU machine without a registry"). They land in .whl/ (git-
# ignored), which the device tool's `carry` takes along; scripts/gpu_session.sh installs them there with
# `pip install --no-index --no-deps --target`. The list is what the GPU image (Python 3.12, torch 2.11+cu130,
# transformers 5.17, triton: /work/.library/device/KINDS.md) lacks, at the versions this checkout is tested
# with; torch, triton, tokenizers and the rest stay the image's own.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-.whl}
PYTHON=${PYTHON:-.venv/bin/python}
WHEELS=(
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
  typing-extensions==4.16.0  # pydantic(-core) 2.14 need >= 4.16; the image's may be older (its torch needs >= 4.10)
  fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 uvicorn==0.54.0
  xxhash==4.1.0 faster-coco-eval==1.8.0
  transformers==5.19.0  # what this checkout is tested with (the image has 5.17; its hub and tokenizers fit)
  liger-kernel==0.8.5  # training.kernels.liger (triton kernels; the image has triton)
)
mkdir -p "$DEST"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
du -sh "$DEST"
ls "$DEST"
