#!/usr/bin/env bash
# Regenerates the generated documentation: docs/recipes.md (`sage docs`) and the recipe table
# in README.md between <!-- recipes:begin --> and <!-- recipes:end --> (`sage recipes
# --markdown`). Builds the `sage` command first if needed.
#
#   bash scripts/gen_docs.sh [RESULTS.json ...]
#
# The speed table of docs/recipes.md is read from bench result files, later ones winning
# (default: `sage docs`'s own, cli/docs.cpp kDefaultBench: a side-by-side run of
# scripts/gpu_run.sh's bench stage, then an every-preset run of its recipes stage). Copy a run's
# files from $OUT into bench/results/ first, so that the page cites files of the repository;
# a file that does not exist makes its cells say "not measured", never a made-up number.
#
# Uses build/ when it is configured (by main.sh or test.sh); otherwise configures a CPU-only
# build in build-docs/, since the documentation needs no GPU code.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
jobs=$(nproc 2>/dev/null || echo 2)

if [ -f build/CMakeCache.txt ]; then
  build=build
else
  build=build-docs
  [ -f "$build/CMakeCache.txt" ] ||
    cmake -S . -B "$build" -G Ninja -DSAGE_CUDA=OFF -DSAGE_BUILD_TESTS=OFF -DSAGE_BUILD_CLI=ON
fi
cmake --build "$build" -j "$jobs" --target sage_cli
sage="$build/cli/sage"

# Without arguments, `sage docs`'s default files (cli/docs.cpp kDefaultBench: the H100 grid of
# record and the H100 every-preset run, both in bench/results/).
if [ $# -gt 0 ]; then
  "$sage" docs --out docs/recipes.md --bench "$(IFS=,; echo "$*")"
else
  "$sage" docs --out docs/recipes.md
fi

table=$(mktemp)
trap 'rm -f "$table" "$table.readme"' EXIT
"$sage" recipes --markdown >"$table"
begin='<!-- recipes:begin -->'
end='<!-- recipes:end -->'
if [ "$(grep -cxF "$begin" README.md)" != 1 ] || [ "$(grep -cxF "$end" README.md)" != 1 ]; then
  echo "scripts/gen_docs.sh: README.md needs exactly one '$begin' line and one '$end' line" >&2
  exit 1
fi
awk -v begin="$begin" -v end="$end" -v table="$table" '
  $0 == begin { print; while ((getline line < table) > 0) print line; skip = 1; next }
  $0 == end { skip = 0 }
  !skip { print }
' README.md >"$table.readme"
mv "$table.readme" README.md
echo "updated README.md (recipe table) and docs/recipes.md"
