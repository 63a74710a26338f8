"""Where a streamed step's copies and compute wait, from one profiled step's Chrome trace (the JSON
offload_bench --profile writes; gzip accepted).

    python3 bench/trace_gaps.py TRACE.json[.gz] [--min_gap_us 30]

Prints, for the host-to-device copies (the link), each idle gap between two DMAs longer than
--min_gap_us and why the next DMA started late:
  host late  the host's cudaMemcpyAsync call ended after the previous DMA had finished: the link
             waited for the host to issue it (host-bound);
  event      the call was issued in time: the copy stream waited for an event (a scratch area or a
             slot still in use);
then the compute stream's (the stream with the most kernels) gaps longer than --min_gap_us, and the
host's tensor operations per step by name (the bookkeeping a streamed step adds shows up there).
"""
import argparse
import collections
import gzip
import json


def load(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--min_gap_us", type=float, default=30.0)
    args = parser.parse_args()
    events = load(args.trace)
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    calls = {e["args"].get("correlation"): e for e in events if e.get("cat") == "cuda_runtime"}
    if not kernels:
        raise SystemExit(f"{args.trace}: no kernels")
    t0 = min(e["ts"] for e in copies + kernels)

    by_stream = collections.defaultdict(list)
    for e in copies:
        by_stream[(e["name"], e["args"]["stream"])].append(e)
    for (name, stream), items in sorted(by_stream.items()):
        total = sum(e["args"]["bytes"] for e in items)
        busy = sum(e["dur"] for e in items)
        print(f"{name} stream {stream}: {len(items)} copies, {total / 1e9:.3f} GB, busy {busy / 1e3:.1f} ms"
              + (f", {total / busy / 1e3:.1f} GB/s while busy" if busy else ""))

    h2d = sorted((e for e in copies if "HtoD" in e["name"]), key=lambda e: e["ts"])
    gaps = {"host late": 0.0, "event": 0.0}
    for prev, cur in zip(h2d, h2d[1:]):
        gap = cur["ts"] - (prev["ts"] + prev["dur"])
        if gap <= args.min_gap_us:
            continue
        call = calls.get(cur["args"].get("correlation"))
        late = call is not None and call["ts"] + call["dur"] > prev["ts"] + prev["dur"]
        kind = "host late" if late else "event"
        gaps[kind] += gap
        print(f"  link idle {gap:7.0f} us at {(cur['ts'] - t0) / 1e3:7.2f} ms: {kind}")
    print(f"link idle in gaps over {args.min_gap_us:.0f} us: host late {gaps['host late'] / 1e3:.1f} ms, "
          f"waiting on an event {gaps['event'] / 1e3:.1f} ms")

    counts = collections.Counter(e["args"]["stream"] for e in kernels)
    compute = counts.most_common(1)[0][0]
    on_compute = [e for e in kernels if e["args"]["stream"] == compute]
    idle = 0.0
    for prev, cur in zip(on_compute, on_compute[1:]):
        gap = cur["ts"] - (prev["ts"] + prev["dur"])
        if gap > args.min_gap_us:
            idle += gap
            print(f"  compute idle {gap:7.0f} us at {(cur['ts'] - t0) / 1e3:7.2f} ms before {cur['name'][:70]}")
    span = on_compute[-1]["ts"] + on_compute[-1]["dur"] - t0
    busy = sum(e["dur"] for e in on_compute)
    print(f"compute stream {compute}: {len(on_compute)} kernels, busy {busy / 1e3:.1f} ms of a {span / 1e3:.1f} ms "
          f"span; idle in gaps over {args.min_gap_us:.0f} us: {idle / 1e3:.1f} ms")
    for stream, n in sorted(counts.items()):
        if stream != compute:
            other = [e for e in kernels if e["args"]["stream"] == stream]
            print(f"stream {stream}: {n} kernels, busy {sum(e['dur'] for e in other) / 1e3:.1f} ms")

    ops = collections.Counter(e["name"] for e in events if e.get("cat") == "cpu_op")
    print(f"host tensor operations: {sum(ops.values())}; most: "
          + ", ".join(f"{name} {n}" for name, n in ops.most_common(6)))


if __name__ == "__main__":
    main()
