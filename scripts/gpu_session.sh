#!/usr/bin/env bash
# One call on the lent H200 (carry .whl when it holds wheels the image lacks):
#   bash scripts/gpu_session.sh STEP...      STEP: test | memcheck | bench | ptx | tune |
#                                                  profile | examples | "any python args"
# Logs go to $OUT when it is set. Each step prints a short summary; tables print last.
set -uo pipefail
out="${OUT:-/tmp/fa_out}"; mkdir -p "$out"
# Wheels carried in .whl, and those joined from parts (scripts/gpu_parts.sh) in /tmp/wheels.
wheels=$(ls .whl/*.whl /tmp/wheels/*.whl 2>/dev/null || true)
if [ -n "$wheels" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
# pytest workers: 16 where the card has more than 100 GB, else 12 (on an 80 GB card 16
# once ran a float64 reference out of memory); WORKERS overrides.
memory=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "${memory:-0}" -gt 100000 ]; then workers=16; else workers=12; fi
python3 -c "import torch, triton, jax, jax_triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__, 'jax-triton', jax_triton.__version__, 'numpy', numpy.__version__, jax.devices())"
py="$(./scripts/env.sh)" || exit 1
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    test)  # worksteal (xdist >= 3.2): idle workers take queued tests, so long ones spread out
      dist=$("$py" -c "import xdist; print('--dist worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else '')")
      timeout "${TEST_TIMEOUT:-420}" "$py" -m pytest -n "${WORKERS:-$workers}" $dist -p no:cacheprovider \
        -p no:benchmark -rfE -v --durations=15 ${TEST_K:+-k "$TEST_K"} ${TEST_ARGS:-tests} \
        > "$out/test.log" 2>&1; grep -E "FAILED|ERROR" "$out/test.log" | head -30; tail -3 "$out/test.log" ;;
    memcheck)  # the usual shapes, then bad device and traced cu_seqlens and huge windows
      timeout "${MEMCHECK_TIMEOUT:-240}" compute-sanitizer --tool memcheck --print-limit 20 \
        "$py" -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_features.py tests/test_bounds.py -k "${MEMCHECK_K:-(torch and (test_gqa or 113x70 or (head_dims and bfloat16 and True) or combined or (window and 64x130))) or cu_seqlens or huge_windows}" \
        2>&1 | tee "$out/memcheck.log" | tail -15 ;;
    bench)  # with .bench_base (scripts/bench_base.sh REV): that commit too, then the ratios
      timeout "${BENCH_TIMEOUT:-300}" "$py" benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$out" \
        2> "$out/bench.err" ; tail -5 "$out/bench.err"; cat "$out/RESULTS.md" 2>/dev/null
      if [ -f .bench_base/benchmarks/bench.py ]; then
        echo "=== bench at $(cat .bench_base/REV) ($(date +%T))"; mkdir -p "$out/base"
        PYTHONPATH="$PWD/.bench_base/kernels:$PWD/.bench_base${PYTHONPATH:+:$PYTHONPATH}" \
          timeout "${BENCH_TIMEOUT:-300}" "$py" .bench_base/benchmarks/bench.py \
          ${BENCH_ARGS:---quick} --out "$out/base" 2> "$out/base/bench.err"
        tail -3 "$out/base/bench.err"
        "$py" benchmarks/compare.py "$out/base/RESULTS.md" "$out/RESULTS.md"
      fi ;;
    ptx)  # Triton JIT's PTX against jax_triton's, plain and causal, with the outputs compared
      for causal in "" --causal; do
        timeout "${PTX_TIMEOUT:-240}" "$py" benchmarks/ptx_compare.py ${PTX_ARGS:-} $causal 2>&1 \
          | tee -a "$out/ptx.log" | grep -v "^\s*$" | tail -8
      done ;;
    tune)
      timeout "${TUNE_TIMEOUT:-360}" "$py" benchmarks/tune.py ${TUNE_ARGS:-} --out "$out" \
        2> "$out/tune.err" | tee "$out/tune.log" | tail -30 ;;
    profile)  # ncu counters of each kernel of one fwd+bwd call (the last of PROFILE_ARGS' calls)
      timeout "${PROFILE_TIMEOUT:-240}" ncu --clock-control none --target-processes all \
        --kernel-name "regex:${PROFILE_KERNELS:-attention_(forward|backward)\$}" \
        --launch-skip "${PROFILE_SKIP:-6}" --launch-count "${PROFILE_COUNT:-3}" \
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
        --section SchedulerStats --section ComputeWorkloadAnalysis --section InstructionStats \
        --metrics "regex:^sm__inst_executed_pipe_.*avg.pct_of_peak_sustained_active\$,regex:^sm__pipe_.*cycles_active.avg.pct_of_peak_sustained_active\$" \
        "$py" benchmarks/kernel_profile.py ${PROFILE_ARGS:-} > "$out/profile.log" 2>&1
      grep -vE "^==PROF==|^\s*$|----" "$out/profile.log" | tail -n "${PROFILE_LINES:-400}" ;;
    examples)
      timeout "${EXAMPLES_TIMEOUT:-300}" "$py" benchmarks/step_time.py ${STEP_ARGS:-} --out "$out" 2>&1 \
        | tee "$out/examples.log" | tail -20 ;;
    *) "$py" $step ;;
  esac
done
