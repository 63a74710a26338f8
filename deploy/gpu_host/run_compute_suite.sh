#!/usr/bin/env bash
# One device call for the compute work: build (CMake with the CUDA kernels, no ctest), then the parts
# in $PARTS (default "compute"):
#   conformance  the fused ops' conformance test (tests/models/fused_ops_test on cuda:0): conformance.txt
#   compute   the conformance test and the compute
#             benchmark (bench/compute_bench.py: diffusers eager, diffusers + torch.compile and
#             Stowage's modes side by side) for each model in $MODELS: conformance.txt, compute.jsonl,
#             compute_<model>.log, profile_<model>.txt (Stowage's kernels by class and name)
#             (COMPUTE_TRACES=1: and its Kineto traces, trace_<model>_<mode>.json.gz)
#   e2e       the whole Z-Image pipeline (bench/e2e_bench.sh): Stowage bf16 and fp8, diffusers eager
#             and + torch.compile on the same files: e2e.jsonl, e2e.log (E2E_RUNS: Stowage's rows as
#             COMPUTE:FORMAT[:off], e.g. "fp8:png fp8:png:off fp8:png": off without the convolution lane)
#   fidelity  the demo pipeline `shapes` in $FIDELITY_MODES (default float32,bf16,fp8; the streamed
#             compression modes stream_int8, stream_int8_grouped, stream_fp8, stream_int4, fp8_stream_int4;
#             bench/fidelity_bench.py): fidelity.jsonl
#   memory    device memory as nvidia-smi sees it against the budget at load and each reply's
#             peak (bench/memory_truth.sh on real-size random Z-Image): memory.jsonl, memory.log
#   compressed  streamed compression on the full-size synthetic Z-Image block stack (bench/offload_bench
#             --config=full, one process per row): resident (its output the reference), block_pinned
#             (bf16 streamed) and each compressed row ($COMPRESSED_ROWS): compressed.jsonl (commit
#             added to every row), compressed.log; COMPRESSED_PROFILE=1: profile_compressed.txt;
#             COMPRESSED_ARGS: more offload_bench flags for every row (e.g. --compute_priority=high);
#             COMPRESSED_4K_ROWS: rows run again with --pinned_huge_pages=false (cudaHostAlloc's 4 KiB
#             pages instead of huge-page memory registered in place); probes.jsonl: pin_probe,
#             memcpy_probe and widen_probe (what page-locking and copying host memory cost here, and the
#             widening kernels' rate alone)
#   lora      a batch of 8 on the full-size synthetic stack with 0, 1 and 8 different LoRA adapters
#             (offload_bench --batch --lora_adapters): lora.jsonl, lora.log
#   multi     four pipelines under one 24 GiB budget on a seeded Poisson/Zipf trace
#             (bench/multi_tenant.py; MULTI_ARGS adds its flags, e.g. --strategies resident):
#             multi_tenant.jsonl, multi_logs.tgz (placement logs and server logs)
#   multi_diffusers  the same trace's first requests served by diffusers' enable_model_cpu_offload over
#             the four pipelines in one process (bench/multi_tenant_diffusers.py; needs the carried
#             diffusers; MULTI_DIFFUSERS_ARGS adds its flags, e.g. --requests 12 --serve_s 300):
#             multi_tenant_diffusers.jsonl, multi_diffusers.log
#   png       PNG encoding of a 1024x1024 image (bench/png_bench: libpng level 1 beside the parallel
#             writer EncodePng uses, 1 and 8 threads and its default): png.jsonl
#   ctest     every test CMake builds (CTEST_REGEX: only those whose names match it) (ctest -j 4; tests that use the server's default device run on
#             cuda:0): ctest.log, ctest_junit.xml; failures re-run with thread_stack_shim.so when civetweb
#             could not start its threads (build_and_serve.sh says why)
# Results in $OUT (summary.txt too; build_tail.txt when the build fails).
#   OUT=$OUT MODELS="zimage flux" deploy/gpu_host/unpack_and_run.sh bash deploy/gpu_host/run_compute_suite.sh
#   OUT=$OUT PARTS="e2e fidelity" deploy/gpu_host/unpack_and_run.sh bash deploy/gpu_host/run_compute_suite.sh
# MODES: Stowage's compute modes (bf16, bf16_reference, fp8, *_graphs, int8_streamed / int8g_streamed /
# int4_streamed: streamed from a compressed host copy, widened to bf16 on the device; and bf16_streamed / fp8_streamed: the
# transformer group-offloaded block by block, its weights streamed every step); DIFFUSERS: eager,compile (or eager).
# CAPTION_TOKENS: the compute part's caption tokens (default 512; the server's short prompts give ~32).
# SPILL_DIR (a directory on disk): Stowage's compute rows move the host tensors no file holds (FP8 compute's
# converted weights) into a mapped file there first (offload_bench --spill_dir, PipelineConfig.host_spill_dir).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/suite_lib.sh"
suite_build compute
if [ ! -x "$build/bench/offload_bench" ]; then
  grep -B2 -A12 -m8 "error" "$logs/build.log" >"$OUT/build_tail.txt" 2>/dev/null || tail -60 "$logs/build.log" >"$OUT/build_tail.txt"
  stamp "no offload_bench: see build_tail.txt"
  exit 1
fi
# One line per row of a compute or e2e JSON-lines file, into summary.txt too.
summarize() {
  python3 - "$1" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["bench"] == "compute":
        print(f"{r['model']:7s} {r['system']:18s} {r['mode']:5s} {r['path']:13s} batch {r.get('batch', 1)} step {r['step_s']:.4f} s "
              f"x_limit {r['x_limit']:.2f} rel_l2 {r['rel_l2']:.4g} graphs {r.get('cuda_graphs', '-')} "
              f"{r.get('placement', '')} x_floor {r.get('x_floor', '-')}")
    elif r["bench"] == "compressed":
        print(f"{r['model']:7s} compressed {r['row']:18s} step {r['step_s']:.4f} s floor {r['floor_s'] or 0:.4f} "
              f"x_floor {r['x_floor']} x_fast {r['x_fast']} ({r['resident_fast_mode']} {r['resident_fast_step_s']:.4f}) "
              f"rel_l2 {r['rel_l2']:.4g} rss/bf16 {r['rss_above_base_x_bf16']} (warm base {r.get('rss_above_warm_base_x_bf16')}; after preparing {r.get('rss_after_prepare_above_warm_base_x_bf16')}) prepare {r['prepare_s']} (x{r.get('prepare_x_read')} a page-cache read; fp8 {r.get('prepare_fp8_s')} pin {r.get('prepare_pin_alloc_s')} quantize {r.get('prepare_quantize_s')})")
    else:
        print(f"e2e {r['system']:18s} {r.get('mode', 'bf16'):5s} {r.get('format', 'png'):8s} warm {r['warm_s']:.3f} s "
              f"first {r['first_s']:.3f} s png {r.get('png_s', 0):.3f} s load {r.get('load_s', 0):.1f} s")
PY
}
parts=" ${PARTS:-compute} "
if [[ $parts == *" ctest "* ]]; then
  stamp "ctest"
  (cd "$build" && env -u MODES -u MODELS -u DIFFUSERS -u STOWAGE_FRESH OMP_NUM_THREADS=4 timeout "${CTEST_TIMEOUT:-420}" ctest --output-on-failure -j 4 \
    ${CTEST_REGEX:+-R "$CTEST_REGEX"} --output-junit "$OUT/ctest_junit.xml") >"$OUT/ctest.log" 2>&1
  stamp "ctest exit $?: $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
  sed -n '/The following tests FAILED/,$p' "$OUT/ctest.log" >>"$OUT/summary.txt"
  if grep -q 'null context when constructing CivetServer' "$OUT/ctest.log" &&
      gcc -shared -fPIC -O2 -o /tmp/thread_stack_shim.so deploy/gpu_host/thread_stack_shim.c -ldl; then
    (cd "$build" && LD_PRELOAD=/tmp/thread_stack_shim.so OMP_NUM_THREADS=4 timeout 300 ctest --output-on-failure \
      -j 4 --rerun-failed) >"$OUT/ctest_shim.log" 2>&1
    stamp "ctest re-run with the shim exit $?: $(grep -E 'tests passed|tests failed' "$OUT/ctest_shim.log" | tail -1)"
  fi
fi
if [[ $parts == *" compressed "* ]]; then
  stamp "compressed"
  ref=/tmp/compressed_reference.safetensors
  raw=/tmp/compressed_rows.jsonl
  rm -f "$raw"
  # COMPRESSED_PROFILE=1: one more forward of each row under the profiler, summarised (kernels by class,
  # where the GPU and each stream idle) into profile_compressed.txt.
  profile() {
    [ "${COMPRESSED_PROFILE:-0}" = 1 ] && echo "--profile=/tmp/compressed_trace_$1.json"
  }
  timeout 240 "$build/bench/offload_bench" --config=full --rows=resident --warmup=2 --iters=5 --save_output="$ref" \
    --out="$raw" --machine="$machine" $(profile resident) ${COMPRESSED_ARGS:-} >"$OUT/compressed.log" 2>&1
  resident=$(python3 -c "import json,sys; print([json.loads(l) for l in open('$raw')][-1]['step_s'])" 2>/dev/null || echo 0)
  for row in ${COMPRESSED_ROWS:-block_pinned block_int8 block_fp8 block_int8grouped block_int4}; do
    timeout 240 "$build/bench/offload_bench" --config=full --rows="$row" --warmup=2 --iters=5 --reference="$ref" \
      --resident_step_s="$resident" --out="$raw" --machine="$machine" $(profile "$row") ${COMPRESSED_ARGS:-} \
      >>"$OUT/compressed.log" 2>&1
    stamp "compressed $row exit $?"
  done
  # COMPRESSED_4K_ROWS: those rows again with pinned buffers from cudaHostAlloc (4 KiB pages) instead
  # of huge-page memory registered in place (offload_bench --pinned_huge_pages=false; rows whose
  # pinned_huge_pages is false are marked "+4k" in the summary).
  for row in ${COMPRESSED_4K_ROWS:-}; do
    timeout 240 "$build/bench/offload_bench" --config=full --rows="$row" --warmup=2 --iters=5 --reference="$ref" \
      --resident_step_s="$resident" --out="$raw" --machine="$machine" --pinned_huge_pages=false ${COMPRESSED_ARGS:-} \
      >>"$OUT/compressed.log" 2>&1
    stamp "compressed $row (4 KiB pages) exit $?"
  done
  # COMPRESSED_STRIDED_ROWS / COMPRESSED_COALESCED_ROWS: those rows again widened with that thread layout of
  # the kernels (offload_bench --widen_layout; the summary names every CUDA compressed row's layout).
  for layout in strided coalesced; do
    rows_var="COMPRESSED_${layout^^}_ROWS"
    for row in ${!rows_var:-}; do
      timeout 240 "$build/bench/offload_bench" --config=full --rows="$row" --warmup=2 --iters=5 --reference="$ref" \
        --resident_step_s="$resident" --out="$raw" --machine="$machine" --widen_layout=$layout ${COMPRESSED_ARGS:-} \
        >>"$OUT/compressed.log" 2>&1
      stamp "compressed $row ($layout widening) exit $?"
    done
  done
  # What preparing a copy costs on this host, apart: page-locking memory three ways (pinned
  # allocation, written-and-registered 4 KiB pages, huge pages) and multi-threaded memcpy; and the
  # widening kernels alone, against which a streamed step's widening cost is read.
  timeout 120 "$build/bench/offload_bench" --config=full --rows=pin_probe,memcpy_probe,widen_probe --out="$OUT/probes.jsonl" \
    --machine="$machine" >>"$OUT/compressed.log" 2>&1
  stamp "compressed probes exit $?"
  python3 - "$OUT/probes.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("row") != "widen_probe":
        continue
    if r["format"] == "copy":
        print(f"widen_probe copy          -> {r['out']:8s}                          {r['bytes_per_s'] / 1e9:7.1f} GB/s")
    else:
        launches = "shared" if r["shared_launches"] else "one-a-weight"
        print(f"widen_probe {r['format']:13s} -> {r['out']:8s} {launches:12s} {r.get('layout', '?'):9s}"
              f" {r['seconds_per_pass'] * 1e3:7.3f} ms {r['bytes_per_s'] / 1e9:7.1f} GB/s")
PY
  for row in resident ${COMPRESSED_ROWS:-block_pinned block_int8 block_fp8 block_int8grouped block_int4}; do
    [ -f "/tmp/compressed_trace_$row.json" ] &&
      python3 bench/compute_bench.py summarize_trace "/tmp/compressed_trace_$row.json" \
        --out "$OUT/profile_compressed.txt" --title "synthetic stack $row" >/dev/null
  done
  python3 - "$raw" "${STOWAGE_COMMIT:-unknown}" <<'PY' >"$OUT/compressed.jsonl"
import json, sys
for line in open(sys.argv[1]):
    row = json.loads(line)
    row["commit"] = sys.argv[2]
    print(json.dumps(row))
PY
  python3 - "$OUT/compressed.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    name = r['row'] + ("+4k" if r.get("pinned_huge_pages") is False and r.get("device", "").startswith("cuda") else "")
    if r.get("compress", "none") != "none" and r.get("device", "").startswith("cuda"):
        name += "+" + r.get("widen_layout", "?")
    print(f"{name:18s} step {r['step_s']:.4f} s  resident {r.get('resident_step_s', 0):.4f} s  floor {r['floor_s']:.4f} s"
          f"  floor_compressed {r.get('floor_8bit_s', 0):.4f} s  rel_l2 {r.get('rel_l2', 0):.4f}  rss {r['peak_rss_bytes'] / 2**30:.2f} GiB  prepare {r.get('prepare_s', 0):.1f} s (pin {r.get('prepare_pin_alloc_s', 0):.1f}, quantize {r.get('prepare_quantize_s', 0):.1f})"
          f"  weights {r['weight_bytes'] / 2**30:.2f} GiB  base {r.get('base_rss_bytes', 0) / 2**30:.2f}"
          f" / warm {r.get('base_rss_warm_bytes', 0) / 2**30:.2f} / after {r.get('base_rss_after_bytes', 0) / 2**30:.2f} GiB")
PY
fi
if [[ $parts == *" lora "* ]]; then
  # LoRA adapters in one batch: the full-size synthetic stack resident, a batch of 8, with no adapter,
  # one adapter on every row (the uniform path) and 8 different ones (a mixed batch), rank 16 on every
  # Linear; one process per row: lora.jsonl, lora.log.
  stamp "lora"
  raw=/tmp/lora_rows.jsonl
  rm -f "$raw"
  for adapters in 0 1 8; do
    timeout 200 "$build/bench/offload_bench" --config=full --rows=resident --batch=8 --lora_adapters=$adapters \
      --lora_rank=16 --warmup=2 --iters=5 --out="$raw" --machine="$machine" >>"$OUT/lora.log" 2>&1
    stamp "lora adapters=$adapters exit $?"
  done
  python3 - "$raw" "${STOWAGE_COMMIT:-unknown}" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
base = next((r["step_s"] for r in rows if r.get("lora_adapters") == 0), 0)
with open(sys.argv[1].replace(".jsonl", "_out.jsonl"), "w") as out:
    for r in rows:
        r["bench"] = "lora_batch"
        r["commit"] = sys.argv[2]
        r["x_no_adapter"] = r["step_s"] / base if base else 0
        out.write(json.dumps(r) + "\n")
        print(f"lora batch {r['batch']} adapters {r['lora_adapters']:2d} rank {r['lora_rank']} step {r['step_s']:.4f} s"
              f"  x_no_adapter {r['x_no_adapter']:.3f}")
PY
  cp /tmp/lora_rows_out.jsonl "$OUT/lora.jsonl" 2>/dev/null
fi
if [[ $parts == *" compute "* || $parts == *" conformance "* ]]; then
  stamp "conformance"
  timeout 300 "$build/tests/models/fused_ops_test" >"$OUT/conformance.txt" 2>&1
  stamp "conformance exit $?"
  # The captured CUDA graphs against the eager forwards (models/core/step_graphs.h).
  timeout 300 "$build/tests/models/step_graphs_test" >>"$OUT/conformance.txt" 2>&1
  stamp "step graphs exit $?"
  grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/conformance.txt" >>"$OUT/summary.txt"
fi
if [[ $parts == *" compute "* ]]; then
# The spill directory must exist (offload_bench refuses a missing one: session 35's first compute run).
if [ -n "${SPILL_DIR:-}" ]; then mkdir -p "$SPILL_DIR"; fi
for model in ${MODELS:-zimage flux}; do
  stamp "compute $model"
  modes_var="MODES_$model"  # MODES_zimage / MODES_flux: that model's modes instead of $MODES.
  timeout "${COMPUTE_TIMEOUT:-480}" python3 bench/compute_bench.py run --arch "$model" --dir "/tmp/compute-$model" \
    ${SPILL_DIR:+--spill_dir "$SPILL_DIR"} --offload_bench "$build/bench/offload_bench" --out "$OUT/compute.jsonl" --machine "$machine" \
    --commit "${STOWAGE_COMMIT:-unknown}" --profile_dir "$OUT" --modes "${!modes_var:-${MODES:-bf16,bf16_reference,fp8}}" \
    --diffusers "${DIFFUSERS:-eager,compile}" --caption_tokens "${CAPTION_TOKENS:-512}" >"$OUT/compute_$model.log" 2>&1
  stamp "compute $model exit $?"
  # COMPUTE_TRACES=1: Stowage's Kineto traces too (gzipped), for what the profile's summary leaves out.
  if [ "${COMPUTE_TRACES:-0}" = 1 ]; then
    for t in /tmp/compute-"$model"/trace_*.json; do [ -f "$t" ] && gzip -c "$t" >"$OUT/$(basename "$t").gz"; done
  fi
done
summarize "$OUT/compute.jsonl"
fi
if [[ $parts == *" fidelity "* ]]; then
  stamp "fidelity"
  timeout 300 python3 bench/fidelity_bench.py --server "$build/server/stowage_server" \
    --stowctl "$build/clients/stowctl/stowctl" --out "$OUT/fidelity.jsonl" --machine "$machine" \
    --modes "${FIDELITY_MODES:-float32,bf16,fp8}" \
    --commit "${STOWAGE_COMMIT:-unknown}" >>"$OUT/summary.txt" 2>&1
  stamp "fidelity exit $?"
fi
if [[ $parts == *" memory "* ]]; then
  stamp "memory"
  python3 bench/make_zimage_random_dir.py /tmp/e2e-zimage-random --size full >/dev/null
  timeout 420 bash bench/memory_truth.sh "$build/server/stowage_server" "$build/clients/stowctl/stowctl" \
    /tmp/e2e-zimage-random "$OUT/memory.jsonl" "$machine" "${STOWAGE_COMMIT:-unknown}" ${MEMORY_MODES:-} >"$OUT/memory.log" 2>&1
  stamp "memory exit $?"
  cat "$OUT/memory.jsonl" >>"$OUT/summary.txt" 2>/dev/null || true
fi
if [[ $parts == *" e2e "* ]]; then
  # E2E_RANDOM=1: Stowage draws the weights from the configs (no export; diffusers needs the files
  # and is skipped).
  e2e_dir=/tmp/e2e-zimage
  if [ "${E2E_RANDOM:-0}" = 1 ]; then
    e2e_dir=/tmp/e2e-zimage-random
    python3 bench/make_zimage_random_dir.py "$e2e_dir" --size full >/dev/null
    export RANDOM_WEIGHTS=true
  else
    stamp "e2e export"
    [ -f $e2e_dir/model_index.json ] ||
      timeout 300 python3 bench/diffusers_pipeline_bench.py export $e2e_dir >"$OUT/e2e.log" 2>&1
    stamp "e2e export exit $?"
  fi
  for run in ${E2E_RUNS:-bf16:png bf16:png_fast fp8:png_fast}; do
    stamp "e2e stowage $run"
    # COMPUTE:FORMAT, or COMPUTE:FORMAT:off for the VAE's convolutions on the worker's thread (CONV_LANE).
    IFS=: read -r run_compute run_format run_lane <<<"$run"
    COMPUTE=$run_compute FORMAT=$run_format CONV_LANE=${run_lane:-on} timeout 300 bash bench/e2e_bench.sh "$build/server/stowage_server" \
      "$build/clients/stowctl/stowctl" $e2e_dir "$OUT/e2e.jsonl" "$machine" 1024 8 stowage >>"$OUT/e2e.log" 2>&1
    stamp "e2e stowage $run exit $?"
  done
  [ "${E2E_RANDOM:-0}" = 1 ] && E2E_DIFFUSERS=""
  for system in ${E2E_DIFFUSERS-diffusers diffusers_compile}; do
    stamp "e2e $system"
    timeout 300 bash bench/e2e_bench.sh "$build/server/stowage_server" "$build/clients/stowctl/stowctl" \
      /tmp/e2e-zimage "$OUT/e2e.jsonl" "$machine" 1024 8 "$system" >>"$OUT/e2e.log" 2>&1
    stamp "e2e $system exit $?"
  done
  summarize "$OUT/e2e.jsonl"
fi
if [[ $parts == *" multi "* ]]; then
  stamp "multi"
  python3 bench/make_zimage_random_dir.py /tmp/zimage-full --size full >/dev/null
  python3 bench/make_flux_random_dir.py /tmp/flux-full --size full >/dev/null
  mkdir -p "$logs/multi"
  timeout "${MULTI_TIMEOUT:-480}" python3 bench/multi_tenant.py stowage --server "$build/server/stowage_server" \
    --stowctl "$build/clients/stowctl/stowctl" --zimage /tmp/zimage-full --flux /tmp/flux-full \
    --out "$OUT/multi_tenant.jsonl" --logs "$logs/multi" --machine "$machine" --commit "${STOWAGE_COMMIT:-unknown}" \
    ${MULTI_ARGS:-} >"$logs/multi/bench.txt" 2>&1
  stamp "multi exit $?"
  tail -40 "$logs/multi/bench.txt" >>"$OUT/summary.txt"
  tar czf "$OUT/multi_logs.tgz" -C "$logs" multi 2>/dev/null
fi
if [[ $parts == *" png "* ]]; then
  stamp "png"
  "$build/bench/png_bench" --iters=21 --threads=1,8,0 --machine="$machine" --commit="${STOWAGE_COMMIT:-unknown}" \
    --out="$OUT/png.jsonl" >"$OUT/png.log" 2>&1
  stamp "png exit $?"
  cut -c1-120 "$OUT/png.jsonl" >>"$OUT/summary.txt"
fi
if [[ $parts == *" multi_diffusers "* ]]; then
  stamp "multi_diffusers"
  timeout "${MULTI_DIFFUSERS_TIMEOUT:-480}" python3 bench/multi_tenant_diffusers.py \
    --out "$OUT/multi_tenant_diffusers.jsonl" --machine "$machine" --commit "${STOWAGE_COMMIT:-unknown}" \
    ${MULTI_DIFFUSERS_ARGS:-} >"$OUT/multi_diffusers.log" 2>&1
  stamp "multi_diffusers exit $?"
  tail -8 "$OUT/multi_diffusers.log" >>"$OUT/summary.txt"
fi
