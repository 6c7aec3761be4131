#!/usr/bin/env bash
# fa_jax as a JAX user installs it: the package's [jax] extra (jax, jax-triton, triton) in a
# venv without PyTorch, then the tests that import no torch (tests/test_jax_only.py).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
venv="$root/.venv-jax"
[ -x "$venv/bin/python" ] || "$(command -v python3.11 || command -v python3)" -m venv "$venv"
"$venv/bin/python" -m pip install -q -c constraints-cpu.txt setuptools wheel 2>&1 \
  | grep -v "^WARNING: Location" >&2 || true
"$venv/bin/python" -m pip install -q --no-build-isolation -c constraints-cpu.txt ".[jax]" pytest 2>&1 \
  | grep -v "^WARNING: Location" >&2 || true
if "$venv/bin/python" -c "import torch" 2>/dev/null; then
  echo "jax_only.sh: torch is installed in $venv: the [jax] extra must not pull it" >&2
  exit 1
fi
FA_JAX_ONLY=1 OMP_NUM_THREADS=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_jax_only.py
