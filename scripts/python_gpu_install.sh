#!/usr/bin/env bash
# Installs sagekit from this checkout where pip cannot reach an index (the GPU machine):
# build isolation off, so the build uses the scikit-build-core, nanobind and cmake already
# installed, and --no-index so pip never tries the network.
#
#   scripts/python_gpu_install.sh            CUDA build for SAGEKIT_CUDA_ARCHITECTURES (90a)
#   scripts/python_gpu_install.sh --cpu      CPU references only (no nvcc needed)
#   SAGE_HEAD_DIMS="128" scripts/python_gpu_install.sh   fewer kernels, faster build
#   scripts/python_gpu_install.sh --build-dir DIR          build in DIR, a CMake build folder
#                                                           of the same options (gpu_run.sh's)
#
# The build folder (build-python/<wheel tag>, or DIR) is kept, so a second run is incremental.
set -euo pipefail
cd "$(dirname "$0")/.."

cuda=1
build_dir=
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu) cuda=0 ;;
    --build-dir) [ $# -ge 2 ] || { echo "python_gpu_install.sh: --build-dir needs a folder" >&2; exit 2; }
                 build_dir=$(realpath -m "$2"); shift ;;
    -h|--help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "python_gpu_install.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done

python3 - <<'PY'
import importlib.util, shutil, subprocess, sys
missing = [m for m in ("scikit_build_core", "nanobind", "pip") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit("python_gpu_install.sh: missing Python packages " + ", ".join(missing) +
             " (they must be preinstalled: this install does not use the network)")
import nanobind
major = int(nanobind.__version__.split(".")[0])
if not (2 <= major < 4):
    sys.exit(f"python_gpu_install.sh: nanobind {nanobind.__version__} is outside >=2.4,<4")
cmake = shutil.which("cmake")
if cmake is None and importlib.util.find_spec("cmake") is None:
    sys.exit("python_gpu_install.sh: no cmake (>= 3.24) on PATH or as a Python package")
print(f"python {sys.version.split()[0]}, nanobind {nanobind.__version__}, cmake at {cmake}")
PY

args=()
if [[ "$cuda" == 1 ]]; then
  command -v nvcc >/dev/null || [[ -x /usr/local/cuda/bin/nvcc ]] || {
    echo "python_gpu_install.sh: no nvcc; install the CUDA toolkit or pass --cpu" >&2; exit 1; }
  command -v nvcc >/dev/null || export PATH="/usr/local/cuda/bin:$PATH"
  args+=("-DSAGE_CUDA=ON" "-DSAGE_CUDA_ARCHITECTURES=${SAGEKIT_CUDA_ARCHITECTURES:-90a}")
  [[ -n "${SAGE_HEAD_DIMS:-}" ]] && args+=("-DSAGE_HEAD_DIMS=${SAGE_HEAD_DIMS}")
else
  args+=("-DSAGE_CUDA=OFF")
fi

pip_args=()
if [[ -n "$build_dir" ]]; then
  # Reusing a build folder (issue 32: build each kernel once): pyproject.toml's defines would
  # turn its tests and CLI off, so keep them as that folder has them; with the same options
  # otherwise, ninja finds the library built and compiles no kernel again.
  for opt in SAGE_BUILD_TESTS SAGE_BUILD_CLI; do
    val=$(sed -n "s/^$opt:BOOL=//p" "$build_dir/CMakeCache.txt" 2>/dev/null || true)
    [[ -n "$val" ]] && args+=("-D$opt=$val")
  done
  pip_args+=("--config-settings=build-dir=$build_dir")
  export CMAKE_GENERATOR=Ninja  # gpu_run.sh's build folders are Ninja ones
fi

export CMAKE_ARGS="${CMAKE_ARGS:-} ${args[*]}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
echo "CMAKE_ARGS=$CMAKE_ARGS${build_dir:+ (build folder $build_dir)}"
mkdir -p build-python
log=build-python/python_gpu_install.log
if ! python3 -m pip install --no-build-isolation --no-index --no-deps -v "${pip_args[@]}" . >"$log" 2>&1; then
  echo "python_gpu_install.sh: pip install failed; the end of $log:" >&2
  tail -n 60 "$log" >&2
  exit 1
fi
grep -E "Successfully installed" "$log" || true
cd /  # import the installed package, not a folder of this checkout
python3 -c "import sagekit; print('sagekit', sagekit.__version__, '| cuda_built', sagekit.cuda_built, '| gpu_available', sagekit.gpu_available(), '| head dims', sagekit.gpu_head_dims(), '| torch ops', sagekit.ops is not None)"
