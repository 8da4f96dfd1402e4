#!/usr/bin/env bash
# Spills and registers of the Hopper attention kernels without a GPU: recompiles the generated
# instantiations of a configured build dir with -Xptxas -v, one line per kernel. The register
# count ptxas prints is the launch cap (384 threads: 168); the consumer path runs under the
# setmaxnreg budget (240), so the line to watch is the spill count.
# Usage: bash scripts/ptxas_report.sh [BUILD_DIR] [NAME_FILTER]  (NAME_FILTER: a piece of the
#   instantiation name after "_d", e.g. "128_half" for both passes at d = 128, fp16)
#   e.g. bash scripts/ptxas_report.sh build-lead 128_half_e4m3
set -eu -o pipefail
BUILD=${1:-build}
FILTER=${2:-}
cd "$BUILD"
# Forward instantiations (generated/sm90/fwd/attention_d*) and the SageBwd backward's
# (generated/sm90/bwd/backward_d*: its pre-pass, kernel and finalize, one line each). The
# depfile goes to a scratch file so that the build's own stays as ninja wrote it.
ninja -t commands src/libsage.a |
  grep -v " qc " | grep -E "generated/sm90/(fwd/attention|bwd/backward)_d[^ ]*${FILTER}[^ ]*\.cu" |
  while read -r cmd; do
    name=$(grep -oE "(attention|backward)_d[^ /]*\.cu" <<< "$cmd" | head -1)
    cmd=$(sed -E 's/-MF [^ ]+/-MF \/dev\/null/' <<< "$cmd")
    # The same command with ptxas verbosity and the object thrown away (the last -o wins).
    out=$(eval "$cmd -Xptxas -v -o /dev/null" 2>&1)
    for kernel in attention_kernel backward_prep_kernel backward_kernel backward_finalize_kernel; do
      info=$(grep -A3 "Compiling entry.*${kernel}I" <<< "$out" | grep -E "spill|Used" | tr -s ' ' |
        paste -sd';' || true)
      if [ -n "$info" ]; then echo "${name%.cu} ${kernel}:${info}"; fi
    done
  done
