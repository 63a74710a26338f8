#!/usr/bin/env python3
"""What the GPU's clocks, power and temperature were during each benchmark row.

  nvidia-smi --query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \\
      --format=csv,noheader,nounits -lms 500 | python3 bench/gpu_clocks.py stamp > samples.csv
      (each sample line prefixed with the Unix time it was read: "unix_s,sm_mhz,mem_mhz,power_w,temp_c,reasons")
  python3 bench/gpu_clocks.py join samples.csv rows.jsonl
      for each JSON row with started_unix_s / ended_unix_s (bench/load_bench.cc), the samples inside its
      span: mean and minimum SM clock, mean memory clock, mean and maximum power, maximum temperature and
      the throttle reasons seen (nvidia-smi's bit mask, OR'ed over the samples); a row without samples
      says so. One line a row, labelled by its mode, compress and concurrency.

Why: two rows of one benchmark compare only when the GPU ran them at the same clocks; a long run under a
power cap or hot can be slower for that alone (the batching benchmark's streamed rows run after the
resident ones).
"""
import json
import sys
import time


def stamp(inp, out):
    for line in inp:
        line = line.strip()
        if line:
            out.write(f"{time.time():.3f},{line}\n")
            out.flush()


def number(text):
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def read_samples(path):
    samples = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            parts = [p.strip() for p in line.strip().split(",")]
            if len(parts) != 6:
                raise SystemExit(f"{path}:{n}: expected 6 fields (unix_s and the 5 queried), got {len(parts)}: {line.strip()!r}")
            t = number(parts[0])
            if t is None:
                raise SystemExit(f"{path}:{n}: the time {parts[0]!r} is not a number")
            reasons = int(parts[5], 16) if parts[5].lower().startswith("0x") else 0
            samples.append(dict(t=t, sm=number(parts[1]), mem=number(parts[2]), power=number(parts[3]),
                                temp=number(parts[4]), reasons=reasons))
    return samples


def summarize(samples, start, end):
    inside = [s for s in samples if start <= s["t"] <= end]
    if not inside:
        return None

    def values(key):
        return [s[key] for s in inside if s[key] is not None]

    def mean(v):
        return round(sum(v) / len(v), 1) if v else None

    sm, mem, power, temp = values("sm"), values("mem"), values("power"), values("temp")
    reasons = 0
    for s in inside:
        reasons |= s["reasons"]
    return dict(samples=len(inside), sm_mhz_mean=mean(sm), sm_mhz_min=min(sm) if sm else None,
                mem_mhz_mean=mean(mem), power_w_mean=mean(power), power_w_max=max(power) if power else None,
                temp_c_max=max(temp) if temp else None, throttle_reasons=f"0x{reasons:x}")


def join(samples_path, rows_path):
    samples = read_samples(samples_path)
    with open(rows_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        label = f"{r.get('mode', '?')}/{r.get('compress', '?')} N={r.get('concurrency', '?')}"
        if "started_unix_s" not in r or "ended_unix_s" not in r:
            print(f"{label}: no started_unix_s / ended_unix_s in the row")
            continue
        s = summarize(samples, r["started_unix_s"], r["ended_unix_s"])
        if s is None:
            print(f"{label}: no GPU samples inside the row's span")
            continue
        print(f"{label}: " + " ".join(f"{k} {v}" for k, v in s.items()))


def main(argv):
    if len(argv) == 2 and argv[1] == "stamp":
        stamp(sys.stdin, sys.stdout)
    elif len(argv) == 4 and argv[1] == "join":
        join(argv[2], argv[3])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
