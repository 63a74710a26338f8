#!/usr/bin/env bash
# One device call: build with CMake, run the unit tests, serve a Generate on the GPU
# (build_and_serve.sh), then run offload_bench's rows on the real CUDA path. Everything lands in
# $OUT as at most three files (the device tool returns at most 8): summary.txt,
# offload_bench.jsonl and gpu_run.tgz (all logs).
#
#   OUT=/some/dir deploy/gpu_host/run_gpu_suite.sh
#
# Environment: STOWAGE_BENCH_ROWS (comma list, one process each), STOWAGE_BENCH_ARGS (extra
# offload_bench flags), STOWAGE_SERVE_TIMEOUT / STOWAGE_BENCH_TIMEOUT (seconds), and every variable
# of build_and_serve.sh (STOWAGE_SKIP_TESTS=1 skips ctest).
set -uo pipefail
repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
cd "$repo_root"
OUT="${OUT:-$repo_root/gpu_out}"
mkdir -p "$OUT"
logs="$(mktemp -d /tmp/stowage-gpu-logs.XXXXXX)"

# The server links its own fix for civetweb's thread stacks: no preloaded shim.
STOWAGE_THREAD_STACK_SHIM="${STOWAGE_THREAD_STACK_SHIM:-never}" OUT="$logs" \
  timeout "${STOWAGE_SERVE_TIMEOUT:-330}" deploy/gpu_host/build_and_serve.sh
serve_rc=$?
cp "$logs/summary.txt" "$OUT/summary.txt" 2>/dev/null || echo "build_and_serve.sh left no summary (rc $serve_rc)" >"$OUT/summary.txt"

bench="$repo_root/build/gpu/bench/offload_bench"
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores"
if [ -x "$bench" ]; then
  export LD_LIBRARY_PATH="/tmp/stowage-deps/usr/lib/x86_64-linux-gnu:$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))'):${LD_LIBRARY_PATH:-}"
  echo "offload_bench on: $machine" | tee -a "$OUT/summary.txt"
  # One process per row, as the anchors were measured: each row's peak RSS is its own.
  rows="${STOWAGE_BENCH_ROWS:-resident,block_pinned,block_pinned_d2,leaf_pinned,leaf_pinned_d4,block_lowram,leaf_lowram_d4,budget25,budget50,budget75,block_disk}"
  resident_step=0
  bench_rc=0
  deadline=$((SECONDS + ${STOWAGE_BENCH_TIMEOUT:-300}))
  for row in ${rows//,/ }; do
    left=$((deadline - SECONDS))
    [ "$left" -gt 10 ] || { echo "bench: out of time before row $row" | tee -a "$logs/offload_bench.txt"; bench_rc=124; break; }
    timeout "$left" "$bench" --config=full --backend=cuda --rows="$row" --resident_step_s="$resident_step" \
      --out="$OUT/offload_bench.jsonl" --machine="$machine" --disk_dir=/tmp/stowage-bench-disk \
      ${STOWAGE_BENCH_ARGS:-} \
      2>&1 | tee -a "$logs/offload_bench.txt" || bench_rc=$?
    if [ "$row" = resident ]; then
      resident_step=$(python3 -c 'import json,sys; print([json.loads(l) for l in open(sys.argv[1])][-1]["step_s"])' "$OUT/offload_bench.jsonl" 2>/dev/null || echo 0)
    fi
  done
  echo "offload_bench exit: $bench_rc" | tee -a "$OUT/summary.txt"
  cat "$logs/offload_bench.txt" >>"$OUT/summary.txt"
else
  echo "offload_bench was not built" | tee -a "$OUT/summary.txt"
fi
tar czf "$OUT/gpu_run.tgz" -C "$logs" . 2>/dev/null
exit "$serve_rc"
