#!/usr/bin/env bash
# bench/trace_gaps.py on a synthetic Kineto trace: a link gap where the host issued the next DMA late,
# one where the DMA was issued in time and waited on an event, the compute stream's gaps, and the host
# tensor operations counted.
set -euo pipefail
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 - "$TEST_TMPDIR/trace.json" <<'PY'
import json, sys
def copy(ts, dur, corr, nbytes=1000):
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"stream": 13, "correlation": corr, "bytes": nbytes}}
def call(ts, dur, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": ts, "dur": dur,
            "args": {"correlation": corr}}
def kernel(ts, dur, stream=7, name="gemm"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}
events = [
    call(0, 2, 1), copy(10, 100, 1),            # link busy 10..110
    call(300, 5, 2), copy(306, 100, 2),         # issued at 305, after the link went idle at 110: host late, 196 us
    call(320, 5, 3), copy(700, 100, 3),         # issued at 325, started at 700: waited on an event, 294 us
    kernel(0, 400), kernel(450, 100), kernel(560, 300),  # compute: gaps of 50 and 10 us
    kernel(100, 40, stream=17, name="widen"),
    {"ph": "X", "cat": "cpu_op", "name": "aten::narrow", "ts": 0, "dur": 1},
    {"ph": "X", "cat": "cpu_op", "name": "aten::narrow", "ts": 2, "dur": 1},
    {"ph": "X", "cat": "cpu_op", "name": "aten::view", "ts": 4, "dur": 1},
]
json.dump({"traceEvents": events}, open(sys.argv[1], "w"))
PY
out=$(/usr/bin/python3 "$scripts/trace_gaps.py" "$TEST_TMPDIR/trace.json" --min_gap_us 30)
echo "$out"
grep -q 'stream 13: 3 copies, 0.000 GB, busy 0.3 ms' <<<"$out"
grep -q 'link idle     196 us at    0.31 ms: host late' <<<"$out"
grep -q 'link idle     294 us at    0.70 ms: event' <<<"$out"
grep -q 'host late 0.2 ms, waiting on an event 0.3 ms' <<<"$out"
grep -q 'compute idle      50 us at    0.45 ms before gemm' <<<"$out"
! grep -q 'compute idle      10 us' <<<"$out"
grep -q 'compute stream 7: 3 kernels, busy 0.8 ms of a 0.9 ms span; idle in gaps over 30 us: 0.1 ms' <<<"$out"
grep -q 'stream 17: 1 kernels, busy 0.0 ms' <<<"$out"
grep -q 'host tensor operations: 3; most: aten::narrow 2, aten::view 1' <<<"$out"
# A file without kernels is refused with a message, not a trace-back.
echo '{"traceEvents": []}' >"$TEST_TMPDIR/empty.json"
if msg=$(/usr/bin/python3 "$scripts/trace_gaps.py" "$TEST_TMPDIR/empty.json" 2>&1); then
  echo "an empty trace was accepted" >&2
  exit 1
fi
grep -q 'no kernels' <<<"$msg"
echo ok
