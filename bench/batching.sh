#!/usr/bin/env bash
# Dynamic batching through the real server: closed-loop clients (bench/load_bench.cc) against one
# server per placement mode, batching off and on, N = 1, 2, 4, 8 clients. Rows:
#   {"bench":"batching","mode":"resident"|"streamed","batching":..,"concurrency":N,"images_per_s":..,
#    "p50_s":..,"p99_s":..,"mean_batch_size":..,"machine":..}
#   resident  every component kept resident (workflow keep_resident rules)
#   streamed  the transformer group-offloaded (block level, one block per group, stream); text
#             encoder and VAE resident
#   streamed_int8, streamed_int4  the same, streamed from an 8-bit (int8, a scale per 128 values) or
#             4-bit (int4, an 8-bit scale per 16 values) host copy widened on the device
# Rows also carry "compress" (none, int8_grouped, int4) and "compute" (bf16, fp8).
#
#   bench/batching.sh SERVER LOAD_BENCH MODEL_DIR OUT.jsonl [SIZE] [STEPS] [MACHINE] [DTYPE] [CONCURRENCY]
#     [BATCH_SIZES] [REQUESTS_PER_CLIENT] [MIN_REQUESTS]
# MODES (environment): the modes to run (default "resident streamed"); COMPUTE: bf16 (default) or
# fp8 (the transformer's linears as FP8 GEMMs, CUDA only); MAX_QUEUE_DELAY_MS: the
# batching delay (default 200: above the ~130 ms a 1024x1024 noise PNG takes to encode plus the
# turnaround, so that clients out of step meet again; 100 was measured too short, batching_run4).
# FORMAT: the image format the clients ask for (png, the default; png_fast; rgb: raw pixels). In a
# closed loop whose clients all wait on one batch the device idles while the batch's images are
# encoded and the clients turn around (~0.13 s for a 1024x1024 noise PNG); unbatched, the next
# client's request runs during that time. Rows carry "format".
# MODEL_DIR: a Z-Image directory; random weights are drawn from its configs
# (bench/make_zimage_random_dir.py).
# HIGH_PRIORITY_COMPUTE=1: the server's compute on a high-priority CUDA stream
# (DeviceConfig.high_priority_compute); its rows' mode ends in "_hiprio".
# STOWCTL=PATH and PLACEMENT_DIR=DIR: after each mode's rows, its server's GetPlacement as JSON (stowctl
# placement --json: the streamed transformer's prefetches, sync onloads, forwards...) in
# DIR/<k>-<mode>-<compress>.placement.json, k counting the modes run (repeats apart).
# PREFETCH_DEPTH=N (1..64): the streamed modes' group offload prefetches N groups ahead (its
# prefetch_depth; unset: the engine's choice, 4 for a compressed copy streamed block by block where no
# budget is set, as here, else 1); their rows' mode ends in "_d<N>".
set -euo pipefail
server=$1 load_bench=$2 model_dir=$3 out=$4
size=${5:-1024} steps=${6:-8} machine=${7:-unknown} dtype=${8:-bfloat16}
concurrency=${9:-1,2,4,8} batch_sizes=${10:-1,8} per_client=${11:-3} min_requests=${12:-8}
tmp=$(mktemp -d)
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/serve_lib.sh"
trap 'rm -rf "$tmp"' EXIT
token=bench-token

resident='strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }'
# A group-offloaded transformer, its host copy compressed as $1 (COMPRESS_NONE for bf16).
depth_field="" depth_suffix=""
if [ -n "${PREFETCH_DEPTH:-}" ]; then
  case $PREFETCH_DEPTH in
    '' | *[!0-9]*) echo "batching.sh: PREFETCH_DEPTH must be a number 1..64, not '$PREFETCH_DEPTH'" >&2; exit 2 ;;
  esac
  if [ "$PREFETCH_DEPTH" -lt 1 ] || [ "$PREFETCH_DEPTH" -gt 64 ]; then
    echo "batching.sh: PREFETCH_DEPTH must be 1..64, not $PREFETCH_DEPTH" >&2
    exit 2
  fi
  depth_field=" prefetch_depth: $PREFETCH_DEPTH" depth_suffix=_d$PREFETCH_DEPTH
fi
group() {
  echo "group_offload { enabled: true exclude: \"text_encoder\" exclude: \"vae\" defaults { offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true compress: $1$depth_field } }"
}
compute=${COMPUTE:-bf16}
case $compute in
  bf16) compute_field="" ;;
  fp8) compute_field=' compute { key: "transformer" value: COMPUTE_FP8 }' ;;
  *) echo "batching.sh: COMPUTE must be bf16 or fp8, not '$compute'" >&2; exit 2 ;;
esac

case ${FORMAT:-png} in
  png | png_fast | rgb) ;;
  *) echo "batching.sh: FORMAT must be png, png_fast or rgb, not '$FORMAT'" >&2; exit 2 ;;
esac

device_block="" mode_suffix=""
if [ "${HIGH_PRIORITY_COMPUTE:-0}" = 1 ]; then
  device_block="device { high_priority_compute: true }"
  mode_suffix=_hiprio
fi

for mode in ${MODES:-resident streamed}; do
  case $mode in
    resident | streamed | streamed_int8 | streamed_int4) ;;
    *) echo "batching.sh: unknown mode '$mode' (resident, streamed, streamed_int8, streamed_int4)" >&2; exit 2 ;;
  esac
done

run_mode() {
  local mode=$1 strategy=$2 offload=$3 compress=$4
  cat >"$tmp/$mode-$compress.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
queue_depth: 64
auth { admin_token: "$token" }
pipelines { name: "zimage" model_dir: "$model_dir" random_weights: true dtype: "$dtype" $offload$compute_field }
$strategy
$device_block
CFG
  start_server "$server" "$tmp/$mode-$compress.textproto" "$tmp/$mode-$compress.log" || return 1
  local rc=0
  local suffix=$mode_suffix
  [ "$mode" = streamed ] && suffix=$depth_suffix$mode_suffix
  "$load_bench" --target="$TARGET" --token="$token" --mode="$mode$suffix" --compress="$compress" --compute="$compute" \
    --machine="$machine" --size="$size" \
    --steps="$steps" --concurrency="$concurrency" --batch_sizes="$batch_sizes" --requests_per_client="$per_client" \
    --min_requests="$min_requests" --max_queue_delay_ms="${MAX_QUEUE_DELAY_MS:-200}" --format="${FORMAT:-png}" \
    --out="$out" || rc=$?
  mode_index=$((mode_index + 1))
  if [ -n "${STOWCTL:-}" ] && [ -n "${PLACEMENT_DIR:-}" ]; then
    mkdir -p "$PLACEMENT_DIR"
    "$STOWCTL" --target="$TARGET" --token="$token" placement --json \
      >"$PLACEMENT_DIR/$mode_index-$mode-$compress.placement.json" || rc=$?
  fi
  stop_server
  return $rc
}
mode_index=0

for mode in ${MODES:-resident streamed}; do
  case $mode in
    resident) run_mode resident "$resident" "" none ;;
    streamed) run_mode streamed "$resident" "$(group COMPRESS_NONE)" none ;;
    streamed_int8) run_mode streamed "$resident" "$(group COMPRESS_INT8_GROUPED)" int8_grouped ;;
    streamed_int4) run_mode streamed "$resident" "$(group COMPRESS_INT4)" int4 ;;
  esac
done
