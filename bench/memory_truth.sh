#!/usr/bin/env bash
# Device memory as nvidia-smi sees it, against the budget at load and against each reply's peak
# (issue "ready for production" #3): the server's per-process device memory is sampled every ~20 ms
# (nvidia-smi --query-compute-apps) with a timestamp for its whole life; the samples before the
# server reported ready are the load (warm-up included), the samples inside each request's window
# are that request's. One row per phase:
#   {"bench":"memory_truth","mode":..,"phase":"load","budget_bytes":..,"nvidia_smi_peak_bytes":..,
#    "over_budget_bytes":..,"machine":..,"commit":..}
#   {"bench":"memory_truth","mode":..,"phase":"request","index":i,"reported_peak_bytes":..,
#    "nvidia_smi_peak_bytes":..,"smi_over_reported":..,"samples":..,"machine":..,"commit":..}
# reported_peak_bytes is the reply's peak_device_reserved_bytes (the allocator's peak of reserved
# bytes plus what the process holds outside it). The server's log lines about its context go to
# stdout.
#
#   bench/memory_truth.sh SERVER STOWCTL MODEL_DIR OUT.jsonl MACHINE COMMIT [MODE...]
# MODEL_DIR: a Z-Image directory (weights drawn from its configs: bench/make_zimage_random_dir.py).
# MODES (default "budget24_bf16 budget24_fp8 unbudgeted_bf16"): budget24_* put a 24 GiB budget on
# the device (footprint placement, warm-up at load on), unbudgeted_* none.
set -euo pipefail
server=$1 stowctl=$2 model_dir=$3 out=$4 machine=$5 commit=$6
modes="${*:7}"
[ -n "$modes" ] || modes="budget24_bf16 budget24_fp8 unbudgeted_bf16"
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
source "$here/serve_lib.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
command -v nvidia-smi >/dev/null || { echo "memory_truth.sh: needs nvidia-smi"; exit 2; }

# "unix_seconds used_MiB" lines for PID until it exits.
sample_gpu() {
  local pid=$1 file=$2
  : >"$file"
  while kill -0 "$pid" 2>/dev/null; do
    local now used
    now=$(date +%s.%N)
    used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits 2>/dev/null |
      awk -F', *' -v p="$pid" '$1 == p { print $2 }')
    [ -n "$used" ] && echo "$now $used" >>"$file"
    sleep 0.02
  done
}

for mode in $modes; do
  budget=0
  case $mode in budget24_*) budget=$((24 * 1024 * 1024 * 1024));; esac
  compute=""
  case $mode in *_fp8) compute='compute { key: "transformer" value: COMPUTE_FP8 }';; esac
  cat >"$tmp/$mode.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
device { memory_budget_bytes: $budget }
pipelines { name: "zimage" model_dir: "$model_dir" dtype: "bfloat16" random_weights: true warmup: true $compute }
CFG
  start=$(date +%s.%N)
  # The sampler starts with the server (start_server waits for the port file, i.e. the load).
  ( while [ ! -s "$tmp/$mode.log.pid" ]; do sleep 0.01; done; sample_gpu "$(cat "$tmp/$mode.log.pid")" "$tmp/$mode.smi" ) &
  sampler=$!
  "$server" --config="$tmp/$mode.textproto" --port_file="$tmp/$mode.ports" >"$tmp/$mode.log" 2>&1 &
  pid=$!
  echo "$pid" >"$tmp/$mode.log.pid"
  for _ in $(seq 6000); do [ -s "$tmp/$mode.ports" ] && break; kill -0 $pid 2>/dev/null || break; sleep 0.05; done
  if [ ! -s "$tmp/$mode.ports" ]; then
    echo "mode $mode: server did not start"; cat "$tmp/$mode.log"; kill $pid 2>/dev/null || true; wait $sampler || true
    continue
  fi
  ready=$(date +%s.%N)
  target=$(sed -E 's/.*"grpc_address": "([^"]+)".*/\1/' "$tmp/$mode.ports")
  : >"$tmp/$mode.windows"
  for i in 0 1 2; do
    s=$(date +%s.%N)
    "$stowctl" --target="$target" generate --prompt="a lighthouse on a cliff at dusk, oil painting" --width=1024 \
      --height=1024 --steps=8 --guidance=0 --seed=$i --json --out="$tmp/$mode.$i.png" >"$tmp/$mode.$i.json"
    e=$(date +%s.%N)
    echo "$i $s $e" >>"$tmp/$mode.windows"
    sleep 0.2  # A few samples after the reply: the request's peak may show in the next sample.
  done
  kill $pid; wait $pid 2>/dev/null || true
  wait $sampler 2>/dev/null || true
  echo "== $mode: the server's lines about memory"
  grep -iE "context device=|warmup pipeline=|budget" "$tmp/$mode.log" || true
  python3 - "$tmp" "$mode" "$budget" "$start" "$ready" "$machine" "$commit" >>"$out" <<'PY'
import json, sys
tmp, mode, budget, start, ready, machine, commit = sys.argv[1:]
budget, start, ready = int(budget), float(start), float(ready)
MiB = 1 << 20
samples = [tuple(map(float, line.split())) for line in open(f"{tmp}/{mode}.smi") if len(line.split()) == 2]
load = [m for t, m in samples if t <= ready]
row = {"bench": "memory_truth", "mode": mode, "phase": "load", "budget_bytes": budget,
       "nvidia_smi_peak_bytes": int(max(load, default=0) * MiB), "samples": len(load),
       "load_s": round(ready - start, 2), "machine": machine, "commit": commit}
row["over_budget_bytes"] = max(0, row["nvidia_smi_peak_bytes"] - budget) if budget else 0
print(json.dumps(row))
for line in open(f"{tmp}/{mode}.windows"):
    i, s, e = line.split()
    s, e = float(s), float(e)
    # The window and the samples taken up to 0.15 s after the reply (nvidia-smi itself lags).
    inside = [m for t, m in samples if s <= t <= e + 0.15]
    reply = json.load(open(f"{tmp}/{mode}.{i}.json"))
    stats = reply.get("stats", reply)
    reported = int(stats.get("peakDeviceReservedBytes", 0))
    smi = int(max(inside, default=0) * MiB)
    print(json.dumps({"bench": "memory_truth", "mode": mode, "phase": "request", "index": int(i),
                      "reported_peak_bytes": reported, "nvidia_smi_peak_bytes": smi,
                      "smi_over_reported": round(smi / reported, 4) if reported else None,
                      "samples": len(inside), "machine": machine, "commit": commit}))
PY
done
