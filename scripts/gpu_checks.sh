#!/usr/bin/env bash
# The GPU checks of docs/gpu.md on one GPU, most valuable first, within one time budget, every result written the
# moment it exists (OUT_DIR/summary.txt a line per check, OUT_DIR/<check>.log, failing tests named in
# OUT_DIR/failures.txt as they fail).
#
#   bash scripts/gpu_wheels.sh                                 # here, with network: .gpu-wheels/ (~4 MB)
#   bash scripts/gpu_checks.sh [OUT_DIR]                       # there: default gpu-checks/
#   CHECKS="environment rl_steps" bash scripts/gpu_checks.sh   # a subset, in this script's order
#   DRY_RUN=1 bash scripts/gpu_checks.sh OUT                   # on a CPU: every command at toy sizes through
#                                                              # Triton's interpreter (checks the script itself)
#
# Checks: environment (versions, which statistics path runs), kernel_tests (the kernel tests on CUDA tensors against
# float64), rl_steps (a few RL steps of the CPU job's config on the GPU: step-0 exact KL < 1e-8 and train-vs-rollout
# mismatch < 1e-4, then a bf16 run that checkpoints and resumes exactly), context_parallel (CP=2 against one rank,
# where Transformer Engine and two GPUs are), bench_logits,
# bench_truncation, bench_linear (tools/bench_vocab_parallel.py --device cuda), bench_teacher (the RL step distilling
# from a teacher twice the student's depth against the step with the reference only: tools/bench_step.py --teacher),
# rest (the remaining suite).
# Wheels in .gpu-wheels/ are installed first (--no-index --no-deps); the project is imported from this checkout.
# A check that fails or runs out of time is recorded and the next one runs; the exit code is the number of checks
# that did not pass. BUDGET_S (default 540) bounds all checks together: each gets min(its deadline, what is left).
# Environment: PYTHON, CHECK_SCALE (multiplies every deadline), PYTEST_WORKERS (pytest-xdist, default 8).
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu-checks}
py=${PYTHON:-python3}
scale=${CHECK_SCALE:-1}
workers=${PYTEST_WORKERS:-8}
dry=${DRY_RUN:-0}
budget=${BUDGET_S:-540}
selected=" ${CHECKS:-environment kernel_tests rl_steps context_parallel bench_logits bench_truncation bench_linear bench_teacher rest} "
mkdir -p "$out"
out=$(cd "$out" && pwd)
: >>"$out/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$(date +%s)
failed=0

if [ -d .gpu-wheels ] && [ "$dry" = 0 ]; then
    "$py" -m pip install --quiet --no-index --no-deps .gpu-wheels/*.whl >"$out/wheels.log" 2>&1 \
        || echo "wheels: install failed (see wheels.log)" | tee -a "$out/summary.txt"
fi

check() {  # check NAME DEADLINE_S COMMAND...
    local name=$1 limit=$(( $2 * scale )) start rc left
    shift 2
    [[ $selected == *" $name "* ]] || return 0
    left=$(( budget * scale - ($(date +%s) - started) ))
    if [ "$left" -lt 10 ]; then
        printf '%-18s skipped: the budget (%ss) is spent\n' "$name" "$(( budget * scale ))" | tee -a "$out/summary.txt"
        failed=$(( failed + 1 ))
        return 0
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || failed=$(( failed + 1 ))
    printf '%-18s rc=%-4s %5ss  (deadline %ss)\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" \
        | tee -a "$out/summary.txt"
}

pytest_args=(-q -rfE --tb=short -p megatron_kl.testing.failure_log --failure-log "$out/failures.txt")
parallel_args=()
"$py" -c "import xdist" 2>/dev/null && parallel_args=(-n "$workers")
# kernel tests: one rank on the GPU (CUDA tensors: the Triton path); on a dry run, CPU tensors through the interpreter
kernel_env=(MEGATRON_KL_TEST_WORLDS=1)
bench=(--device cuda)
sizes_logits=8192x152064,4096x32768 sizes_truncation=4096x32768 sizes_linear=4096x152064 hidden=896
collect=()
if [ "$dry" != 0 ]; then  # the tests' node ids are collected, not run (the suite runs them on CPU anyway)
    collect=(--collect-only)
    kernel_env+=(TRITON_INTERPRET=1 MEGATRON_KL_TRITON=1)
    bench+=(--dry-run)
    sizes_logits=16x300 sizes_truncation=16x300 sizes_linear=64x300 hidden=32
fi

# 1. the machine, the software, and which path the statistics take
check environment 30 bash -c "command -v nvidia-smi >/dev/null && nvidia-smi; $py - <<'EOF'
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
if torch.cuda.is_available():
    print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
import megatron.core, transformers
print('megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)
for name in ('triton', 'liger_kernel', 'transformer_engine'):
    try:
        module = __import__(name)
        print(name, getattr(module, '__version__', 'installed'))
    except ImportError:
        print(name + ': not installed')
from megatron_kl.vocab_parallel import triton_stats
print(triton_stats.describe(torch.device('cuda' if torch.cuda.is_available() else 'cpu')))
EOF"
# 2. the kernels on CUDA tensors against the float64 references (the tests the interpreter runs on CPU), in parallel:
#    most of their time is Triton compiling each specialisation once
check kernel_tests 200 env "${kernel_env[@]}" "$py" -m pytest "${pytest_args[@]}" "${parallel_args[@]}" "${collect[@]}" \
    megatron_kl/validation/test_vocab_parallel.py megatron_kl/validation/test_vocab_parallel_accuracy.py \
    megatron_kl/validation/test_fused_linear.py tests/distributed/test_truncation.py \
    tests/distributed/test_triton_kernels.py
# 3. does an RL step train on this GPU: the step-0 gates, then a bf16 run that checkpoints and resumes exactly
check rl_steps 150 "$py" -m pytest "${pytest_args[@]}" "${collect[@]}" \
    "tests/e2e/test_step0_gates.py::test_step_0_policy_equals_reference_and_rollout[embedded-tp1]" \
    tests/e2e/test_resume.py::test_bf16_mixed_precision_trains_and_resumes_exactly
# 3b. context parallelism (CP=2 forward/backward/update equal to one rank): runs where Transformer Engine and two
#     GPUs are (skipped, and said so, elsewhere)
check context_parallel 90 "$py" -m pytest "${pytest_args[@]}" -rs "${collect[@]}" \
    "megatron_kl/validation/test_model_layouts.py::test_layout_matches_single_rank[cp2]"
# 4. the kernel benchmarks, every peer in the same rounds (times only mean something next to their baselines)
check bench_logits 75 "$py" tools/bench_vocab_parallel.py "${bench[@]}" --section logits --sizes "$sizes_logits" \
    --repeats 3
check bench_truncation 45 "$py" tools/bench_vocab_parallel.py "${bench[@]}" --section truncation \
    --sizes "$sizes_truncation" --dtypes float32 --repeats 3
check bench_linear 60 "$py" tools/bench_vocab_parallel.py "${bench[@]}" --section linear --sizes "$sizes_linear" \
    --hidden "$hidden" --repeats 3
# 4b. the teacher's pass in the RL step (distillation) against the reference-only step, interleaved
check bench_teacher 90 "$py" tools/bench_step.py --teacher --steps 3 --rounds 1
# 5. the rest of the suite (1-rank tests on the GPU, multi-rank ones on gloo; the kernel tests ran above), failures
#    named as they happen
if [ "$dry" = 0 ]; then
    check rest 300 "$py" -m pytest "${pytest_args[@]}" "${parallel_args[@]}" -m "not slow and not vllm" \
        tests/unit tests/distributed tests/e2e megatron_kl/validation --ignore=tests/distributed/test_triton_kernels.py \
        --ignore=megatron_kl/validation/test_vocab_parallel.py --ignore=megatron_kl/validation/test_fused_linear.py \
        --ignore=megatron_kl/validation/test_vocab_parallel_accuracy.py --ignore=tests/distributed/test_truncation.py
else  # the selection only: collecting the suite proves the command
    check rest 60 "$py" -m pytest -q --collect-only -m "not slow and not vllm" tests/unit
fi
echo "checks not passed: $failed ($(( $(date +%s) - started )) s)" | tee -a "$out/summary.txt"
exit "$failed"
