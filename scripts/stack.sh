# Sourced by env.sh and jax_only.sh: the version set FA_STACK names (default oldest).
#   oldest  Python 3.11, constraints-oldest.txt (triton 3.6, jax 0.10, jax-triton 0.3.1,
#           torch 2.13.0 CPU build)
#   newest  Python 3.12, constraints-newest.txt (triton 3.9, jax 0.12, jax-triton 0.4.1,
#           torch 2.15.0 from PyPI)
# Sets stack, python_version, constraints, venv_suffix, pip_env (a command prefix) and
# cpu_torch (a torch build plain PyPI does not serve, installed first; empty for none).
stack="${FA_STACK:-oldest}"
case "$stack" in
  oldest) python_version=3.11; constraints=constraints-oldest.txt; venv_suffix=""; pip_env=()
          # PyPI's torch 2.13.0 is the CUDA build, which pins triton 3.7.1: the CPU build
          # (no Triton pin) comes from the machine's wheels, else from PyTorch's own index.
          cpu_torch="torch==2.13.0+cpu" ;;
  newest) python_version=3.12; constraints=constraints-newest.txt; venv_suffix="-newest"
          # Machines here cap torch at the release on their disk (/etc/xdg/pip); this set
          # is plain PyPI's, so pip reads no machine-wide config for it.
          pip_env=(env PIP_CONFIG_FILE=/dev/null); cpu_torch="" ;;
  *) echo "FA_STACK is '$stack'; expected oldest or newest" >&2; exit 1 ;;
esac

# Prints a Python $python_version that runs: on PATH, else pyenv's (a pyenv shim is on PATH
# also for versions it will not run, so each candidate is tried).
find_python() {
  local candidate
  for candidate in "$(command -v "python$python_version" 2>/dev/null)" \
      $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$python_version".*/bin/python"$python_version" 2>/dev/null); do
    [ -n "$candidate" ] && "$candidate" -c "" 2>/dev/null && echo "$candidate" && return
  done
  echo "no Python $python_version found (on PATH or in pyenv) for FA_STACK=$stack" >&2
  return 1
}
