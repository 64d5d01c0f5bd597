#!/usr/bin/env bash
# One GPU session in one device call (issue #45): install the carried wheels, run the GPU tier, then
# `python -m bench gpu`, and leave the results under $OUT. Prepare here with `scripts/gpu_wheels.sh` (fills
# the git-ignored .whl/), then call the device tool once:
#     run(command="bash scripts/gpu_session.sh", carry=[".whl"], timeout_s=600)
# Sized (by estimate, not yet by a run) for under 10 minutes on an H100: the GPU tier gets GPU_TESTS_S
# (default 170 s), the bench BENCH_S (default 390 s; its rows run most-wanted first); each is cut off at its
# budget and what it finished still comes back. $OUT receives:
#   env.txt        nvidia-smi, python, torch, transformers versions
#   gpu_tests.log  the tier's output (every test passes or skips with its reason)
#   bench.log      the bench's progress lines, one per row
#   gpu.json       bench/results/gpu.json as `python -m bench gpu` wrote it
#   gpu.partial.json  the rows finished so far, instead, when the bench was cut short
#   BENCHMARKS.md  regenerated with the new GPU section
# Back here, copy gpu.json to bench/results/ and BENCHMARKS.md's "GPU" section into the checkout's.
# Without CUDA (a dry run: WHEELS_DIR=none PYTHON=.venv/bin/python) the tier skips and the bench says so.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/stagectl-gpu-out}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
WHEELS_DIR=${WHEELS_DIR:-.whl}
if compgen -G "$WHEELS_DIR/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS_DIR"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  echo "no wheels in $WHEELS_DIR: run scripts/gpu_wheels.sh where pip works and carry .whl" >&2
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  "$PYTHON" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)"
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
# the tiny models' cache is built offline on first use; build it once before the tier's tests race for it
"$PYTHON" -c "from stagectl.models.loading import load_bundle; load_bundle('builtin:tiny-qwen2.5-vl')" || exit 1
timeout "${GPU_TESTS_S:-170}" "$PYTHON" -m pytest tests/gpu -q -rs -p no:cacheprovider -o addopts="--strict-markers" \
  --durations=15 2>&1 | tee "$OUT/gpu_tests.log"
echo "gpu tier exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/gpu_tests.log"
export BENCH_GPU_PARTIAL="$OUT/gpu.partial.json"
timeout "${BENCH_S:-390}" "$PYTHON" -m bench gpu 2>&1 | tee "$OUT/bench.log"
echo "bench exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/bench.log"
if [ -f bench/results/gpu.json ] && grep -q learner_fused_ce bench/results/gpu.json; then
  cp bench/results/gpu.json BENCHMARKS.md "$OUT/"
  rm -f "$OUT/gpu.partial.json"
fi
ls -la "$OUT"
