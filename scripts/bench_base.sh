#!/usr/bin/env bash
# Put the tree of another commit in .bench_base (git-ignored), so that one GPU call times
# it beside the working tree: `bash scripts/gpu_session.sh bench` then runs the same
# benchmark on both, in one call on one machine, and prints their ratio
# (benchmarks/compare.py). Carry .bench_base with the call (run's `carry`).
#   bash scripts/bench_base.sh REV        e.g. the commit RESULTS.md's table was made at
set -euo pipefail
rev="${1:?usage: scripts/bench_base.sh REV}"
root="$(cd "$(dirname "$0")/.." && pwd)"
rm -rf "$root/.bench_base" && mkdir "$root/.bench_base"
git -C "$root" archive "$rev" -- kernels fa_torch fa_jax benchmarks | tar -x -C "$root/.bench_base"
rm -f "$root"/.bench_base/benchmarks/*.png
# Before the package had a folder of its own, kernels/ itself was fa_kernels (through the
# install's package-dir): give it that folder, so that .bench_base/kernels on the path
# imports it.
if [ ! -d "$root/.bench_base/kernels/fa_kernels" ]; then
  mv "$root/.bench_base/kernels" "$root/.bench_base/fa_kernels"
  mkdir "$root/.bench_base/kernels" && mv "$root/.bench_base/fa_kernels" "$root/.bench_base/kernels/"
fi
git -C "$root" rev-parse --short "$rev" > "$root/.bench_base/REV"
du -sh "$root/.bench_base"
