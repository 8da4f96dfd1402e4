#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, sanitizers, Python package, benchmark.
# Usage: bash scripts/gpu_run.sh [build] [test] [sanitize] [python] [bench] [recipes] [quickbench]
# Results land in $OUT (at most 8 files come back): logs, JSON and Markdown.
# recipes (not a default stage; needs the python stage's package): every preset's whole-call
# speed at d 64/128, N 1K/4K/16K, non-causal fp16 -> $OUT/h100_recipes.json, the file
# docs/recipes.md's speed table reads (copy it to bench/results/, then bash scripts/gen_docs.sh).
set -u -o pipefail
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
stages=${*:-build test sanitize python bench}
has() { [[ " $stages " == *" $1 "* ]]; }
log() { echo "== $(date +%T) $*"; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee "$OUT/device.txt"
BUILD=build-gpu-run
if has build; then
  log build
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DSAGE_GTEST_SOURCE_DIR=$PWD/.deps/googletest \
    > "$OUT/build.log" 2>&1 && ninja -C $BUILD -j16 >> "$OUT/build.log" 2>&1 || { tail -50 "$OUT/build.log"; exit 1; }
  tail -2 "$OUT/build.log"
fi
if has test; then
  log gpu tests
  (cd $BUILD && timeout 900 ./tests/sage_tests_gpu 2>&1) > "$OUT/gpu_tests.log"
  grep -E "^\[  (PASSED|FAILED)|FAILED|tests ran" "$OUT/gpu_tests.log" | tail -20
  grep -E "^\[metrics\]" "$OUT/gpu_tests.log" | awk '{print}' | sort -t'|' -k2 | tail -3
fi
if has sanitize; then
  log compute-sanitizer
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 $BUILD/tests/sage_tests_gpu \
      --gtest_filter='Sm90Sanitize.*:Sm90TwoStep.*' \
      > "$OUT/sanitize_$tool.log" 2>&1
    echo "$tool exit $? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done
fi
if has python; then
  log python package
  bash scripts/python_gpu_install.sh > "$OUT/python.log" 2>&1; echo "install exit $?"
  PYTHONUNBUFFERED=1 timeout 600 python3 -m pytest -q tests/python >> "$OUT/python.log" 2>&1; echo "pytest exit $?"
  tail -5 "$OUT/python.log"
fi
if has bench; then
  log bench
  PYTHONUNBUFFERED=1 timeout 540 python3 bench/bench_sdpa.py --iters 10 --warmup 3 \
    --json "$OUT/h100.json" --markdown "$OUT/h100.md" 2>&1 | tail -30
fi
if has recipes; then
  log "recipe speeds (sagekit alone, whole call, every preset)"
  # Only the JSON goes to $OUT (the table is printed): the 8-file limit of what comes back.
  PYTHONUNBUFFERED=1 timeout 400 python3 bench/bench_sdpa.py --recipes all --dims 64,128 \
    --ns 1024,4096,16384 --causal 0 --dtypes float16 --iters 10 --warmup 3 \
    --json "$OUT/h100_recipes.json" --markdown /dev/null 2>&1 | tail -40
fi
if has clibench; then
  log "C++ bench (sage bench, this library only)"
  timeout 300 $BUILD/cli/sage bench --d 64,128 --n 1024,4096,16384 --iters 10 --json "$OUT/clibench.json" 2>&1 | tail -20
  log "torch SDPA alone (same grid)"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/sdpa_only.py 2>&1 | tail -20
fi
if has quickbench; then
  log quick bench
  PYTHONUNBUFFERED=1 python3 bench/bench_sdpa.py --dims 64,128 --ns 1024,4096,16384 --causal 0,1 \
    --json "$OUT/h100.json" --markdown "$OUT/h100.md" 2>&1 | tail -30
fi
