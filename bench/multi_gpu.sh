#!/usr/bin/env bash
# Several GPUs in one server (issue 13): one device, two replicas, and the split layout, through the
# real server with closed-loop clients (bench/multi_gpu_bench.cc). Rows (one per layout and client
# count, appended to OUT.jsonl):
#   {"bench":"multi_gpu","gpus":1|2,"layout":"replicas"|"split","concurrency":N,"images_per_s":..,
#    "p50_s":..,"p99_s":..,"peak_device_bytes":[dev0,dev1],"devices":[..],"machine":..,...}
#   replicas, gpus 1  the pipeline on the first device only (the baseline)
#   replicas, gpus 2  a full replica on each device; requests go to the shorter expected wait
#   split,    gpus 2  the pipeline's home on the first device, the components in SPLIT (default
#                     "text_encoder") on the second (PipelineConfig.component_devices)
# Every component is kept resident (workflow keep_resident rules): the rows measure devices, not
# offloading.
#
#   bench/multi_gpu.sh SERVER CLIENT MODEL OUT.jsonl [SIZE] [STEPS] [MACHINE] [DTYPE] [CONCURRENCY]
#     [REQUESTS] [KIND]
# MODEL: a Z-Image directory (random weights drawn from its configs: bench/make_zimage_random_dir.py
# --size full), or builtin:NAME for a built-in pipeline (the CI smoke test: builtin:tiny).
# KIND: cuda (default; devices cuda:0, cuda:1) or sim (simulated devices sim:0, sim:1).
# LAYOUTS (environment): default "single replicas split".
set -euo pipefail
server=$1 client=$2 model=$3 out=$4
size=${5:-1024} steps=${6:-8} machine=${7:-unknown} dtype=${8:-bfloat16}
concurrency=${9:-1,2,4} requests=${10:-16} kind=${11:-cuda}
split=${SPLIT:-text_encoder}
tmp=$(mktemp -d)
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/serve_lib.sh"
trap 'rm -rf "$tmp"' EXIT

case $kind in
  cuda) kind_enum=KIND_CUDA prefix=cuda ;;
  sim) kind_enum=KIND_SIMULATED prefix=sim ;;
  *) echo "KIND must be cuda or sim, not '$kind'" >&2; exit 2 ;;
esac
d0="$prefix:0" d1="$prefix:1"
if [[ $model == builtin:* ]]; then
  source_field="builtin: \"${model#builtin:}\""
  dtype_field=""
else
  source_field="model_dir: \"$model\" random_weights: true"
  dtype_field="dtype: \"$dtype\""
fi
resident='strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }'

# run_layout LABEL GPUS PIPELINE_EXTRA
run_layout() {
  local label=$1 gpus=$2 extra=$3 devices="$d0"
  [ "$gpus" = 2 ] && devices="$d0,$d1"
  {
    echo 'grpc_address: "127.0.0.1:0"'
    echo 'metrics_address: "none"'
    echo 'queue_depth: 64'
    echo "devices { kind: $kind_enum index: 0 }"
    [ "$gpus" = 2 ] && echo "devices { kind: $kind_enum index: 1 }"
    echo "pipelines { name: \"bench\" $source_field $dtype_field $extra }"
    echo "$resident"
  } >"$tmp/$label-$gpus.textproto"
  start_server "$server" "$tmp/$label-$gpus.textproto" "$tmp/$label-$gpus.log" || return 1
  local rc=0
  "$client" --target="$TARGET" --pipeline=bench --gpus="$gpus" --layout="$label" --devices="$devices" \
    --machine="$machine" --size="$size" --steps="$steps" --concurrency="$concurrency" --requests="$requests" \
    --warmup="$gpus" --out="$out" || rc=$?
  stop_server
  [ $rc = 0 ] || cat "$tmp/$label-$gpus.log"
  return $rc
}

split_fields=""
for component in ${split//,/ }; do
  split_fields+=" component_devices { component: \"$component\" device: \"$d1\" }"
done
for layout in ${LAYOUTS:-single replicas split}; do
  case $layout in
    single) run_layout replicas 1 "devices: \"$d0\"" ;;
    replicas) run_layout replicas 2 "devices: \"$d0\" devices: \"$d1\"" ;;
    split) run_layout split 2 "devices: \"$d0\"$split_fields" ;;
    *) echo "unknown layout '$layout' (single, replicas, split)" >&2; exit 2 ;;
  esac
done
