#!/usr/bin/env python3
"""Does a VAE decode stay slower after it once ran short of device memory? (GPU host, LibTorch's
cuDNN convolutions.)

Multi-tenant run 13 measured the hot Z-Image request 0.13 s slower under the budget than resident in
the same server process, though it moved no weights; its VAE had run out of memory early in the
budgeted phase. A hypothesis: LibTorch keeps one cuDNN execution plan per convolution shape and
thread (its v8 plan cache is thread-local; a device's worker thread runs every convolution), and when
a plan's workspace cannot be allocated it falls back to the first plan whose workspace fits and keeps
that one. This probe measures it outside the server: diffusers' AutoencoderKL with the Flux /
Z-Image VAE's shapes (16 latent channels, 128-256-512-512), random bfloat16 weights, a 1024² decode:

  1. the decode's median time, warm;
  2. for each level of spare room (a fraction of the decode's own peak allocation), a filler
     tensor takes the rest of the device, one decode runs (it may fail: recorded), the filler goes,
     and the decode's median time is measured again with all the memory back.

A row per level: {"bench":"cudnn_oom_probe","level":..,"room_bytes":..,"squeezed_ok":..,
"ooms":..,"retries":..,"decode_s":..,"baseline_decode_s":..,"ratio":..,"machine":..,"commit":..}.
A ratio that stays above 1 after a squeezed decode that succeeded with ooms > 0 says the fallback plan
was kept. A last row (level "fresh_thread") times the decode on a new thread (LibTorch's cuDNN plan
cache is per thread) beside the first thread once more: whether a fresh thread gets the fast plans back.
    PYTHONPATH=<diffusers src> python3 bench/cudnn_oom_probe.py --out rows.jsonl --machine M --commit C
"""
import argparse
import json
import sys
import time


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON lines are appended here")
    p.add_argument("--machine", default="unknown")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--size", type=int, default=1024, help="image side in pixels (a multiple of 8)")
    p.add_argument("--repeats", type=int, default=5, help="timed decodes per measurement (median)")
    p.add_argument("--levels", default="1.3,1.0,0.9,0.8,0.7,0.6,0.5,0.4",
                   help="spare room as fractions of the decode's peak allocation, in order")
    args = p.parse_args()
    if args.size <= 0 or args.size % 8:
        sys.exit(f"--size {args.size}: a positive multiple of 8")
    if args.repeats < 1:
        sys.exit("--repeats: at least 1")
    try:
        levels = [float(x) for x in args.levels.split(",")]
    except ValueError:
        sys.exit(f"--levels {args.levels!r}: comma-separated fractions")
    if not levels or any(not 0 < x <= 4 for x in levels):
        sys.exit(f"--levels {args.levels!r}: each in (0, 4]")
    import torch
    if not torch.cuda.is_available():
        sys.exit("cudnn_oom_probe needs a CUDA device (it measures LibTorch's cuDNN convolutions)")
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16,
                        down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
                        block_out_channels=[128, 256, 512, 512], layers_per_block=2)
    vae = vae.to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, 16, args.size // 8, args.size // 8, device="cuda", dtype=torch.bfloat16)

    def decode():
        with torch.no_grad():
            return vae.decode(z).sample

    def median_decode():
        times = []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            decode()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return sorted(times)[len(times) // 2]

    def counts():
        s = torch.cuda.memory_stats()
        return s.get("num_ooms", 0), s.get("num_alloc_retries", 0)

    for _ in range(3):
        decode()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    decode()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    baseline = median_decode()
    print(f"decode peak beyond the weights {peak / 2**20:.0f} MiB, median {baseline:.4f} s", flush=True)
    rows = []
    for level in levels:
        room = int(peak * level)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        filler = None
        if free > room:
            filler = torch.empty(free - room, dtype=torch.uint8, device="cuda")
        ooms0, retries0 = counts()
        ok, error = True, ""
        try:
            decode()
            torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError as e:
            ok, error = False, str(e).split("\n")[0][:160]
        ooms1, retries1 = counts()
        del filler
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        after = median_decode()
        row = {"bench": "cudnn_oom_probe", "level": level, "room_bytes": room, "peak_bytes": peak,
               "squeezed_ok": ok, "error": error, "ooms": ooms1 - ooms0, "retries": retries1 - retries0,
               "decode_s": round(after, 5), "baseline_decode_s": round(baseline, 5),
               "ratio": round(after / baseline, 4), "size": args.size, "torch": torch.__version__,
               "cudnn": torch.backends.cudnn.version(), "machine": args.machine, "commit": args.commit}
        rows.append(row)
        print(json.dumps(row), flush=True)
    # LibTorch's cuDNN plan cache is per thread: the same decode on a new thread (after one untimed
    # decode there that selects its plans with all the memory free) says whether a fresh thread gets
    # the first plans back — what retiring a device's compute thread after such an error would give.
    import threading
    fresh = {}

    def on_fresh_thread():
        decode()
        torch.cuda.synchronize()
        fresh["s"] = median_decode()

    worker = threading.Thread(target=on_fresh_thread)
    worker.start()
    worker.join()
    again = median_decode()  # The first thread once more, after the fresh one.
    row = {"bench": "cudnn_oom_probe", "level": "fresh_thread", "decode_s": round(fresh["s"], 5),
           "first_thread_decode_s": round(again, 5), "baseline_decode_s": round(baseline, 5),
           "ratio": round(fresh["s"] / baseline, 4), "first_thread_ratio": round(again / baseline, 4),
           "size": args.size, "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
           "machine": args.machine, "commit": args.commit}
    rows.append(row)
    print(json.dumps(row), flush=True)
    with open(args.out, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
