#!/usr/bin/env bash
# Why is the first request after a warmed-up load slower than the next ones? One server (resident,
# warm-up on), then requests whose prompts have new and repeated lengths; once with CUDA's default
# lazy module loading and once with CUDA_MODULE_LOADING=EAGER. A row per request:
#   {"bench":"first_request_probe","module_loading":..,"seq":i,"prompt_chars":..,"wall_s":..,
#    "encode_prompt_s":..,"denoise_s":..,"machine":..}
# Slow first uses of each new prompt length point at shape-dependent first-use costs (kernels
# loaded, or library heuristics); slowness that EAGER removes points at lazy module loading.
#
#   bench/first_request_probe.sh SERVER STOWCTL MODEL_DIR OUT.jsonl MACHINE [SIZE] [STEPS]
set -euo pipefail
server=$1 stowctl=$2 model_dir=$3 out=$4 machine=$5
size=${6:-1024} steps=${7:-8}
tmp=$(mktemp -d)
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/serve_lib.sh"
trap 'rm -rf "$tmp"' EXIT
p1="a lighthouse on a cliff at dusk, oil painting"
p2="a crowded night market in the rain, neon signs reflected in puddles, steam rising from food stalls, people with umbrellas, cinematic"
p3="$p2, $p2, wide angle, extremely detailed"
w="warm-up: a lighthouse on a rocky cliff above the sea at dusk, warm light, oil painting"
for loading in LAZY EAGER; do
  cat >"$tmp/c.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
pipelines { name: "zimage" model_dir: "$model_dir" random_weights: true dtype: "bfloat16" }
strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }
CFG
  CUDA_MODULE_LOADING=$loading start_server "$server" "$tmp/c.textproto" "$tmp/server.log" || exit 1
  grep -i "warmed" "$tmp/server.log" || true
  i=0
  for prompt in "$p1" "$p1" "$p2" "$p2" "$p3" "$w"; do
    s=$(date +%s.%N)
    "$stowctl" --target="$TARGET" generate --prompt="$prompt" --width="$size" --height="$size" --steps="$steps" \
      --guidance=0 --seed=1 --json >"$tmp/reply.json"
    e=$(date +%s.%N)
    python3 - "$tmp/reply.json" "$s" "$e" "$loading" "$i" "${#prompt}" "$machine" >>"$out" <<'PY'
import json, sys
reply, s, e, loading, i, chars, machine = sys.argv[1:]
r = json.load(open(reply))
st = {x["stage"]: float(x["duration"].rstrip("s")) for x in r.get("stages", [])}
print(json.dumps({"bench": "first_request_probe", "module_loading": loading, "seq": int(i), "prompt_chars": int(chars),
                  "wall_s": float(e) - float(s), "encode_prompt_s": st.get("encode_prompt"),
                  "denoise_s": st.get("denoise"), "machine": machine}))
PY
    tail -1 "$out"
    i=$((i + 1))
  done
  stop_server
done
