#!/usr/bin/env bash
# fa_jax as a JAX user installs it: the package's [jax] extra (jax, jax-triton, triton) in a
# venv without PyTorch, then the tests that import no torch (tests/test_jax_only.py).
# FA_STACK picks the version set as in scripts/env.sh (oldest: Python 3.11, newest: 3.12).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
case "${FA_STACK:-oldest}" in
  oldest|"") venv="$root/.venv-jax"; python_version=3.11; constraints=constraints-oldest.txt; pip_env=() ;;
  newest) venv="$root/.venv-jax-newest"; python_version=3.12; constraints=constraints-newest.txt
          pip_env=(env PIP_CONFIG_FILE=/dev/null) ;;
  *) echo "jax_only.sh: FA_STACK is '$FA_STACK'; expected oldest or newest" >&2; exit 1 ;;
esac
if [ ! -x "$venv/bin/python" ]; then
  base=""
  for candidate in "$(command -v "python$python_version" 2>/dev/null)" \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$python_version".*/bin/python"$python_version" 2>/dev/null); do
    [ -n "$candidate" ] && "$candidate" -c "" 2>/dev/null && base="$candidate" && break
  done
  [ -n "$base" ] || { echo "jax_only.sh: no Python $python_version found" >&2; exit 1; }
  "$base" -m venv "$venv"
fi
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
