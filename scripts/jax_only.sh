#!/usr/bin/env bash
# fa_jax as a JAX user installs it: the package's [jax] extra (jax, jax-triton, triton) in a
# venv without PyTorch, then the tests that import no torch (tests/test_jax_only.py).
# FA_STACK picks the version set (scripts/stack.sh).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
source "$root/scripts/stack.sh"
venv="$root/.venv-jax$venv_suffix"
[ -x "$venv/bin/python" ] || "$(find_python)" -m venv "$venv"
"${pip_env[@]}" "$venv/bin/python" -m pip install -q -c "$constraints" setuptools wheel 2>&1 \
  | grep -v "^WARNING: Location\|^\[notice\]" >&2 || true
"${pip_env[@]}" "$venv/bin/python" -m pip install -q --no-build-isolation -c "$constraints" ".[jax]" pytest 2>&1 \
  | grep -v "^WARNING: Location\|^\[notice\]" >&2 || true
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "jax_only.sh: torch is installed in $venv: the [jax] extra must not pull it" >&2
  exit 1
fi
"$venv/bin/python" -c "import importlib.metadata as md; print('jax_only.sh:', *(f'{n} {md.version(n)}' for n in ('jax', 'jax-triton', 'triton')))"
FA_JAX_ONLY=1 OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_jax_only.py
