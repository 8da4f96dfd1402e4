#!/usr/bin/env bash
# Installs the sequence-parallel engines sagekit.distributed plugs into (docs/distributed.md),
# offline, from wheels downloaded beforehand into .whl/ (git-ignored), on the GPU machine:
#
#   bash scripts/install_dist_deps.sh [WHEEL_DIR] [--target DIR]
#
# The pins: yunchang 0.6.4 and diffusers 0.42.1, the versions the adapters were written
# against, and importlib_metadata, the one requirement of diffusers that the device image
# lacks (its torch, huggingface_hub, safetensors, numpy, Pillow, regex, requests and filelock
# are already there). To refill WHEEL_DIR on a machine with network:
#
#   python3 -m pip download --no-deps -d .whl yunchang==0.6.4 diffusers==0.42.1 importlib_metadata==10.2.0
#
# --no-deps: pip must not try to resolve (and fail to fetch) what the image already has; the
# import check at the end is the proof that nothing is missing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

wheels=.whl
target=()
while [ $# -gt 0 ]; do
  case $1 in
    --target) target=(--target "$2"); shift 2 ;;
    *) wheels=$1; shift ;;
  esac
done
pins=(yunchang==0.6.4 diffusers==0.42.1 importlib_metadata==10.2.0)
for pin in "${pins[@]}"; do
  file=$(ls "$wheels"/"${pin%%==*}"-"${pin##*==}"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$file" ]; then
    echo "install_dist_deps.sh: no wheel for $pin in $wheels/ (see this script's header)" >&2
    exit 2
  fi
done
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
  --find-links "$wheels" "${target[@]}" "${pins[@]}"
if [ ${#target[@]} -gt 0 ]; then export PYTHONPATH="${target[1]}${PYTHONPATH:+:$PYTHONPATH}"; fi
python3 - <<'PY'
import importlib.metadata as md
import diffusers.models.attention_dispatch  # noqa: F401  (what the adapter imports)
import yunchang  # noqa: F401
for name in ("torch", "yunchang", "diffusers", "huggingface_hub", "safetensors"):
    print(f"{name} {md.version(name)}")
PY
