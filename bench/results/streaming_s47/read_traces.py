"""Reads session 47's committed Kineto traces (this folder's trace_*.json.gz):
1. per trace, what the host did before the step's first GPU activity — the profiler's own "overhead"
   events (CUPTI's activity-buffer requests) against the first op's span;
2. in Z-Image's FP8 int4 trace, the int4-into-e4m3 widening launches (WidenTiles): their count and
   kernel time, how much of them overlaps other kernels, and for launches that overlap nothing, their
   duration and rate by grid size (int4 codes read: 0.5 byte a value, e4m3 written: 1 byte a value;
   the group scales, 1/16 byte a value, are left out).
   python3 bench/results/streaming_s47/read_traces.py > bench/results/streaming_s47/read_traces.txt
"""
import bisect
import collections
import glob
import gzip
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def events(path):
    trace = json.load(gzip.open(path))
    return sorted((e for e in trace["traceEvents"] if e.get("ph") == "X"), key=lambda e: e["ts"])


for path in sorted(glob.glob(os.path.join(HERE, "trace_*.json.gz"))):
    ev = events(path)
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    first_gpu = gpu[0]["ts"]
    first_op = next(e for e in ev if e.get("cat") == "cpu_op")
    overhead = [e for e in ev if e.get("cat") == "overhead" and e["ts"] < first_gpu]
    print(f"{os.path.basename(path)}: first op {first_op['name']} at its start, the first GPU activity "
          f"{(first_gpu - first_op['ts']) / 1000:.2f} ms later; profiler overhead before it: "
          + ", ".join(f"{e['name']} {e['dur'] / 1000:.2f} ms" for e in overhead))

ev = events(os.path.join(HERE, "trace_zimage_fp8_int4_streamed_d4.json.gz"))
kernels = [e for e in ev if e.get("cat") == "kernel"]
widen = [e for e in kernels if "WidenTiles" in e["name"]]
others = [e for e in kernels if "WidenTiles" not in e["name"]]
starts = [e["ts"] for e in others]


def overlap(e):
    a, b = e["ts"], e["ts"] + e["dur"]
    total = 0.0
    for o in others[max(0, bisect.bisect_left(starts, a - 5000) - 5):]:
        if o["ts"] > b:
            break
        total += max(0.0, min(b, o["ts"] + o["dur"]) - max(a, o["ts"]))
    return total


print(f"\nWidenTiles launches {len(widen)}, kernel time {sum(e['dur'] for e in widen) / 1000:.2f} ms, "
      f"overlapping other kernels {sum(overlap(e) for e in widen) / 1000:.2f} ms of it")
by_grid = collections.defaultdict(list)
for e in widen:
    by_grid[e["args"]["grid"][0]].append(e)
for grid, launches in sorted(by_grid.items()):
    alone = [e["dur"] for e in launches if overlap(e) < 0.05 * e["dur"]]
    # 256 threads a block, 4 chunks of 8 values a thread.
    values = grid * 256 * 4 * 8
    line = f"  grid {grid}: {len(launches)} launches (up to {values / 1e6:.1f} M values each)"
    if alone:
        mean = sum(alone) / len(alone)
        line += f", {len(alone)} overlapping nothing: {mean:.1f} us, {1.5 * values / (mean * 1e-6) / 1e12:.2f} TB/s"
    print(line)
