#!/usr/bin/env bash
# One prepared GPU run for the Triton kernels (issue 4), a few minutes on an H100/H200:
#   1. the kernel tests on CUDA (fp32/fp16 at the awkward CPU shapes, then bf16/fp16 at BERT shapes and
#      the speed checks marked `gpu`);
#   2. scripts/bench_kernels.py --sweep: attention and LayerNorm against SDPA / F.layer_norm, bf16,
#      batch 128, 12 heads, seq 128 and 512, head_dim 64.
# Writes results/kernels-<gpu>.md and results/kernels-<gpu>-tests.log, and copies both to $OUT when set.
# Needs python with torch (CUDA), triton and pytest; not hydra or datasets.
#
#   bash scripts/gpu_check.sh                 # PYTHON=python3.12 bash scripts/gpu_check.sh to choose one
set -uo pipefail

cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python3}

$PY - <<'EOF' || { echo "no usable CUDA device: nothing to check"; exit 1; }
import torch, triton
assert torch.cuda.is_available()
print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}")
EOF
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")
mkdir -p results
LOG="results/kernels-${GPU}-tests.log"
MD="results/kernels-${GPU}.md"

# `kernels/` is installed as `cramming.kernels` by `pip install -e .`. Without that install (a bare
# machine, no network), give Python an overlay package: cramming/* plus kernels/ as cramming/kernels.
if ! $PY -c "import cramming.kernels" 2>/dev/null; then
    OVERLAY=$(mktemp -d)
    mkdir "$OVERLAY/cramming"
    for entry in "$REPO"/cramming/*; do ln -s "$entry" "$OVERLAY/cramming/"; done
    ln -s "$REPO/kernels" "$OVERLAY/cramming/kernels"
    export PYTHONPATH="$OVERLAY${PYTHONPATH:+:$PYTHONPATH}"
    $PY -c "import cramming.kernels" || { echo "cannot import cramming.kernels"; exit 1; }
fi

TESTS=(tests/test_kernels_attention.py tests/test_kernels_layernorm.py)
for extra in tests/test_kernels_glu.py tests/test_kernels_cross_entropy.py tests/test_kernels_convergence.py; do
    [ -f "$extra" ] && TESTS+=("$extra")
done

# Budget: Triton compiles every kernel variant on first use (~1 s each, about a hundred here), so the
# tests take about two minutes and the benchmarks about three. SWEEP=0 skips the tile sweep.
echo "== kernel tests on CUDA ($(date -u +%T))"
timeout 360 $PY -m pytest -q -p no:cacheprovider --durations=10 "${TESTS[@]}" 2>&1 | tee "$LOG"
TEST_RC=${PIPESTATUS[0]}

echo "== benchmarks ($(date -u +%T))"
SWEEP_FLAG=$([ "${SWEEP:-1}" = 1 ] && echo --sweep)
timeout 300 $PY scripts/bench_kernels.py $SWEEP_FLAG --out "$MD"
BENCH_RC=$?
echo "== done ($(date -u +%T))"
{
    echo
    echo "## Kernel tests"
    echo
    echo "\`pytest ${TESTS[*]}\` exit status ${TEST_RC}: $(tail -n 1 "$LOG")"
} >> "$MD"

if [ -n "${OUT:-}" ]; then
    mkdir -p "$OUT/results"
    cp "$LOG" "$MD" "$OUT/results/"
fi
echo "tests exit ${TEST_RC}, bench exit ${BENCH_RC}; wrote $MD and $LOG"
[ "$TEST_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ]
