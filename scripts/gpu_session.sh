#!/usr/bin/env bash
# One call on the lent H200: carry .whl (jax-triton, which the image lacks), then
#   bash scripts/gpu_session.sh [test|bench|memcheck|all] ...
# Logs go to $OUT when it is set. The bench table prints last.
set -uo pipefail
out="${OUT:-/tmp/fa_out}"; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv,noheader
python3 -c "import torch, triton, jax, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'jax', jax.__version__, 'numpy', numpy.__version__, jax.devices())"
py="$(./scripts/env.sh)" || exit 1
for step in "$@"; do
  case "$step" in
    test)
      timeout "${TEST_TIMEOUT:-420}" "$py" -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider ${TEST_ARGS:-tests} \
        2>&1 | tee "$out/test.log" | grep -v "^\.*$" | tail -40 ;;
    memcheck)
      timeout "${MEMCHECK_TIMEOUT:-240}" compute-sanitizer --tool memcheck --print-limit 20 \
        "$py" -m pytest -q -p no:cacheprovider tests/test_attention.py tests/test_features.py -k "torch and (test_gqa or 113x70 or (head_dims and bfloat16 and True) or combined or (window and 64x130))" \
        2>&1 | tee "$out/memcheck.log" | tail -15 ;;
    bench)
      timeout "${BENCH_TIMEOUT:-300}" "$py" benchmarks/bench.py ${BENCH_ARGS:---quick} --out "$out" \
        2> "$out/bench.err" ; tail -5 "$out/bench.err"; cat "$out/RESULTS.md" 2>/dev/null ;;
    *) "$py" "$step" ;;
  esac
done
