#!/usr/bin/env bash
# Device calls for the multi-GPU benchmark (issue 13) on a host with two GPUs (the two-GPU kind).
# Builds with CMake when the build is missing or stale (deploy/gpu_host/build_and_serve.sh, tests
# skipped), writes Z-Image's full-shape configs to /tmp/zimage-full (bench/make_zimage_random_dir.py
# --size full; weights are drawn at load, random_weights: true), checks that two CUDA devices are
# visible, then runs bench/multi_gpu.sh at 1024x1024, 8 steps, bf16, closed-loop clients:
# one device, two replicas, and the split layout (text encoder on cuda:1) -> $OUT/multi_gpu.jsonl
#   {"bench":"multi_gpu","gpus":1|2,"layout":"replicas"|"split",..,"images_per_s":..,"p50_s":..,
#    "peak_device_bytes":[..],"machine":..}
# Targets (issue 13): two replicas >= 1.9x the images/s of one; the split layout's larger device
# peak below the one-device peak.
# Device calls: deploy/gpu_host/prepare_carry.sh here (prints the carry list: .ref/head.tgz, .ref/head.rev,
# .ref/diffusers_slim.tgz, .deb), then on the device deploy/gpu_host/unpack_and_run.sh runs this suite in
# the unpacked commit (reusing its build on a warm machine):
#   OUT=$OUT deploy/gpu_host/unpack_and_run.sh bash deploy/gpu_host/run_multi_gpu_suite.sh
# Environment: CONCURRENCY (default 1,2,4), REQUESTS per row (16), LAYOUTS ("single replicas
# split"), SPLIT (components on cuda:1, default text_encoder), MULTI_GPU_TIMEOUT (seconds, 900).
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/suite_lib.sh"

gpus=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
  stamp "this host shows $gpus GPU(s); the multi-GPU benchmark needs two (ask for the two-GPU kind)"
  exit 2
fi

suite_build mg
if [ ! -x "$build/bench/multi_gpu_bench" ]; then
  stamp "no $build/bench/multi_gpu_bench: the build failed ($logs/build.txt)"
  tail -30 "$logs/build.txt" >>"$OUT/summary.txt"
  exit 1
fi

python3 bench/make_zimage_random_dir.py /tmp/zimage-full --size full >/dev/null
stamp "multi_gpu"
timeout "${MULTI_GPU_TIMEOUT:-900}" bash bench/multi_gpu.sh "$build/server/stowage_server" \
  "$build/bench/multi_gpu_bench" /tmp/zimage-full "$OUT/multi_gpu.jsonl" 1024 8 "$machine" bfloat16 \
  "${CONCURRENCY:-1,2,4}" "${REQUESTS:-16}" cuda >"$OUT/multi_gpu.txt" 2>&1
stamp "multi_gpu exit $?"
cat "$OUT/multi_gpu.txt" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
