#!/usr/bin/env bash
# Device calls for the throughput benchmarks (bench/results/throughput_h200/). Builds with CMake
# when the build is missing or stale (deploy/gpu_host/build_and_serve.sh, tests skipped), then runs
# the parts named in PARTS (default "e2e batching"):
#   e2e       bench/e2e_bench.sh: diffusers exports a full-shape random-weights Z-Image pipeline to
#             /tmp/zimage-e2e (once per machine), then Stowage's server and diffusers' ZImagePipeline
#             run it resident, 1024x1024, 8 steps -> $OUT/e2e.jsonl
#   e2e_random  bench/e2e_bench.sh, Stowage only, weights drawn from /tmp/zimage-full's configs
#             -> $OUT/e2e_random.jsonl
#   probe     bench/first_request_probe.sh: first uses of new prompt lengths, lazy vs eager CUDA
#             module loading -> $OUT/first_request_probe.jsonl
#   equivalence  bench/batch_equivalence: four requests as one batch vs each alone, bf16 on CUDA
#             (the issue's "within one 8-bit level") -> $OUT/batch_vs_alone.jsonl
#   overlap   bench/overlap.sh on /tmp/zimage-full: every component group-offloaded, cross-component
#             prefetch off and on -> $OUT/overlap.jsonl
#   batching  bench/batching.sh on /tmp/zimage-full (random weights from configs), resident and
#             streamed, batching off and on, N = 1, 2, 4, 8 -> $OUT/batching.jsonl; the GPU's clocks, power
#             and temperature sampled beside it (gpu_samples.csv) and joined with each row (gpu_clocks.txt)
# Carry .deb (deploy/gpu_host/fetch_debs.sh) and .ref/diffusers/src (git-ignored):
#   OUT=... PARTS="e2e" deploy/gpu_host/run_throughput_suite.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/suite_lib.sh"
source "$repo_root/bench/serve_lib.sh"

suite_build tp

# Z-Image at its published shapes, configs only (random weights are drawn from them).
full_shapes_dir() { python3 bench/make_zimage_random_dir.py /tmp/zimage-full --size full >/dev/null; }

for part in ${PARTS:-e2e batching}; do
  case $part in
    e2e)
      if [ ! -f /tmp/zimage-e2e/model_index.json ]; then
        stamp "export"
        timeout 300 python3 bench/diffusers_pipeline_bench.py export /tmp/zimage-e2e >"$OUT/export.txt" 2>&1
        stamp "export exit $?"
      fi
      stamp "e2e"
      LOAD_BENCH="$build/bench/load_bench" timeout "${E2E_TIMEOUT:-300}" bash bench/e2e_bench.sh "$build/server/stowage_server" \
        "$build/clients/stowctl/stowctl" /tmp/zimage-e2e "$OUT/e2e.jsonl" "$machine" 1024 8 \
        "${E2E_SYSTEMS:-stowage diffusers}" >"$OUT/e2e.txt" 2>&1
      stamp "e2e exit $?"
      tail -4 "$OUT/e2e.txt" >>"$OUT/summary.txt"
      ;;
    batching)
      full_shapes_dir
      # The GPU's clocks, power and temperature every 500 ms beside the rows (nvidia-smi's own log file,
      # its timestamps), joined with each row's span after (bench/gpu_clocks.py): gpu_clocks.txt.
      rm -f "$OUT/gpu_samples.csv" "$OUT/gpu_clocks.txt"
      sampler=""
      if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
          --format=csv,noheader,nounits -lms 500 -f "$OUT/gpu_samples.csv" 2>"$OUT/gpu_samples.err" &
        sampler=$!
        trap '[ -n "$sampler" ] && kill "$sampler" 2>/dev/null' EXIT
      fi
      stamp "batching"
      STOWCTL="$build/clients/stowctl/stowctl" PLACEMENT_DIR="$OUT/batching_placement" \
        timeout "${BATCHING_TIMEOUT:-480}" bash bench/batching.sh "$build/server/stowage_server" \
        "$build/bench/load_bench" /tmp/zimage-full "$OUT/batching.jsonl" 1024 8 "$machine" bfloat16 \
        "${CONCURRENCY:-1,2,4,8}" "${BATCH_SIZES:-1,8}" "${PER_CLIENT:-2}" "${MIN_REQUESTS:-4}" \
        >"$OUT/batching.txt" 2>&1
      stamp "batching exit $?"
      if [ -n "$sampler" ]; then
        kill "$sampler" 2>/dev/null; wait "$sampler" 2>/dev/null
        sampler=""
        python3 bench/gpu_clocks.py join "$OUT/gpu_samples.csv" "$OUT/batching.jsonl" >"$OUT/gpu_clocks.txt" 2>&1
      fi
      cat "$OUT/batching.txt" >>"$OUT/summary.txt"
      if [ -f "$OUT/gpu_clocks.txt" ]; then cat "$OUT/gpu_clocks.txt" >>"$OUT/summary.txt"; fi
      # Each mode's streamed transformer: forwards, prefetches, copies waited for, prefetches skipped.
      for f in "$OUT"/batching_placement/*.placement.json; do
        [ -f "$f" ] || continue
        python3 - "$f" <<'PY' >>"$OUT/summary.txt" 2>&1
import json, os, sys
placement = json.load(open(sys.argv[1]))
for c in placement["components"]:
    g = c.get("groupOffload")
    if g and int(g.get("forwards", 0)) > 0:
        print(os.path.basename(sys.argv[1]), c["id"], " ".join(
            f"{k} {g.get(k, 0)}" for k in ("forwards", "prefetches", "syncOnloads", "prefetchesSkippedAfterLast")))
PY
      done
      ;;
    e2e_random)
      full_shapes_dir
      stamp "e2e (Stowage, random weights)"
      LOAD_BENCH="$build/bench/load_bench" RANDOM_WEIGHTS=true timeout "${E2E_TIMEOUT:-300}" bash bench/e2e_bench.sh "$build/server/stowage_server" \
        "$build/clients/stowctl/stowctl" /tmp/zimage-full "$OUT/e2e_random.jsonl" "$machine" 1024 8 stowage \
        >"$OUT/e2e_random.txt" 2>&1
      stamp "e2e_random exit $?"
      tail -2 "$OUT/e2e_random.txt" >>"$OUT/summary.txt"
      ;;
    probe)
      full_shapes_dir
      stamp "first-request probe"
      timeout "${PROBE_TIMEOUT:-200}" bash bench/first_request_probe.sh "$build/server/stowage_server" \
        "$build/clients/stowctl/stowctl" /tmp/zimage-full "$OUT/first_request_probe.jsonl" "$machine" 1024 8 \
        >"$OUT/first_request_probe.txt" 2>&1
      stamp "probe exit $?"
      ;;
    equivalence)
      full_shapes_dir
      stamp "batch vs alone"
      cat >/tmp/equivalence.textproto <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
auth { admin_token: "t" }
pipelines { name: "zimage" model_dir: "/tmp/zimage-full" random_weights: true dtype: "bfloat16" }
CFG
      if start_server "$build/server/stowage_server" /tmp/equivalence.textproto "$OUT/equivalence_server.log"; then
        timeout "${EQUIVALENCE_TIMEOUT:-150}" "$build/bench/batch_equivalence" --target="$TARGET" --token=t \
          --members=4 --size=1024 --steps=8 --machine="$machine" --out="$OUT/batch_vs_alone.jsonl" \
          >"$OUT/equivalence.txt" 2>&1
        stamp "equivalence exit $?"
        stop_server
      fi
      cat "$OUT/equivalence.txt" >>"$OUT/summary.txt"
      ;;
    overlap)
      full_shapes_dir
      stamp "overlap"
      timeout "${OVERLAP_TIMEOUT:-200}" bash bench/overlap.sh "$build/server/stowage_server" \
        "$build/clients/stowctl/stowctl" /tmp/zimage-full "$OUT/overlap.jsonl" "$machine" 1024 8 \
        >"$OUT/overlap.txt" 2>&1
      stamp "overlap exit $?"
      cat "$OUT/overlap.txt" >>"$OUT/summary.txt"
      ;;
  esac
done
cat "$OUT/summary.txt"
