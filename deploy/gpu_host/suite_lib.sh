# Sourced by the GPU-host suites (run_flux_suite.sh, run_throughput_suite.sh, run_multi_gpu_suite.sh):
# the repository root as the working directory, $OUT (default gpu_out/), stamp() for timed lines in
# $OUT/summary.txt, $build (CMake's build folder) and suite_build.
#   suite_build LOG_PREFIX   builds with deploy/gpu_host/build_and_serve.sh (tests skipped) into a
#                            fresh log folder ($logs), then exports the library path for the
#                            binaries (unpacked .deb folder, torch's lib/), PYTHONPATH (diffusers'
#                            carried source) and sets $machine (GPU count and name, cores, commit).
set -uo pipefail
repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
cd "$repo_root"
OUT="${OUT:-$repo_root/gpu_out}"
mkdir -p "$OUT"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/summary.txt"; }
build="$repo_root/build/gpu"
# The commit rows name: unpack_and_run.sh's, else the unpacked tree's marker (a later call that runs a
# suite in that tree directly), else git's.
if [ -z "${STOWAGE_COMMIT:-}" ]; then
  STOWAGE_COMMIT=$(cat "$repo_root/.stowage-rev" 2>/dev/null || git -C "$repo_root" rev-parse --short HEAD 2>/dev/null || echo unknown)
fi
export STOWAGE_COMMIT

suite_build() {
  stamp "build"
  logs="$(mktemp -d "/tmp/stowage-$1-logs.XXXXXX")"
  STOWAGE_SKIP_TESTS=1 STOWAGE_THREAD_STACK_SHIM=never OUT="$logs" \
    timeout "${BUILD_TIMEOUT:-300}" deploy/gpu_host/build_and_serve.sh >"$logs/build.txt" 2>&1
  local status=$?
  stamp "build exit $status"
  # A failed build's first errors come back with the results (the targets that did build still run).
  [ "$status" -ne 0 ] && cp "$logs/build_errors.log" "$OUT/" 2>/dev/null
  tail -5 "$logs/summary.txt" >>"$OUT/summary.txt" 2>/dev/null
  export LD_LIBRARY_PATH="/tmp/stowage-deps/usr/lib/x86_64-linux-gnu:$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))'):${LD_LIBRARY_PATH:-}"
  export PYTHONPATH="$repo_root/.ref/diffusers/src" PYTHONUNBUFFERED=1
  local gpus name
  gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
  name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  machine="$([ "$gpus" -gt 1 ] && echo "$gpus x ")${name}, $(nproc) cores, commit ${STOWAGE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
}
