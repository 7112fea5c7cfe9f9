#!/usr/bin/env bash
# The GPU checks of docs/gpu.md on one GPU node, each under a deadline, every log under OUT_DIR.
#
#   bash scripts/gpu_checks.sh [OUT_DIR]                       # default gpu-checks/
#   CHECKS="environment e2e_train" bash scripts/gpu_checks.sh  # a subset, in this script's order
#
# The project must be importable (pip install -e ".[test]", or PYTHONPATH). A check that fails or runs out of time
# is recorded in OUT_DIR/summary.txt and the next one runs; the exit code is the number of checks that did not
# pass. Failing tests are named in OUT_DIR/failures.txt the moment they fail (also when a deadline cuts the run).
# Environment: PYTHON (interpreter), CHECK_SCALE (multiplies every deadline), PYTEST_WORKERS (pytest-xdist workers
# where it is installed, default 8). All checks together take about 15 minutes on one H200.
set -u
out=${1:-gpu-checks}
py=${PYTHON:-python3}
scale=${CHECK_SCALE:-1}
workers=${PYTEST_WORKERS:-8}
selected=" ${CHECKS:-environment validate e2e_train unit_distributed bench_logits bench_truncation bench_linear bench_step_135m_bf16} "
mkdir -p "$out"
out=$(cd "$out" && pwd)
: >>"$out/summary.txt"
failed=0

check() {  # check NAME DEADLINE_S COMMAND...
    local name=$1 limit=$(( $2 * scale )) start rc
    shift 2
    [[ $selected == *" $name "* ]] || return 0
    start=$(date +%s)
    timeout --kill-after=15 "$limit" "$@" >"$out/$name.log" 2>&1
    rc=$?
    [ "$rc" -eq 0 ] || failed=$(( failed + 1 ))
    printf '%-22s rc=%-4s %5ss  (deadline %ss)\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" \
        | tee -a "$out/summary.txt"
}

pytest_args=(-q -rfE --tb=short -m "not slow and not vllm" -p megatron_kl.testing.failure_log
             --failure-log "$out/failures.txt")
"$py" -c "import xdist" 2>/dev/null && pytest_args+=(-n "$workers")

# 1. the machine and the software
check environment 30 bash -c "nvidia-smi; $py - <<'EOF'
import platform, torch
print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)
print('device', torch.cuda.get_device_name(0), torch.cuda.get_device_properties(0))
import megatron.core, transformers
print('megatron-core', megatron.core.__version__, 'transformers', transformers.__version__)
try:
    import transformer_engine
    print('transformer-engine', transformer_engine.__version__)
except ImportError:
    print('transformer-engine: not installed')
EOF"
# 2. correctness: the node validation, end-to-end training on the GPU, then the unit and distributed suites
#    (1-rank tests on the GPU, multi-rank ones on gloo)
check validate 90 "$py" -m megatron_kl.cli validate --out "$out/validate" --json "$out/validate.json"
check e2e_train 240 "$py" -m pytest "${pytest_args[@]}" tests/e2e/test_train.py tests/e2e/test_engine.py \
    tests/e2e/test_step0_gates.py tests/e2e/test_checkpoint_integrity.py tests/e2e/test_offload.py
check unit_distributed 300 "$py" -m pytest "${pytest_args[@]}" tests/unit tests/distributed megatron_kl/validation
# 3. kernels and the trainer's step at GPU speed (times only mean something next to their same-run baselines)
check bench_logits 60 "$py" tools/bench_vocab_parallel.py --device cuda --section logits --sizes 8192x152064 \
    --repeats 5
check bench_truncation 90 "$py" tools/bench_vocab_parallel.py --device cuda --section truncation \
    --sizes 4096x152064 --repeats 3
check bench_linear 90 "$py" tools/bench_vocab_parallel.py --device cuda --section linear --sizes 4096x152064 \
    --hidden 896 --repeats 3
check bench_step_135m_bf16 150 "$py" tools/bench_step.py --trl-workload 135m --steps 4 model.params_dtype=bfloat16
echo "checks not passed: $failed" | tee -a "$out/summary.txt"
exit "$failed"
