#!/usr/bin/env bash
# One device call for the compute work: build (CMake with the CUDA kernels, no ctest), the fused ops'
# conformance test (tests/models/fused_ops_test on cuda:0), then the compute benchmark
# (bench/compute_bench.py: diffusers eager, diffusers + torch.compile and Stowage's modes side by side)
# for each model in $MODELS. Results in $OUT: summary.txt, conformance.txt, compute.jsonl,
# compute_<model>.log, profile_<model>.txt (Stowage's kernels by class and name), build_tail.txt
# when the build fails.
#   OUT=$OUT MODELS="zimage flux" deploy/gpu_host/unpack_and_run.sh bash deploy/gpu_host/run_compute_suite.sh
# MODES: Stowage's modes (bf16, bf16_reference, fp8); DIFFUSERS: eager,compile (or eager).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/suite_lib.sh"
suite_build compute
if [ ! -x "$build/bench/offload_bench" ]; then
  grep -B2 -A12 -m8 "error" "$logs/build.log" >"$OUT/build_tail.txt" 2>/dev/null || tail -60 "$logs/build.log" >"$OUT/build_tail.txt"
  stamp "no offload_bench: see build_tail.txt"
  exit 1
fi
stamp "conformance"
timeout 300 "$build/tests/models/fused_ops_test" >"$OUT/conformance.txt" 2>&1
stamp "conformance exit $?"
grep -E "^\[  (PASSED|FAILED|SKIPPED) " "$OUT/conformance.txt" >>"$OUT/summary.txt"
for model in ${MODELS:-zimage flux}; do
  stamp "compute $model"
  timeout "${COMPUTE_TIMEOUT:-480}" python3 bench/compute_bench.py run --arch "$model" --dir "/tmp/compute-$model" \
    --offload_bench "$build/bench/offload_bench" --out "$OUT/compute.jsonl" --machine "$machine" \
    --commit "${STOWAGE_COMMIT:-unknown}" --profile_dir "$OUT" --modes "${MODES:-bf16,bf16_reference,fp8}" \
    --diffusers "${DIFFUSERS:-eager,compile}" >"$OUT/compute_$model.log" 2>&1
  stamp "compute $model exit $?"
done
python3 - "$OUT/compute.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['model']:7s} {r['system']:18s} {r['mode']:5s} {r['path']:13s} step {r['step_s']:.4f} s "
          f"x_limit {r['x_limit']:.2f} rel_l2 {r['rel_l2']:.4g}")
PY
