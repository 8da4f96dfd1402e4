#!/usr/bin/env bash
# The main job (README.md): build the library and the `sage` command, then measure.
#
#   bash scripts/main.sh
#
# With an sm_90 GPU (and nvcc to build the kernels): `sage bench` over the benchmark grid and
# `sage check --device gpu` (GPU vs simulate and vs exact). Without one: `sage check
# --device cpu`, the simulator's error of every preset on every synthetic distribution.
# Results are written to out/ as JSON beside the tables printed here.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '\n== %s\n' "$*"; }
jobs=$(nproc 2>/dev/null || echo 2)

if [ -z "${SAGE_CUDA:-}" ]; then
  if command -v nvcc >/dev/null; then SAGE_CUDA=ON; else SAGE_CUDA=OFF; fi
fi
build=build
say "configure ($build/, SAGE_CUDA=$SAGE_CUDA)"
# build/ is shared with test.sh, which turns the Python extension on there; this job needs
# only the CLI, so it does not depend on nanobind (toggling it recompiles nothing).
cmake -S . -B "$build" -G Ninja -DSAGE_CUDA="$SAGE_CUDA" -DSAGE_BUILD_TESTS=OFF -DSAGE_BUILD_CLI=ON \
  -DSAGE_BUILD_PYTHON=OFF
say "build (-j$jobs)"
cmake --build "$build" -j "$jobs" --target sage_cli
sage="$build/cli/sage"
mkdir -p out

# A GPU counts when nvidia-smi runs and reports compute capability 9.0 (Hopper).
gpu=""
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
  gpu=$(nvidia-smi --query-gpu=name,compute_cap --format=csv,noheader 2>/dev/null | head -n1 || true)
fi
cc=${gpu##*, }

if [ -n "$gpu" ] && [ "$cc" = "9.0" ] && [ "$SAGE_CUDA" = "ON" ]; then
  say "GPU: $gpu"
  say "sage bench (whole call, fp16, d 64/128, causal no/yes, N 1K..32K)"
  "$sage" bench --json out/bench.json
  say "sage check --device gpu (GPU vs simulate, GPU vs exact)"
  "$sage" check --device gpu --json out/check-gpu.json
  say "done: out/bench.json, out/check-gpu.json"
  exit 0
fi

if [ -n "$gpu" ] && [ "$cc" = "9.0" ]; then
  say "a GPU is visible ($gpu) but this build has no CUDA kernels (no nvcc found)"
elif [ -n "$gpu" ]; then
  say "no GPU of compute capability 9.0 found (visible: $gpu); the kernels need Hopper"
else
  say "no GPU found (nvidia-smi is missing or does not run)"
fi
echo "Nothing is timed. Instead: the CPU simulator's report, every preset on every synthetic"
echo "distribution, simulate (the recipe's exact numerics) against float64 exact attention."
say "sage check --device cpu"
"$sage" check --device cpu --json out/check-cpu.json
say "done: out/check-cpu.json (no GPU, so no speed was measured)"
