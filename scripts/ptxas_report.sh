#!/usr/bin/env bash
# Spills and registers of the Hopper attention kernels without a GPU: recompiles the generated
# instantiations of a configured build dir with -Xptxas -v, one line per kernel. The register
# count ptxas prints is the launch cap (384 threads: 168); the consumer path runs under the
# setmaxnreg budget (240), so the line to watch is the spill count.
# Usage: bash scripts/ptxas_report.sh [BUILD_DIR] [NAME_FILTER]
#   e.g. bash scripts/ptxas_report.sh build-lead d128_half_e4m3
set -eu -o pipefail
BUILD=${1:-build}
FILTER=${2:-}
cd "$BUILD"
ninja -t commands src/libsage.a | grep -E "generated/sm90/(fwd/)?attention_d[^ ]*${FILTER}[^ ]*\.cu" |
  while read -r cmd; do
    name=$(grep -oE "attention_d[^ /]*\.cu" <<< "$cmd" | head -1)
    # The same command with ptxas verbosity and the object thrown away (the last -o wins).
    info=$(eval "$cmd -Xptxas -v -o /dev/null" 2>&1 |
      grep -A3 "Compiling entry.*attention_kernel" | grep -E "spill|Used" | tr -s ' ' | paste -sd';')
    echo "${name%.cu}:${info}"
  done
