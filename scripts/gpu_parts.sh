#!/usr/bin/env bash
# A wheel larger than one device call carries (64 MiB) travels in parts over back-to-back
# calls on a warm machine. Here: split -b 55M WHEEL .parts/WHEEL.part. and write
# .parts/WHEEL.sha256 (sha256sum's first field). There, one call per part:
#   bash scripts/gpu_parts.sh put    # the parts this call carries -> /tmp/parts
#   bash scripts/gpu_parts.sh join   # every wheel whose parts are all there -> /tmp/wheels,
#                                    # checked against its sha256; gpu_session.sh installs them
set -euo pipefail
mkdir -p /tmp/parts /tmp/wheels
case "${1:-}" in
  put) cp -v .parts/*.part.* /tmp/parts/ ;;
  join)
    for sum in .parts/*.sha256; do
      wheel="$(basename "$sum" .sha256)"
      cat /tmp/parts/"$wheel".part.* > /tmp/wheels/"$wheel"
      if [ "$(sha256sum /tmp/wheels/"$wheel" | cut -d' ' -f1)" != "$(cat "$sum")" ]; then
        echo "gpu_parts.sh: $wheel does not match its sha256 (parts: $(ls /tmp/parts | tr '\n' ' '))" >&2
        rm -f /tmp/wheels/"$wheel"; exit 1
      fi
      echo "gpu_parts.sh: $wheel joined and checked"
    done ;;
  *) echo "usage: gpu_parts.sh put|join" >&2; exit 2 ;;
esac
