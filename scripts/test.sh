#!/usr/bin/env bash
# The test command (README.md, and what CI runs): installs what is missing, builds, runs every
# C++ test with ctest and, when the Python package exists, its pytest suite.
#
#   bash scripts/test.sh
#
# GPU tests are built and run everywhere; without an sm_90 GPU they report themselves as
# skipped. SAGE_CUDA=ON|OFF in the environment overrides the nvcc-based choice.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

say() { printf '\n== %s\n' "$*"; }
jobs=$(nproc 2>/dev/null || echo 2)
start=$(date +%s)

# ---- dependencies -------------------------------------------------------------------------
missing=()
command -v cmake >/dev/null || missing+=(cmake)
command -v ninja >/dev/null || missing+=(ninja-build)
command -v g++ >/dev/null || missing+=(g++)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/src/googletest/CMakeLists.txt ] &&
   [ ! -f .deps/googletest/CMakeLists.txt ]; then
  missing+=(libgtest-dev)
fi
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  sudo=""
  [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
fi

# ---- configure and build ------------------------------------------------------------------
if [ -z "${SAGE_CUDA:-}" ]; then
  if command -v nvcc >/dev/null; then SAGE_CUDA=ON; else SAGE_CUDA=OFF; fi
fi
build=build
# One build folder for everything: the tests, the CLI and the Python extension. `pip install`
# below reuses it (scikit-build-core's build-dir, the same options through CMAKE_ARGS), so it
# finds every object already built and compiles no CUDA kernel a second time (issue 32: CI
# used to build the whole library twice, once here and once in pip's own build folder).
opts=(-DSAGE_CUDA="$SAGE_CUDA" -DSAGE_BUILD_TESTS=ON -DSAGE_BUILD_CLI=ON)
python_pkg=0
if [ -f pyproject.toml ]; then
  python_pkg=1
  say "python: the build requirements of pyproject.toml (scikit-build-core, nanobind)"
  python3 -m pip --version >/dev/null 2>&1 || python3 -m ensurepip --upgrade
  # The pip install below runs without build isolation (a temporary environment would be a
  # new scikit-build-core, which discards the build folder's cache), so pyproject.toml's
  # [build-system] requires go into this Python, read from there so the pins live in one place.
  mapfile -t build_requires < <(python3 - <<'PY'
import re
text = open("pyproject.toml", encoding="utf-8").read()
block = re.search(r"^\[build-system\]\s*^requires\s*=\s*\[(.*?)\]", text, re.M | re.S)
print("\n".join(re.findall(r'"([^"]+)"', block.group(1))))
PY
  )
  python3 -m pip install --quiet "${build_requires[@]}"
  opts+=(-DSAGE_BUILD_PYTHON=ON)
  # The interpreter pip builds with (scikit-build-core sets the same), so that the configure
  # here and pip's agree and the extension is not rebuilt for another Python.
  python_exe=$(python3 -c 'import sys; print(sys.executable)')
fi
say "configure ($build/, SAGE_CUDA=$SAGE_CUDA)"
cmake -S . -B "$build" -G Ninja "${opts[@]}" ${python_exe:+-DPython_EXECUTABLE="$python_exe"}
say "build (-j$jobs)"
cmake --build "$build" -j "$jobs"

# ---- C++ tests ----------------------------------------------------------------------------
say "ctest"
# A C++ failure does not stop the Python tests: one run reports everything that is broken.
ctest_rc=0
ctest --test-dir "$build" --output-on-failure -j "$jobs" || ctest_rc=$?

# ---- the sage command ---------------------------------------------------------------------
say "sage command (smoke)"
sage="$build/cli/sage"
cli_fail=0
# expect STATUS PATTERN -- CMD...: runs CMD, checks its exit status and that its output
# (stdout and stderr) contains PATTERN.
expect() {
  local want=$1 pattern=$2 out rc=0
  shift 3
  out=$("$@" 2>&1) || rc=$?
  if [ "$rc" -eq "$want" ] && grep -qF -- "$pattern" <<<"$out"; then
    echo "ok    ${*#"$build/cli/"}"
  else
    echo "FAIL  ${*#"$build/cli/"} (exit $rc, wanted $want and '$pattern'):"
    printf '%s\n' "$out" | tail -n 20
    cli_fail=1
  fi
}
tmp_json=$(mktemp)
expect 0 "sage2_8b (default)" -- "$sage" recipes
expect 0 "int_flash" -- "$sage" check --device cpu --recipe sage2_8b,int_flash --dist normal --n 256 --json "$tmp_json"
expect 0 '"compared": "simulate_vs_exact"' -- cat "$tmp_json"
expect 0 "sagebwd_block dp_format=int8  normal" -- "$sage" check --backward --dp-format int8 --dist normal --n 128
expect 2 "--backward runs on the CPU" -- "$sage" check --backward --device gpu
expect 2 "--n must be an integer" -- "$sage" check --n 0
expect 2 "unknown flag '--frob'" -- "$sage" check --frob
expect 2 "sage: q: head_dim" -- "$sage" check --d 1000 --recipe sage2_8b --dist normal
expect 0 "causal, window (64, 0)" -- "$sage" check --device cpu --recipe sage2_8b --dist normal --n 256 --causal --window 64,0
expect 2 "--window needs two values" -- "$sage" check --window 64
if ! "$sage" check --device gpu --recipe sage2_8b --dist normal --n 128 >/dev/null 2>&1; then
  expect 2 "nothing was timed" -- "$sage" bench
  expect 2 "--device gpu needs" -- "$sage" check --device gpu
fi
rm -f "$tmp_json"
# The README's recipe table is generated; a preset change must come with a regenerated one.
readme_table=$(sed -n '/^<!-- recipes:begin -->$/,/^<!-- recipes:end -->$/p' README.md | sed '1d;$d')
if [ "$readme_table" != "$("$sage" recipes --markdown)" ]; then
  echo "FAIL  README.md's recipe table differs from 'sage recipes --markdown': run bash scripts/gen_docs.sh"
  cli_fail=1
else
  echo "ok    README.md's recipe table matches 'sage recipes --markdown'"
fi

# ---- Python package -----------------------------------------------------------------------
if [ $python_pkg -eq 1 ]; then
  say "python: pip install ./ (reusing $build/) and pytest tests/python"
  # The [test] extra brings pytest and numpy. The wheel is built in $build/ with this script's
  # CMake options, SAGE_CUDA included (CMAKE_ARGS wins over pyproject.toml's defines, which
  # turn the tests and the CLI off), so CMake's cache stays as it is and ninja finds the
  # library, the extension and the tests built above.
  stamp=$(mktemp)
  CMAKE_ARGS="${opts[*]}" CMAKE_GENERATOR=Ninja \
    python3 -m pip install --quiet --no-build-isolation --config-settings=build-dir="$PWD/$build" './[test]'
  # A kernel compiled again here means that pip's configure differed from the one above.
  rebuilt=$(find "$build" -name '*.cu.o' -newer "$stamp" | wc -l)
  rm -f "$stamp"
  if [ "$rebuilt" -ne 0 ]; then
    echo "scripts/test.sh: warning: pip install compiled $rebuilt CUDA objects again in $build/"
  fi
  pytest_rc=0
  python3 -m pytest tests/python || pytest_rc=$?
  if [ $pytest_rc -eq 5 ]; then
    # pytest says 5 when it collected nothing: a suite that ran nothing has not passed.
    echo "scripts/test.sh: pytest collected no tests in tests/python (exit 5); that is a failure"
  elif [ $pytest_rc -ne 0 ]; then
    echo "scripts/test.sh: pytest failed (exit $pytest_rc)"
  fi
else
  say "python: no pyproject.toml, so no Python package to test"
  pytest_rc=0
fi

elapsed=$(( $(date +%s) - start ))
if [ $ctest_rc -ne 0 ] || [ $cli_fail -ne 0 ] || [ $pytest_rc -ne 0 ]; then
  say "FAILED after $elapsed s (ctest exit $ctest_rc, sage command checks $([ $cli_fail -eq 0 ] && echo passed || echo failed), pytest exit $pytest_rc)"
  exit 1
fi
say "all tests passed in $elapsed s"
