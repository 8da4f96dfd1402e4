#!/usr/bin/env bash
# The host code under AddressSanitizer and UndefinedBehaviorSanitizer (no GPU needed): a CPU
# build of the library, CLI and tests with -fsanitize=address,undefined, then the CPU tests,
# the GPU test binary (its host-side list checks; the GPU cases skip) and a few CLI commands
# on the simulator. Any report stops it with a non-zero status. ~5 min to build and ~10 min to
# run on 2 cores, so CI (scripts/test.sh) does not run it; run it after host-side changes.
#
#   bash scripts/host_sanitize.sh            # build folder build-host-sanitize
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
build=${BUILD:-build-host-sanitize}
flags="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined"

cmake -S . -B "$build" -G Ninja -DSAGE_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DSAGE_BUILD_TESTS=ON -DSAGE_BUILD_CLI=ON -DSAGE_BUILD_PYTHON=OFF \
  -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" > /dev/null
ninja -C "$build" -j"$(nproc 2>/dev/null || echo 2)"

export ASAN_OPTIONS=detect_leaks=1:halt_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
run() { echo "== $*"; "$@" > "$build/last_run.log" 2>&1 || { tail -40 "$build/last_run.log"; exit 1; }; }
run "$build/tests/sage_tests_cpu"
run "$build/tests/sage_tests_gpu"
run "$build/cli/sage" check --device cpu --n 256 --heads 2
run "$build/cli/sage" check --device cpu --n 200 --d 192 --dv 128 --heads 2 --causal
run "$build/cli/sage" check --device cpu --n 300 --window 37,5 --heads 2
run "$build/cli/sage" check --device cpu --backward --n 128 --heads 2 --d 64
run "$build/cli/sage" docs --out "$build/recipes.md"
echo "host sanitizers: clean"
