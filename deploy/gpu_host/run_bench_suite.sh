#!/usr/bin/env bash
# One device call for the benchmark tables: build (CMake), then
#   1. side by side with diffusers on the real ZImageTransformer2DModel (bench/side_by_side.sh),
#   2. the placement modes through the server at 1024x1024, 4 steps (bench/four_modes.sh),
#   3. the synthetic stack's low-CPU-RAM rows (bench/offload_bench),
#   4. ctest on CUDA with what time is left.
# Results land in $OUT (at most 8 files): summary.txt, diffusers.jsonl, stowage.jsonl,
# side_by_side.md, four_modes.jsonl, stack_rows.jsonl, ctest.log, logs.tgz.
#
# RUN_SIDE_BY_SIDE=0 skips step 1; STACK_ROWS names step 3's rows; SUITE_BUDGET (s) bounds step 4.
#
# Carry .deb (deploy/gpu_host/fetch_debs.sh) and .ref/diffusers/src (diffusers' source, git-ignored):
#   OUT=... deploy/gpu_host/run_bench_suite.sh
set -uo pipefail
repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
cd "$repo_root"
OUT="${OUT:-$repo_root/gpu_out}"
mkdir -p "$OUT"
logs="$(mktemp -d /tmp/stowage-bench-logs.XXXXXX)"
start=$(date +%s)
stamp() { echo "[$(( $(date +%s) - start )) s] $*" | tee -a "$OUT/summary.txt"; }

STOWAGE_SKIP_TESTS=1 STOWAGE_THREAD_STACK_SHIM=never OUT="$logs" \
  timeout 240 deploy/gpu_host/build_and_serve.sh >"$logs/build.txt" 2>&1
cat "$logs/summary.txt" >>"$OUT/summary.txt" 2>/dev/null || echo "build_and_serve.sh left no summary" >>"$OUT/summary.txt"
build="$repo_root/build/gpu"
export LD_LIBRARY_PATH="/tmp/stowage-deps/usr/lib/x86_64-linux-gnu:$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))'):${LD_LIBRARY_PATH:-}"
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores"
export PYTHONPATH="$repo_root/.ref/diffusers/src" PYTHONUNBUFFERED=1

if [ "${RUN_SIDE_BY_SIDE:-1}" = 1 ]; then
  stamp "side by side"
  timeout "${SIDE_TIMEOUT:-330}" bash bench/side_by_side.sh "$build/bench/offload_bench" /tmp/zimage-weights \
    "$logs/side" "$machine" >"$logs/side_by_side.txt" 2>&1
  stamp "side by side exit $?"
  for f in diffusers.jsonl stowage.jsonl side_by_side.md; do cp "$logs/side/$f" "$OUT/" 2>/dev/null; done
  cat "$OUT/side_by_side.md" >>"$OUT/summary.txt" 2>/dev/null
fi

stamp "placement modes"
python3 bench/make_zimage_random_dir.py /tmp/zimage-full --size full >/dev/null
timeout "${MODES_TIMEOUT:-200}" bash bench/four_modes.sh "$build/server/stowage_server" \
  "$build/clients/stowctl/stowctl" /tmp/zimage-full "$OUT/four_modes.jsonl" 1024 4 "$machine" bfloat16 \
  >"$logs/four_modes.txt" 2>&1
stamp "placement modes exit $?"

stamp "stack rows"
for row in ${STACK_ROWS:-block_pinned block_lowram leaf_lowram_d4}; do
  timeout 90 "$build/bench/offload_bench" --rows="$row" --out="$OUT/stack_rows.jsonl" --machine="$machine" \
    >>"$logs/stack_rows.txt" 2>&1
done
stamp "stack rows done"
cat "$logs/stack_rows.txt" >>"$OUT/summary.txt"

left=$(( ${SUITE_BUDGET:-560} - ($(date +%s) - start) ))
if [ "$left" -gt 30 ]; then
  stamp "ctest (${left} s left)"
  # Four test processes at once: four OpenMP threads each, not one per core each.
  (cd "$build" && OMP_NUM_THREADS=4 timeout "$left" ctest --output-on-failure -j 4) >"$OUT/ctest.log" 2>&1
  stamp "ctest exit $?"
  grep -E "tests passed|tests failed|Failed|\*\*\*" "$OUT/ctest.log" | tail -15 >>"$OUT/summary.txt"
fi
tar czf "$OUT/logs.tgz" -C "$logs" --exclude='side/*.jsonl' . 2>/dev/null
cat "$OUT/summary.txt"
