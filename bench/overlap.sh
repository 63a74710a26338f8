#!/usr/bin/env bash
# Overlap across components, measured: the whole Z-Image pipeline with every component
# group-offloaded (block level, one block per group, streams; the VAE's blocks are its decoder's
# up_blocks), through the server, with DeviceConfig.prefetch_next_component off and on. Rows:
#   {"bench":"overlap","prefetch_next_component":true|false,"warm_s":..,"stages_s":{..},"machine":..}
# warm_s: the median client-measured latency of 3 requests after one warm-up; stages_s: the server's
# stage times of the median request.
#
#   bench/overlap.sh SERVER STOWCTL MODEL_DIR OUT.jsonl MACHINE [SIZE] [STEPS] [RANDOM_WEIGHTS]
set -euo pipefail
server=$1 stowctl=$2 model_dir=$3 out=$4 machine=$5
size=${6:-1024} steps=${7:-8} random=${8:-true}
tmp=$(mktemp -d)
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/serve_lib.sh"
trap 'rm -rf "$tmp"' EXIT
group='group_offload { enabled: true defaults { offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true } overrides { key: "vae" value { offload_type: BLOCK_LEVEL block_modules: "decoder.up_blocks" use_stream: true } } }'

for prefetch in false true; do
  cat >"$tmp/c.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
device { prefetch_next_component: $prefetch }
pipelines { name: "zimage" model_dir: "$model_dir" random_weights: $random dtype: "bfloat16" warmup: false $group }
CFG
  start_server "$server" "$tmp/c.textproto" "$tmp/server.log" || exit 1
  for i in 0 1 2 3; do
    s=$(date +%s.%N)
    "$stowctl" --target="$TARGET" generate --prompt="a lighthouse on a cliff at dusk" --width="$size" \
      --height="$size" --steps="$steps" --guidance=0 --seed="$i" --json >"$tmp/reply_$i.json"
    e=$(date +%s.%N)
    python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$s" "$e" >"$tmp/wall_$i"
  done
  stop_server
  python3 - "$tmp" "$prefetch" "$size" "$steps" "$machine" >>"$out" <<'PY'
import json, sys
tmp, prefetch, size, steps, machine = sys.argv[1:]
runs = sorted((float(open(f"{tmp}/wall_{i}").read()), i) for i in (1, 2, 3))
wall, median = runs[1]
reply = json.load(open(f"{tmp}/reply_{median}.json"))
stages = {s["stage"]: float(s["duration"].rstrip("s")) for s in reply.get("stages", [])}
print(json.dumps({"bench": "overlap", "prefetch_next_component": prefetch == "true", "warm_s": wall,
                  "warm_runs_s": [w for w, _ in runs], "stages_s": stages, "size": int(size), "steps": int(steps),
                  "peak_device_bytes": int(reply.get("peakDeviceReservedBytes", 0)), "machine": machine}))
PY
  tail -1 "$out"
done
