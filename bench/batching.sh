#!/usr/bin/env bash
# Dynamic batching through the real server: closed-loop clients (bench/load_bench.cc) against one
# server per placement mode, batching off and on, N = 1, 2, 4, 8 clients. Rows:
#   {"bench":"batching","mode":"resident"|"streamed","batching":..,"concurrency":N,"images_per_s":..,
#    "p50_s":..,"p99_s":..,"mean_batch_size":..,"machine":..}
#   resident  every component kept resident (workflow keep_resident rules)
#   streamed  the transformer group-offloaded (block level, one block per group, stream); text
#             encoder and VAE resident
#
#   bench/batching.sh SERVER LOAD_BENCH MODEL_DIR OUT.jsonl [SIZE] [STEPS] [MACHINE] [DTYPE] [CONCURRENCY]
#     [BATCH_SIZES] [REQUESTS_PER_CLIENT] [MIN_REQUESTS]
# MODES (environment): the modes to run (default "resident streamed"); MAX_QUEUE_DELAY_MS: the
# batching delay (default 200: above the ~130 ms a 1024x1024 noise PNG takes to encode plus the
# turnaround, so that clients out of step meet again; 100 was measured too short, batching_run4).
# MODEL_DIR: a Z-Image directory; random weights are drawn from its configs
# (bench/make_zimage_random_dir.py).
set -euo pipefail
server=$1 load_bench=$2 model_dir=$3 out=$4
size=${5:-1024} steps=${6:-8} machine=${7:-unknown} dtype=${8:-bfloat16}
concurrency=${9:-1,2,4,8} batch_sizes=${10:-1,8} per_client=${11:-3} min_requests=${12:-8}
tmp=$(mktemp -d)
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/serve_lib.sh"
trap 'rm -rf "$tmp"' EXIT
token=bench-token

resident='strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }'
group='group_offload { enabled: true exclude: "text_encoder" exclude: "vae" defaults { offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true } }'

run_mode() {
  local mode=$1 strategy=$2 offload=$3
  cat >"$tmp/$mode.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
queue_depth: 64
auth { admin_token: "$token" }
pipelines { name: "zimage" model_dir: "$model_dir" random_weights: true dtype: "$dtype" $offload }
$strategy
CFG
  start_server "$server" "$tmp/$mode.textproto" "$tmp/$mode.log" || return 1
  local rc=0
  "$load_bench" --target="$TARGET" --token="$token" --mode="$mode" --machine="$machine" --size="$size" \
    --steps="$steps" --concurrency="$concurrency" --batch_sizes="$batch_sizes" --requests_per_client="$per_client" \
    --min_requests="$min_requests" --max_queue_delay_ms="${MAX_QUEUE_DELAY_MS:-200}" --out="$out" || rc=$?
  stop_server
  return $rc
}

for mode in ${MODES:-resident streamed}; do
  case $mode in
    resident) run_mode resident "$resident" "" ;;
    streamed) run_mode streamed "$resident" "$group" ;;
  esac
done
