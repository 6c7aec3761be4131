#!/usr/bin/env bash
# Prints the path of a Python that has everything the project needs, installing what
# is missing from the repo's own files. Logs go to stderr; only the path to stdout.
#   1. $FA_PYTHON if set;
#   2. python3 as it is, when it already satisfies the supported ranges (the GPU machine,
#      which has no network: torch, triton and jax come with its image);
#   3. otherwise a venv for the version set FA_STACK names (scripts/stack.sh), installed
#      from its constraints file: .venv for oldest (what CI runs), .venv-newest for newest.
# Either way the project itself is installed editable (fa_kernels lives in kernels/fa_kernels/).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"

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

source "$root/scripts/stack.sh"
venv="$root/.venv$venv_suffix"

if [ -n "${FA_PYTHON:-}" ]; then
  py="$FA_PYTHON"
elif [ -z "${FA_STACK:-}" ] && command -v python3 >/dev/null && satisfied python3; then
  py="$(command -v python3)"
else
  py="$venv/bin/python"
  if [ ! -x "$py" ] || ! satisfied "$py"; then
    echo "env.sh: creating $(basename "$venv") (Python $python_version) and installing $constraints;" \
         "pip's progress follows (a few minutes the first time)" >&2
    [ -x "$py" ] || "$(find_python)" -m venv "$venv" >&2
    # torch alone first (its dependencies come with the rest, under the constraints)
    if [ -n "$cpu_torch" ] && ! "${pip_env[@]}" "$py" -m pip install -q --no-deps "$cpu_torch" 2>/dev/null; then
      echo "env.sh: no $cpu_torch on this machine's indexes; installing it from PyTorch's CPU index" >&2
      "${pip_env[@]}" "$py" -m pip install -q --no-deps \
        --extra-index-url https://download.pytorch.org/whl/cpu "$cpu_torch" >&2
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
