#!/usr/bin/env bash
# Prints the path of a Python that has everything the project needs, installing what
# is missing from the repo's own files. Logs go to stderr; only the path to stdout.
#   1. $FA_PYTHON if set;
#   2. python3 as it is, when it already satisfies the supported ranges (the GPU machine,
#      which has no network: torch, triton and jax come with its image);
#   3. otherwise a venv for the version set FA_STACK names, installed from its
#      constraints file (what CI runs, one job per set):
#        oldest  .venv         Python 3.11, constraints-oldest.txt (triton 3.6, jax 0.10,
#                              jax-triton 0.3.1, torch 2.13.0 CPU build)
#        newest  .venv-newest  Python 3.12, constraints-newest.txt (triton 3.9, jax 0.12,
#                              jax-triton 0.4.1, torch 2.15.0 from PyPI)
# Either way the project itself is installed editable (fa_kernels lives in kernels/fa_kernels/).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
stack="${FA_STACK:-oldest}"

satisfied() {
  "$1" - <<'PY' 2>/dev/null
import importlib.metadata as md, sys

def version(name):
    return tuple(int(x) for x in md.version(name).split("+")[0].split(".")[:2])

# The supported ranges (pyproject.toml says the same).
ranges = {"torch": ((2, 11), (2, 16)), "triton": ((3, 6), (3, 10)), "jax": ((0, 10), (0, 13)),
          "jaxlib": ((0, 10), (0, 13)), "jax-triton": ((0, 3), (0, 5)),
          "numpy": ((1, 26), (9, 0)), "pytest": ((8, 0), (99, 0)),
          "pytest-xdist": ((3, 0), (99, 0)), "hypothesis": ((6, 0), (99, 0)), "flax": ((0, 10), (9, 0))}
for name, (low, high) in ranges.items():
    if not low <= version(name) < high:
        sys.exit(1)
PY
}

install_project() {
  if ! "$1" -c "import fa_kernels, fa_torch, fa_jax" >/dev/null 2>&1 \
     || [ "$("$1" -c 'import fa_kernels, os; print(os.path.dirname(fa_kernels.__file__))' 2>/dev/null)" != "$root/kernels/fa_kernels" ]; then
    echo "env.sh: installing the project (editable) into $1" >&2
    "$1" -m pip install -q --no-build-isolation --no-deps -e "$root" >&2
  fi
}

# A Python of the given minor version: on PATH, else pyenv's.
find_python() {
  local candidate
  # (a pyenv shim is on PATH for versions it will not run: try each candidate)
  for candidate in "$(command -v "python$1" 2>/dev/null)" \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/python"$1" 2>/dev/null); do
    [ -n "$candidate" ] && "$candidate" -c "" 2>/dev/null && echo "$candidate" && return
  done
  echo "env.sh: no Python $1 found (on PATH or in pyenv) for FA_STACK=$stack" >&2
  return 1
}

case "$stack" in
  oldest) venv="$root/.venv"; python_version=3.11; constraints=constraints-oldest.txt ;;
  newest) venv="$root/.venv-newest"; python_version=3.12; constraints=constraints-newest.txt ;;
  *) echo "env.sh: FA_STACK is '$stack'; expected oldest or newest" >&2; exit 1 ;;
esac

if [ -n "${FA_PYTHON:-}" ]; then
  py="$FA_PYTHON"
elif [ -z "${FA_STACK:-}" ] && command -v python3 >/dev/null && satisfied python3; then
  py="$(command -v python3)"
else
  py="$venv/bin/python"
  if [ ! -x "$py" ] || ! satisfied "$py"; then
    echo "env.sh: creating $(basename "$venv") (Python $python_version) and installing $constraints;" \
         "pip's progress follows (a few minutes the first time)" >&2
    [ -x "$py" ] || "$(find_python "$python_version")" -m venv "$venv" >&2
    pip_env=()
    if [ "$stack" = newest ]; then
      # Machines here cap torch at the release on their disk (/etc/xdg/pip); this set is
      # plain PyPI's, so pip reads no machine-wide config for it.
      pip_env=(env PIP_CONFIG_FILE=/dev/null)
    fi
    "${pip_env[@]}" "$py" -m pip install --progress-bar off -c "$constraints" setuptools wheel \
      torch triton jax jaxlib jax-triton flatbuffers numpy pytest pytest-xdist hypothesis flax optax \
      transformers matplotlib tqdm 2>&1 \
      | grep -E "^(Collecting|Installing|Successfully|ERROR)" | cut -c1-120 >&2 || true
    satisfied "$py" || { echo "env.sh: the install did not give the required packages" >&2; exit 1; }
  fi
fi
install_project "$py"
echo "$py"
