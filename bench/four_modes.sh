#!/usr/bin/env bash
# The upstream demo's four placement modes through the real server, one server process per mode:
#   all_resident     every component kept resident (workflow keep_resident rules: nothing moves)
#   footprint_auto   the default footprint strategy (fires only when memory runs short)
#   text_encoders    custom strategy "text-encoders-only" (the text encoder leaves before the rest runs)
#   text_encoders_go the same, with the transformer group-offloaded (block level, 1 block/group, stream)
#   text_encoders_go_all  (a fifth row, not in the upstream demo) the same, with the text encoder
#                    group-offloaded too: once the transformer streams, the peak is set while the
#                    text encoder runs, so only streaming it too brings the peak lower
# Each mode: a fresh server, a first Generate (cold: the components arrive as the request needs them,
# as in the upstream demo) and a second one (warm: what the strategy leaves on the device between
# requests); both replies' peak device memory and peak CPU RSS go into one JSON line in OUT.
# Where nvidia-smi exists, the server's device memory as the driver reports it is sampled every
# ~50 ms for the server's whole life, and a second line per mode compares it with the replies'
# reported peak as the GPU sees it:
#   {"bench":"device_memory","mode":..,"reported_peak_bytes":..,"nvidia_smi_peak_bytes":..,"machine":..}
#
#   bench/four_modes.sh SERVER STOWCTL MODEL_DIR OUT.jsonl [SIZE] [STEPS] [MACHINE] [DTYPE]
# MODEL_DIR: a Z-Image directory; random weights are drawn from its configs (see
# bench/make_zimage_random_dir.py).
set -euo pipefail
server=$1 stowctl=$2 model_dir=$3 out=$4
size=${5:-1024} steps=${6:-4} machine=${7:-unknown} dtype=${8:-bfloat16}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

strategy_all='strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }'
strategy_footprint='strategy { footprint { reserve_bytes: 0 } }'
strategy_te='strategy { custom: "text-encoders-only" }'
group='group_offload { enabled: true exclude: "text_encoder" exclude: "vae" defaults { offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true } }'
group_all='group_offload { enabled: true exclude: "vae" defaults { offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true } }'

# Appends the server's used device memory (MiB, per nvidia-smi) to FILE until PID exits.
sample_gpu() {
  local pid=$1 file=$2
  : >"$file"
  while kill -0 "$pid" 2>/dev/null; do
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      awk -F', *' -v p="$pid" '$1 == p { print $2 }' >>"$file"
    sleep 0.05
  done
}

run_mode() {
  local mode=$1 strategy=$2 offload=$3
  cat >"$tmp/$mode.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
pipelines { name: "zimage" model_dir: "$model_dir" random_weights: true dtype: "$dtype" warmup: false $offload }
$strategy
CFG
  rm -f "$tmp/ports.json"
  "$server" --config="$tmp/$mode.textproto" --port_file="$tmp/ports.json" >"$tmp/$mode.log" 2>&1 &
  local pid=$!
  local sampler=""
  if command -v nvidia-smi >/dev/null 2>&1; then
    sample_gpu $pid "$tmp/$mode.smi" &
    sampler=$!
  fi
  for _ in $(seq 3000); do [ -s "$tmp/ports.json" ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.1; done
  if [ ! -s "$tmp/ports.json" ]; then echo "mode $mode: server did not start"; cat "$tmp/$mode.log"; kill $pid 2>/dev/null; return 1; fi
  local target
  target=$(sed -E 's/.*"grpc_address": "([^"]+)".*/\1/' "$tmp/ports.json")
  for pass in cold warm; do
    "$stowctl" --target="$target" generate --prompt="a lighthouse at dusk" --width="$size" --height="$size" \
      --steps="$steps" --guidance=0 --seed=1 --json >"$tmp/$mode.$pass.json"
  done
  kill $pid; wait $pid 2>/dev/null || true
  [ -z "$sampler" ] || wait $sampler 2>/dev/null || true
  /usr/bin/env python3 - "$mode" "$tmp/$mode.cold.json" "$tmp/$mode.warm.json" "$size" "$steps" "$machine" \
    "$dtype" "$tmp/$mode.smi" >>"$out" <<'PY'
import json, os, sys
mode, cold_path, warm_path, size, steps, machine, dtype, smi_path = sys.argv[1:]
cold, warm = json.load(open(cold_path)), json.load(open(warm_path))
print(json.dumps({"mode": mode, "peak_device_memory_bytes": int(cold["peakDeviceMemoryBytes"]),
                  "warm_peak_device_memory_bytes": int(warm["peakDeviceMemoryBytes"]),
                  "peak_cpu_rss_bytes": int(cold["peakCpuRssBytes"]), "run_time": cold["runTime"],
                  "warm_run_time": warm["runTime"], "device": cold["device"], "size": int(size),
                  "steps": int(steps), "dtype": dtype, "machine": machine}))
if os.path.exists(smi_path):
    samples = [int(line) for line in open(smi_path) if line.strip().isdigit()]
    reported = max(int(cold.get("peakDeviceReservedBytes", 0)), int(warm.get("peakDeviceReservedBytes", 0)))
    print(json.dumps({"bench": "device_memory", "mode": mode, "reported_peak_bytes": reported,
                      "nvidia_smi_peak_bytes": max(samples) * 2**20 if samples else None,
                      "nvidia_smi_samples": len(samples), "size": int(size), "steps": int(steps),
                      "machine": machine}))
PY
  tail -n "$([ -n "$sampler" ] && echo 2 || echo 1)" "$out"
}

run_mode all_resident "$strategy_all" ""
run_mode footprint_auto "$strategy_footprint" ""
run_mode text_encoders "$strategy_te" ""
run_mode text_encoders_go "$strategy_te" "$group"
run_mode text_encoders_go_all "$strategy_te" "$group_all"
