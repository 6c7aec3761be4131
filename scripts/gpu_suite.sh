#!/usr/bin/env bash
# The whole tests/ folder on the lent GPU in two calls of under 10 minutes each (a call's
# limit), on the same warm machine (carry .whl where the image lacks jax-triton):
#   bash scripts/gpu_suite.sh 1        the kernels' own tests: both front ends, every feature
#   bash scripts/gpu_suite.sh 2        every other file (clients, parity, host-side checks,
#                                      offline compiles first: they are the longest)
# Workers, logs and the summary as scripts/gpu_session.sh's test step.
set -uo pipefail
part="${1:?usage: scripts/gpu_suite.sh 1|2}"
cd "$(dirname "$0")/.."
first="tests/test_attention.py tests/test_features.py tests/test_varlen.py tests/test_torch.py
       tests/test_jax.py tests/test_decode.py tests/test_kvcache.py tests/test_paged.py
       tests/test_seqused.py tests/test_gpu.py tests/test_masks.py tests/test_apart.py"
case "$part" in
  1) files="$first" ;;
  2) files="tests/test_compile.py"  # then the rest, so a new test file is never left out
     for f in tests/test_*.py; do
       case " $(echo $first) tests/test_compile.py " in *" $f "*) ;; *) files="$files $f" ;; esac
     done ;;
  *) echo "part must be 1 or 2, got $part" >&2; exit 2 ;;
esac
echo "part $part: $(echo $files | wc -w) files"
TEST_TIMEOUT="${TEST_TIMEOUT:-570}" TEST_ARGS="$(echo $files)" bash scripts/gpu_session.sh test
