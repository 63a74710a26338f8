#!/usr/bin/env bash
# The whole Z-Image pipeline resident, end to end: the Stowage server (text encoder, 8 transformer
# steps, VAE decode, PNG encoding, reply over loopback gRPC) beside diffusers' ZImagePipeline on the
# same weights (bench/diffusers_pipeline_bench.py), in one run. Rows:
#   {"bench":"e2e","system":"stowage"|"diffusers","steps":8,"size":1024,"warm_s":..,"first_s":..,"machine":..}
# Stowage: first_s is the first request after the server reported ready (its load warms up, see
# PipelineConfig.warmup), warm_s the median of three more, both measured by the client around
# stowctl (5 warm requests); server_* fields split the server's own time, png_s is the PNG encoding.
# COMPUTE=fp8 (environment): the transformer computes in FP8 (PipelineConfig.compute; "mode":"fp8").
# FORMAT=png_fast|rgb (environment): the reply's image format (stowctl --format; "format" in the row).
# diffusers: output_type "pil" (no PNG); diffusers_compile adds torch.compile(pipe.transformer).
#
#   bench/e2e_bench.sh SERVER STOWCTL MODEL_DIR OUT.jsonl MACHINE [SIZE] [STEPS] [SYSTEMS]
# MODEL_DIR: written by `diffusers_pipeline_bench.py export` (real safetensors, random values).
# SYSTEMS: "stowage diffusers" (default), any of stowage, diffusers, diffusers_compile. LOAD_BENCH (environment): bench/load_bench,
# to add "warm_persistent_client_s" (the median of three warm requests from one connected client). RANDOM_WEIGHTS=true (environment): Stowage
# draws the weights from MODEL_DIR's configs instead of reading them (a row "weights":"random"). CONV_LANE=off
# (environment): DeviceConfig.convolution_lane false, the VAE's convolutions on the worker's thread (a row
# "convolution_lane":false) — beside a default row, what the lane's hand-overs cost a decode.
set -euo pipefail
server=$1 stowctl=$2 model_dir=$3 out=$4 machine=$5
size=${6:-1024} steps=${7:-8} systems=${8:-stowage diffusers}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tmp=$(mktemp -d)
source "$here/serve_lib.sh"
trap 'rm -rf "$tmp"' EXIT
prompt="a lighthouse on a cliff at dusk, oil painting"

stowage() {
  cat >"$tmp/e2e.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
pipelines { name: "zimage" model_dir: "$model_dir" dtype: "bfloat16" random_weights: ${RANDOM_WEIGHTS:-false}
  $([ "${COMPUTE:-bf16}" = fp8 ] && echo 'compute { key: "transformer" value: COMPUTE_FP8 }') }
strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }
$([ "${CONV_LANE:-on}" = off ] && echo 'device { convolution_lane: false }')
CFG
  local t0; t0=$(date +%s.%N)
  start_server "$server" "$tmp/e2e.textproto" "$tmp/server.log" || return 1
  local ready; ready=$(date +%s.%N)
  local load_s; load_s=$(python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$t0" "$ready")
  for i in 0 1 2 3 4 5; do
    local s; s=$(date +%s.%N)
    "$stowctl" --target="$TARGET" generate --prompt="$prompt" --width="$size" --height="$size" --steps="$steps" \
      --guidance=0 --seed="$i" --json --format="${FORMAT:-png}" --out="$tmp/e2e_$i.png" >"$tmp/reply_$i.json"
    local e; e=$(date +%s.%N)
    python3 -c "import sys; print(float(sys.argv[2]) - float(sys.argv[1]))" "$s" "$e" >"$tmp/wall_$i"
  done
  # The same warm request from a client that stays connected (no process start, no new channel),
  # as diffusers' row measures an in-process call.
  if [ -n "${LOAD_BENCH:-}" ]; then
    "$LOAD_BENCH" --target="$TARGET" --batch_sizes=keep --concurrency=1 --requests_per_client=3 --min_requests=3 \
      --warmup=0 --size="$size" --steps="$steps" --mode=e2e --machine="$machine" --out="$tmp/persistent.jsonl" >/dev/null
  fi
  stop_server
  grep -i "warm" "$tmp/server.log" || true
  python3 - "$tmp" "$size" "$steps" "$machine" "$load_s" >>"$out" <<'PY'
import json, os, statistics, sys
tmp, size, steps, machine, load_s = sys.argv[1:]
def seconds(d): return float(d.rstrip("s"))
wall = [float(open(f"{tmp}/wall_{i}").read()) for i in range(6)]
replies = [json.load(open(f"{tmp}/reply_{i}.json")) for i in range(6)]
def stage(reply, name):
    return sum(seconds(s["duration"]) for s in reply.get("stages", []) if s["stage"] == name)
warm = replies[1:]
row = {"bench": "e2e", "system": "stowage", "model": "zimage", "mode": os.environ.get("COMPUTE", "bf16"),
       "format": os.environ.get("FORMAT", "png"),
       "steps": int(steps), "size": int(size),
       "warm_s": statistics.median(wall[1:]), "first_s": wall[0], "warm_runs_s": wall[1:], "load_s": float(load_s),
       "server_run_s": statistics.median(seconds(r["runTime"]) for r in warm),
       "server_encode_image_s": statistics.median(stage(r, "encode_image") for r in warm),
       "png_s": statistics.median(stage(r, "encode_image") for r in warm),
       "server_denoise_s": statistics.median(stage(r, "denoise") for r in warm),
       "server_decode_s": statistics.median(stage(r, "decode") for r in warm),
       "server_encode_prompt_s": statistics.median(stage(r, "encode_prompt") for r in warm),
       # The server's run time no stage holds (placement and bookkeeping around the pipeline's stages).
       "server_unstaged_s": statistics.median(
           seconds(r["runTime"]) - sum(seconds(s["duration"]) for s in r.get("stages", [])) for r in warm),
       "first_stages_s": {s["stage"]: seconds(s["duration"]) for s in replies[0].get("stages", [])},
       "warm_stages_s": {s["stage"]: seconds(s["duration"]) for s in replies[1].get("stages", [])},
       "first_host_to_device_bytes": int(replies[0].get("hostToDeviceBytes", 0)),
       "peak_device_bytes": int(replies[-1].get("peakDeviceReservedBytes", 0)),
       "weights": "random" if os.environ.get("RANDOM_WEIGHTS") == "true" else "files",
       "convolution_lane": os.environ.get("CONV_LANE", "on") != "off", "machine": machine}
if os.path.exists(f"{tmp}/persistent.jsonl"):
    row["warm_persistent_client_s"] = json.loads(open(f"{tmp}/persistent.jsonl").readline())["p50_s"]
print(json.dumps(row))
PY
  tail -1 "$out"
}

for system in $systems; do
  case $system in
    stowage) stowage ;;
    diffusers) python3 "$here/diffusers_pipeline_bench.py" run "$model_dir" --out "$out" --machine "$machine" \
                 --size "$size" --steps "$steps" ;;
    diffusers_compile) python3 "$here/diffusers_pipeline_bench.py" run "$model_dir" --out "$out" --machine "$machine" \
                 --size "$size" --steps "$steps" --compile ;;
  esac
done
