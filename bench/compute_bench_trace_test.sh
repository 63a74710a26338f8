#!/usr/bin/env bash
# bench/compute_bench.py summarize_trace on a synthetic Kineto trace: kernel time by class, and the idle
# analysis (busy union over streams, host-bound vs device-side gaps, the largest gaps named); run refuses a
# --caption_tokens outside 1..4096.
set -euo pipefail
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 - "$TEST_TMPDIR/trace.json" <<'PY'
import json, sys
k = lambda name, ts, dur, corr, stream=7: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                                           "args": {"correlation": corr, "stream": stream}}
launch = lambda ts, corr: {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 3,
                           "args": {"correlation": corr}}
events = [
    {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "ts": -40, "dur": 340},  # host: 50 us before, 40 after
    {"ph": "X", "cat": "cpu_op", "name": "aten::arange", "ts": -30, "dur": 25},   # inside it, before the GPU starts
    launch(0, 1), k("nvjet_gemm_a", 10, 100, 1),        # busy 10..110
    launch(20, 2), k("RmsNormKernel", 130, 20, 2),      # queued early: 20 us device-side gap
    launch(5, 3), k("elementwise_b", 140, 30, 3, 9),       # overlaps on another stream: busy to 170
    launch(200, 4), k("sdpa_flash_fprop", 205, 50, 4),  # launched after the GPU went idle at 170: 35 us host
    {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 258, "dur": 2, "args": {}},  # 3 us, no launch known
]
json.dump({"traceEvents": events}, open(sys.argv[1], "w"))
PY
/usr/bin/python3 "$scripts/compute_bench.py" summarize_trace "$TEST_TMPDIR/trace.json" --out "$TEST_TMPDIR/profile.txt" \
  --title synthetic >/dev/null
cat "$TEST_TMPDIR/profile.txt"
grep -q '^# synthetic: 4 kernels, 0.20 ms of kernel time' "$TEST_TMPDIR/profile.txt"
grep -q '^gemm .* 1 launches  *0.10 ms' "$TEST_TMPDIR/profile.txt"
grep -q '^attention .* 1 launches  *0.05 ms' "$TEST_TMPDIR/profile.txt"
# Span 10..260 = 250 us; busy 100 + 40 + 50 + 2 = 192; idle 58: host 35, device 20 + 3.
grep -q '^span 0.25 ms: GPU busy 0.19 ms, idle 0.06 ms (host-bound 0.04 ms, device-side 0.02 ms) in 3 gaps, 0.00 ms of them in gaps under 10 us' \
  "$TEST_TMPDIR/profile.txt"
grep -q '^host before the first GPU activity 0.05 ms, after the last 0.04 ms' "$TEST_TMPDIR/profile.txt"
# What the host ran in those 50 us: in order from the first host event, then the longest there (the
# parent's time up to the first GPU activity, 50 us; the arange's 25 us; a launch's 3 us).
grep -A3 '^host events before the first GPU activity, in order:' "$TEST_TMPDIR/profile.txt" >"$TEST_TMPDIR/early.txt"
sed -n 2p "$TEST_TMPDIR/early.txt" | grep -q '+  0.000 ms   0.340 ms cpu_op  *aten::linear'
sed -n 3p "$TEST_TMPDIR/early.txt" | grep -q '+  0.010 ms   0.025 ms cpu_op  *aten::arange'
sed -n 4p "$TEST_TMPDIR/early.txt" | grep -q '+  0.040 ms   0.003 ms cuda_runtime  *cudaLaunchKernel'
grep -A3 '^  longest there:' "$TEST_TMPDIR/profile.txt" >"$TEST_TMPDIR/longest.txt"
sed -n 2p "$TEST_TMPDIR/longest.txt" | grep -q '^    0.050 ms cpu_op  *aten::linear'
sed -n 3p "$TEST_TMPDIR/longest.txt" | grep -q '^    0.025 ms cpu_op  *aten::arange'
grep -A1 '^largest gaps:' "$TEST_TMPDIR/profile.txt" | grep -q '35.0 us host   elementwise_b -> sdpa_flash_fprop'
grep -q '20.0 us device nvjet_gemm_a -> RmsNormKernel' "$TEST_TMPDIR/profile.txt"
# Stream 7: gemm 10..110, norm 130..150, attention 205..255: 170 us of kernels in a 245 us span, idle
# 20 us device-side (the norm was queued) and 55 us host-bound (the attention launched at 200 > 150).
grep -q '^stream 7: 3 kernels, 0.17 ms of kernel time in a 0.24 ms span; idle host-bound 0.06 ms, device-side 0.02 ms' \
  "$TEST_TMPDIR/profile.txt"
grep -q '^stream 9: 1 kernels, 0.03 ms of kernel time in a 0.03 ms span; idle host-bound 0.00 ms, device-side 0.00 ms' \
  "$TEST_TMPDIR/profile.txt"
# run --caption_tokens outside 1..4096 is refused before anything loads (no torch needed).
for bad in 0 4097; do
  if /usr/bin/python3 "$scripts/compute_bench.py" run --arch zimage --dir "$TEST_TMPDIR/none" --offload_bench none --out "$TEST_TMPDIR/o.jsonl" \
      --caption_tokens "$bad" 2>"$TEST_TMPDIR/err.txt"; then
    echo "--caption_tokens $bad was accepted" >&2; exit 1
  fi
  grep -q -- "--caption_tokens must be 1..4096, not $bad" "$TEST_TMPDIR/err.txt"
done
echo ok
