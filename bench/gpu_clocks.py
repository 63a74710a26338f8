#!/usr/bin/env python3
"""What the GPU's clocks, power and temperature were during each benchmark row.

  nvidia-smi -i 0 --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \\
      --format=csv,noheader,nounits -lms 500 -f samples.csv      (beside the benchmark; stopped after it)
  python3 bench/gpu_clocks.py join samples.csv rows.jsonl
      for each JSON row with started_unix_s / ended_unix_s (bench/load_bench.cc), the samples inside its
      span: mean and minimum SM clock, the mean SM clock of the busy samples (those not flagged GpuIdle),
      mean memory clock, mean and maximum power, the share of samples under the software power cap
      (SwPowerCap), maximum temperature and the throttle reasons seen (nvidia-smi's bit mask, OR'ed over the samples, by name; "GpuIdle" left
      out: a closed loop idles between batches). One line a row, labelled by its mode, compress, batch
      setting and concurrency; a row without a span or without samples says so.

nvidia-smi's timestamp is the machine's local time ("2026/12/06 16:40:01.123"), read here in the same
time zone as the rows' Unix times (run both on one machine). Lines that do not parse (the last one when
nvidia-smi is stopped mid-write, "[N/A]" times) are skipped and counted on stderr; no sample at all is an
error.

Why: two rows of one benchmark compare only when the GPU ran them at the same clocks; a long run under a
power cap or hot can be slower for that alone (the batching benchmark runs its modes one after another).
"""
import datetime
import json
import sys

# nvidia-smi's clocks_throttle_reasons bits (nvml.h, nvmlClocksEventReasons).
REASONS = [(0x1, "GpuIdle"), (0x2, "ApplicationsClocksSetting"), (0x4, "SwPowerCap"), (0x8, "HwSlowdown"),
           (0x10, "SyncBoost"), (0x20, "SwThermalSlowdown"), (0x40, "HwThermalSlowdown"),
           (0x80, "HwPowerBrakeSlowdown"), (0x100, "DisplayClockSetting")]


def number(text):
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def unix_time(text):
    return datetime.datetime.strptime(text, "%Y/%m/%d %H:%M:%S.%f").timestamp()


def read_samples(path):
    samples, skipped = [], []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = [p.strip() for p in line.strip().split(",")]
            try:
                if len(parts) != 6:
                    raise ValueError(f"{len(parts)} fields, not 6")
                t = unix_time(parts[0])
                reasons = int(parts[5], 16) if parts[5].lower().startswith("0x") else None
            except ValueError as e:
                skipped.append(f"{path}:{n}: {e}: {line.strip()!r}")
                continue
            samples.append(dict(t=t, sm=number(parts[1]), mem=number(parts[2]), power=number(parts[3]),
                                temp=number(parts[4]), reasons=reasons))
    for s in skipped[:5]:
        print(f"skipped {s}", file=sys.stderr)
    if len(skipped) > 5:
        print(f"skipped {len(skipped) - 5} more lines", file=sys.stderr)
    if not samples:
        raise SystemExit(f"{path}: no sample parses ({len(skipped)} lines skipped)")
    return samples


def reason_names(mask):
    names = [name for bit, name in REASONS if mask & bit and bit != 0x1]
    unknown = mask & ~sum(bit for bit, _ in REASONS)
    if unknown:
        names.append(f"0x{unknown:x}")
    return "+".join(names) or "none"


def summarize(samples, start, end):
    inside = [s for s in samples if start <= s["t"] <= end]
    if not inside:
        return None

    def values(key):
        return [s[key] for s in inside if s[key] is not None]

    def mean(v):
        return round(sum(v) / len(v), 1) if v else None

    sm, mem, power, temp = values("sm"), values("mem"), values("power"), values("temp")
    known = [s["reasons"] for s in inside if s["reasons"] is not None]
    mask = 0
    for r in known:
        mask |= r
    reasons = reason_names(mask) if known else "?"
    if known and len(known) < len(inside):
        reasons += f" ({len(inside) - len(known)} samples unknown)"
    # Busy: samples whose reasons are known and do not say GpuIdle (a closed loop idles between batches,
    # at the highest clocks, which would lift a plain mean).
    busy_sm = [s["sm"] for s in inside if s["reasons"] is not None and not s["reasons"] & 0x1 and s["sm"] is not None]
    capped = round(sum(1 for r in known if r & 0x4) / len(known), 2) if known else None
    return dict(samples=len(inside), sm_mhz_mean=mean(sm), sm_mhz_min=min(sm) if sm else None,
                sm_mhz_busy_mean=mean(busy_sm), mem_mhz_mean=mean(mem), power_w_mean=mean(power),
                power_w_max=max(power) if power else None, power_capped_share=capped,
                temp_c_max=max(temp) if temp else None, throttle=reasons)


def join(samples_path, rows_path):
    samples = read_samples(samples_path)
    with open(rows_path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    for r in rows:
        label = (f"{r.get('mode', '?')}/{r.get('compress', '?')} b={r.get('max_batch_size', '?')} "
                 f"N={r.get('concurrency', '?')}")
        if "started_unix_s" not in r or "ended_unix_s" not in r:
            print(f"{label}: no started_unix_s / ended_unix_s in the row")
            continue
        s = summarize(samples, r["started_unix_s"], r["ended_unix_s"])
        if s is None:
            print(f"{label}: no GPU samples inside the row's span")
            continue
        print(f"{label}: " + " ".join(f"{k} {v}" for k, v in s.items()))


def main(argv):
    if len(argv) == 4 and argv[1] == "join":
        join(argv[2], argv[3])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv)
