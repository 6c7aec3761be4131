#!/usr/bin/env bash
# flash-attn's own tests/test_flash_attn.py through fa_torch's flash-attn names:
#   bash scripts/flash_attn_tests.sh PATH/TO/test_flash_attn.py [pytest arguments...]
# The file is not part of this repo (get it from flash-attn's sources). scripts/
# flash_attn_shim stands in for the `flash_attn` package. Without a CUDA GPU the file is
# copied with its "cuda" devices and capability queries turned to the CPU (Triton's
# interpreter: pick small cases with -k). Needs einops (`pip install einops`).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
file="$1"; shift
py="${PYTHON:-$("$here/env.sh")}"
case "$py" in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac
"$py" -c "import einops" 2>/dev/null || { echo "flash_attn_tests.sh: pip install einops" >&2; exit 2; }
work="$(mktemp -d)"
if "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  cp "$file" "$work/test_flash_attn.py"
else
  sed -e 's/device = "cuda"/device = "cpu"/' -e 's/device="cuda"/device="cpu"/g' \
      -e 's/^is_sm75 = .*/is_sm75 = False/' -e 's/^is_sm8x = .*/is_sm8x = False/' \
      -e 's/^is_sm80 = .*/is_sm80 = False/' -e 's/^is_sm90 = .*/is_sm90 = True/' \
      -e 's/torch.cuda.get_device_properties("cuda").total_memory/(80 * 2**30)/' \
      "$file" > "$work/test_flash_attn.py"
fi
cd "$work"
PYTHONPATH="$here/flash_attn_shim${PYTHONPATH:+:$PYTHONPATH}" "$py" -m pytest -p no:cacheprovider \
  test_flash_attn.py "$@"
