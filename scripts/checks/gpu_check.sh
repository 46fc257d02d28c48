#!/usr/bin/env bash
# One prepared GPU run, inside 8 minutes on an H200: every stage has its own timeout, and no stage may run
# past a deadline of 470 s from the start (a stage that would is cut short, and the summary says so).
#   1. the kernel tests on CUDA (fp32/fp16 at the awkward CPU shapes, then bf16/fp16 at BERT shapes and
#      the speed checks marked `gpu`; ALiBi included: parity with the SDPA path given the dense float bias,
#      and no bias tensor in the kernel's peak memory), and the FLOP-count tests;
#   2. scripts/checks/aot_check.py --compare-gpu: the AOT compile of every kernel for this GPU's target (bf16)
#      beside the registers and spills the driver reports for the kernels the launchers really compiled;
#   3. scripts/bench/bench_kernels.py: attention, LayerNorm, gated GELU and cross-entropy against PyTorch, bf16,
#      batch 128, 12 heads, seq 128 and 512, head_dim 64, and attention with ALiBi against the model's SDPA
#      path with the float bias (SWEEP=1 adds the tile sweep, ~2 minutes more);
#   4. scripts/bench/bench_pretrain.py: full training steps of crammed-bert at seq 128, micro-batch 128, bf16,
#      compiled, against Hugging Face BertForMaskedLM of the closest shape: tokens/s, FLOP/s, MFU against a
#      matmul peak measured in the same run, peak memory, data-path share (SDPA + torch LayerNorm), then
#      ours alone with the Triton attention and LayerNorm, to choose the default backends;
#   5. the micro-batch search of impl.microbatch_size=auto for crammed-bert (its trials, OOM included);
#   6. with 2 or more visible GPUs (and hydra installed), a 2-GPU FSDP2 pretraining run of the tiny model
#      with train/optim=galore_adamw_8bit, 40 updates (torchrun --nproc_per_node=2); skipped with a line
#      saying why otherwise. It comes last: raise BUDGET_S when the earlier stages leave it no time.
# Writes results/kernels/<gpu>.md, results/kernels/<gpu>-tests.log, results/kernels/aot-<gpu>.md,
# results/step-speed/cuda-<gpu>*.md, results/step-speed/autobatch-<gpu>.md and
# results/optimizers/fsdp2-galore-<gpu>.log (with the run's metrics in
# results/optimizers/fsdp2-galore-<gpu>-metrics.jsonl), and copies them to $OUT (same paths) when set.
# Needs python with torch (CUDA), triton, pytest, transformers and PyYAML; not hydra, datasets or evaluate.
#
#   bash scripts/checks/gpu_check.sh                 # PYTHON=python3.12 bash scripts/checks/gpu_check.sh to choose one
set -uo pipefail

cd "$(dirname "$0")/../.."
REPO=$(pwd)
PY=${PYTHON:-python3}

$PY - <<'EOF' || { echo "no usable CUDA device: nothing to check"; exit 1; }
import torch, triton
assert torch.cuda.is_available()
print(f"{torch.cuda.get_device_name()}: torch {torch.__version__}, triton {triton.__version__}")
EOF
GPU=$($PY -c "import torch; print(torch.cuda.get_device_name().lower().replace(' ', '-'))")
mkdir -p results/kernels results/step-speed results/optimizers
LOG="results/kernels/${GPU}-tests.log"
MD="results/kernels/${GPU}.md"

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

# The training modules reach `omegaconf.MISSING` (the string "???") through cramming.eval's config at import.
# Without omegaconf (a bare machine: no hydra), a one-line stand-in lets the benchmarks import them.
if ! $PY -c "import omegaconf" 2>/dev/null; then
    STUB=$(mktemp -d)
    mkdir "$STUB/omegaconf"
    echo 'MISSING = "???"  # stand-in for the GPU check only: the benchmarks need no more of omegaconf' \
        > "$STUB/omegaconf/__init__.py"
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$STUB"
fi

TESTS=(tests/test_kernels_attention.py tests/test_kernels_layernorm.py tests/test_flops.py)
for extra in tests/test_kernels_glu.py tests/test_kernels_cross_entropy.py tests/test_kernels_convergence.py; do
    [ -f "$extra" ] && TESTS+=("$extra")
done

# Every stage runs under `timeout`, the smaller of its own limit and what is left of the deadline.
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-470} ))
stage() {  # stage SECONDS command...: the command's exit status; 124 when cut by its timeout
    local limit=$1 left
    shift
    left=$(( DEADLINE - $(date +%s) ))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -lt 15 ]; then
        echo "skipped, the 470 s deadline is reached: $*"
        return 124
    fi
    timeout "$limit" "$@"
}

# Triton compiles every kernel variant on first use (~1 s each, about a hundred here), so the tests take
# about two minutes and the kernel benchmarks one and a half (three with SWEEP=1).
echo "== kernel tests on CUDA ($(date -u +%T))"
stage 170 $PY -m pytest -q -p no:cacheprovider --durations=10 "${TESTS[@]}" 2>&1 | tee "$LOG"
TEST_RC=${PIPESTATUS[0]}

# Ahead-of-time compile for this GPU's target against what the launchers compiled in the tests' place.
echo "== AOT compile against the real build ($(date -u +%T))"
AOT_MD="results/kernels/aot-${GPU}.md"
CC=$($PY -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
stage 90 $PY scripts/checks/aot_check.py --targets "$CC" --dtypes bf16 --compare-gpu --quiet --out "$AOT_MD"
AOT_RC=$?

echo "== benchmarks ($(date -u +%T))"
SWEEP_FLAG=$([ "${SWEEP:-0}" = 1 ] && echo --sweep)
stage 100 $PY scripts/bench/bench_kernels.py $SWEEP_FLAG --reps 20 --out "$MD"
BENCH_RC=$?

# Training steps: the default fast path (compile, SDPA, torch LayerNorm, fused AdamW) against HF, then ours
# with the Triton kernels. torch.compile of both models takes about a minute of the first stage.
STEP_MD="results/step-speed/cuda-${GPU}.md"
STEP_TRITON_MD="results/step-speed/cuda-${GPU}-triton.md"
echo "== training-step benchmark ($(date -u +%T))"
stage 120 $PY scripts/bench/bench_pretrain.py --arch crammed-bert --microbatch 128 --compile --profile 3 --out "$STEP_MD"
STEP_RC=$?
stage 80 $PY scripts/bench/bench_pretrain.py --arch crammed-bert --microbatch 128 --compile --no-hf \
    --attention triton --layernorm triton --ffn-activation triton --loss triton --rounds 3 --out "$STEP_TRITON_MD"
echo "== micro-batch search ($(date -u +%T))"
AUTOBATCH_MD="results/step-speed/autobatch-${GPU}.md"
stage 60 $PY scripts/bench/bench_pretrain.py --arch crammed-bert --autobatch --out "$AUTOBATCH_MD"
# Two GPUs, FSDP2, GaLore with 8-bit moments: each rank projects its rows, gathering the whole gradient on
# projector refreshes (every 10 updates here); proj_type=right shards all of GaLore's state.
FSDP2_LOG="results/optimizers/fsdp2-galore-${GPU}.log"
FSDP2_METRICS="results/optimizers/fsdp2-galore-${GPU}-metrics.jsonl"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
FSDP2_RC=0
echo "== 2-GPU FSDP2 pretraining with galore_adamw_8bit ($(date -u +%T))"
if [ "$NGPU" -lt 2 ]; then
    echo "skipped: the 2-GPU FSDP2 run needs 2 visible CUDA devices, and this machine shows $NGPU" | tee "$FSDP2_LOG"
elif ! $PY -c "import hydra" 2>/dev/null; then
    echo "skipped: the 2-GPU FSDP2 run goes through pretrain.py, which needs hydra (pip install hydra-core)" \
        | tee "$FSDP2_LOG"
else
    FSDP2_DIR=$(mktemp -d)
    stage 150 $PY -m torch.distributed.run --standalone --nproc_per_node=2 pretrain.py name=fsdp2-galore \
        data=embedded arch=tiny budget=1 train.steps=40 train.lr_schedule=steps-linear train.batch_size=64 \
        train/optim=galore_adamw_8bit train.optim.rank=16 train.optim.update_proj_gap=10 \
        train.optim.proj_type=right impl.distributed=fsdp2 impl.precision=bf16 impl.microbatch_size=16 \
        train.log_every=5 base_dir="$FSDP2_DIR" 2>&1 | tee "$FSDP2_LOG"
    FSDP2_RC=${PIPESTATUS[0]}
    METRICS=$(find "$FSDP2_DIR" -name metrics.jsonl | head -n 1)
    [ -n "$METRICS" ] && cp "$METRICS" "$FSDP2_METRICS"
fi
echo "== done ($(date -u +%T))"
{
    echo
    echo "## Kernel tests"
    echo
    echo "\`pytest ${TESTS[*]}\` exit status ${TEST_RC}: $(tail -n 1 "$LOG")"
} >> "$MD"

if [ -n "${OUT:-}" ]; then  # each file under the same path as here, so it lands in its study's folder
    for f in "$LOG" "$MD" "$AOT_MD" "$STEP_MD" "$STEP_TRITON_MD" "$AUTOBATCH_MD" "$FSDP2_LOG" \
        "$FSDP2_METRICS"; do
        [ -f "$f" ] && mkdir -p "$OUT/$(dirname "$f")" && cp "$f" "$OUT/$f"
    done
fi
echo "tests exit ${TEST_RC}, AOT exit ${AOT_RC}, kernel bench exit ${BENCH_RC}, step bench exit ${STEP_RC}," \
    "2-GPU FSDP2 exit ${FSDP2_RC}; wrote $MD, $LOG, $AOT_MD, $STEP_MD, $FSDP2_LOG"
[ "$TEST_RC" -eq 0 ] && [ "$AOT_RC" -eq 0 ] && [ "$BENCH_RC" -eq 0 ] && [ "$STEP_RC" -eq 0 ] && [ "$FSDP2_RC" -eq 0 ]
