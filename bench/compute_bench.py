"""The compute benchmark: one transformer step, resident, at 1024x1024 with 512 caption tokens, batch 1 —
diffusers eager, diffusers + torch.compile and Stowage side by side, in one process tree on one GPU.

Runs on the GPU host with diffusers' source on PYTHONPATH (deploy/gpu_host/run_compute_suite.sh):

    python3 bench/compute_bench.py run --arch zimage|flux --dir DIR --offload_bench BIN \\
        --out bench/results/compute_h200/compute.jsonl --machine "NVIDIA H200" --commit abc1234 \\
        [--modes bf16,bf16_reference,fp8] [--profile_dir OUT]
  (a mode ending in _high runs on a CUDA stream of the highest priority, e.g. fp8_int4_streamed_high;
  a compressed mode ending in _wg, before any _strided, _coalesced or _high, widens a group's weights in shared
  launches; one ending in _strided or _coalesced, before any _d<N> or _high, widens with that thread layout;
  a streamed mode ending in _d<N>, before any _high, prefetches N groups ahead; a mode may end in
  +FLAG=VALUE parts, each passed to offload_bench as --FLAG=VALUE, e.g.
  fp8_int4_streamed+prefetch_depth=4; rows carry them as offload_flags; +batch=N runs N copies of the
  input in one forward, the row's FLOPs and limit N times one's, sample 0's output compared;
  +back_to_back=true times the forwards queued one after another as a server's steps run, their mean)

What one `run` does, in order:
  1. DIR/transformer: random bf16 weights written by diffusers itself when missing
     (bench/diffusers_offload_bench.py export), the real shapes of Z-Image-Turbo or Flux.1 [dev].
  2. The inputs (seeded) are drawn once and saved to DIR/compute_inputs.safetensors: every system runs
     the same forward on the same weights and inputs (bench/offload_bench.cc --inputs reads them).
  3. diffusers eager: FLOPs counted with torch's FlopCounterMode, then `--warmup` untimed and `--iters`
     timed forwards (median; CUDA synchronised around each), its output kept as the reference.
  4. diffusers + torch.compile (one line: torch.compile(model)), timed the same way; rel_l2 against eager is
     the noise floor of a faster bf16 forward.
  5. Stowage, one offload_bench process per mode (resident row): bf16 (the fused CUDA kernels),
     bf16_reference (STOWAGE fused kernels off: the plain LibTorch path), fp8 (the blocks' linear layers as
     FP8 GEMMs); each saves its output, compared with diffusers eager. bf16_graphs / fp8_graphs run the same
     resident forward through captured CUDA graphs (models/core/step_graphs.h, STOWAGE_CUDA_GRAPHS=1; off
     by default in the server and in the other modes), and rows say `cuda_graphs` (whether the mode turned
     them on; offload_bench's peak_device_bytes are allocated bytes, which leave out a graph pool's free blocks).
  6. Streamed modes (the transformer group-offloaded block by block, every block's weights copied each step):
     bf16_streamed, fp8_streamed (the FP8 weights themselves), int8_streamed / int8g_streamed / int4_streamed
     (a compressed host copy widened to bf16 on the device), fp8_int4_streamed (FP8 compute, the FP8 weights'
     int4 copy widened back into e4m3 on the device); a streamed mode ending in _b<NN> (before any _d<N>)
     runs under a device budget of NN % of its weights, the groups that fit beside the slots kept resident
     (rows say resident_bytes and working_set_bytes). Their rows carry floor_s (the bytes streamed per
     step over the bandwidth measured in the same process), peak and base host RSS and prepare_s; after the
     modes, one {"bench": "compressed"} row per streamed mode sets it beside the resident steps of this run
     (resident_bf16_step_s, resident_fast_step_s: the fastest resident mode of the same batch).
Rows: {"bench": "compute", "model", "system", "mode", "path", "step_s", "batch", "tflop_per_step", "limit_s",
"rel_l2", "machine", "commit", ...}; limit_s = FLOPs / --peak_tflops (790, the H200's measured bf16 rate).
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SIDE = 1024 // 8
CAPTION_TOKENS = 512  # run --caption_tokens's default (the server's short prompts give ~32).


def draw_inputs(arch, config, tokens):
    import torch

    torch.manual_seed(0)
    if arch == "flux":
        return {
            "hidden": torch.randn(1, (SIDE // 2) ** 2, config.in_channels, dtype=torch.bfloat16),
            "text": torch.randn(1, tokens, config.joint_attention_dim, dtype=torch.bfloat16),
            "pooled": torch.randn(1, config.pooled_projection_dim, dtype=torch.bfloat16),
        }
    return {
        "latents": torch.randn(config.in_channels, 1, SIDE, SIDE, dtype=torch.bfloat16),
        "caption": torch.randn(tokens, config.cap_feat_dim, dtype=torch.bfloat16),
    }


def diffusers_forward(arch, model, inputs, device):
    """A function of no arguments: the forward bench/offload_bench.cc runs on the same inputs."""
    import torch

    x = {k: v.to(device) for k, v in inputs.items()}
    if arch == "flux":
        t = torch.full((1,), 0.5, dtype=torch.bfloat16, device=device)
        guidance = torch.full((1,), 3.5, device=device) if model.config.guidance_embeds else None
        img_ids = torch.zeros(SIDE // 2, SIDE // 2, 3, device=device)
        img_ids[..., 1] += torch.arange(SIDE // 2, device=device)[:, None]
        img_ids[..., 2] += torch.arange(SIDE // 2, device=device)[None, :]
        img_ids = img_ids.reshape(-1, 3)
        txt_ids = torch.zeros(x["text"].shape[1], 3, device=device)
        return lambda: model(hidden_states=x["hidden"], encoder_hidden_states=x["text"],
                             pooled_projections=x["pooled"], timestep=t, img_ids=img_ids, txt_ids=txt_ids,
                             guidance=guidance, return_dict=False)[0][0]
    t = torch.tensor([0.5], device=device)
    return lambda: model([x["latents"]], t, [x["caption"]], return_dict=False)[0][0]


def time_forward(forward, warmup, iters):
    import torch

    with torch.no_grad():
        for _ in range(warmup):
            forward()
        torch.cuda.synchronize()
        steps = []
        out = None
        for _ in range(iters):
            start = time.perf_counter()
            out = forward()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - start)
    return statistics.median(steps), steps, out


def mode_batch(full_mode):
    """N of a mode's +batch=N part (1 without one); a value that is not a whole number 1..64 stops the run."""
    for part in full_mode.split("+")[1:]:
        if part.startswith("batch="):
            value = part.split("=", 1)[1]
            if not value.isdigit() or not 1 <= int(value) <= 64:
                raise SystemExit(f"mode {full_mode}: +batch= takes a whole number 1..64, not '{value}'")
            return int(value)
    return 1


def rel_l2(got, want):
    got, want = got.double().flatten(), want.double().flatten()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def summarize_trace(path, out_path, title):
    """Kernel time by kernel name and by class (GEMM, attention, the rest) of one Chrome trace."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f).get("traceEvents", [])
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    by_name = {}
    for e in kernels:
        by_name.setdefault(e["name"], [0, 0.0])
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += e["dur"]

    def kind(name):
        low = name.lower()
        # Attention first: cuDNN's attention kernels are named sdpa_sm90_..._wgmma_..., which the
        # GEMM patterns would match too.
        if any(k in low for k in ("flash", "fmha", "attention", "sdpa", "attn")):
            return "attention"
        if any(k in low for k in ("gemm", "xmma", "cutlass", "nvjet", "cublas", "matmul")):
            return "gemm"
        return "other"

    classes = {}
    for name, (count, dur) in by_name.items():
        c = classes.setdefault(kind(name), [0, 0.0])
        c[0] += count
        c[1] += dur
    total = sum(d for _, d in by_name.values())
    lines = [f"# {title}: {len(kernels)} kernels, {total / 1e3:.2f} ms of kernel time"]
    for c, (count, dur) in sorted(classes.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"{c:10s} {count:6d} launches {dur / 1e3:9.2f} ms ({100 * dur / max(total, 1):.1f} %)")
    lines.append("top kernels:")
    for name, (count, dur) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]:
        lines.append(f"  {dur / 1e3:8.2f} ms {count:5d}x  {name[:150]}")
    lines += idle_lines(events)
    with open(out_path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n\n")
    print("\n".join(lines[:5]), flush=True)


GPU_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")


def host_before_lines(host, first_gpu_ts, top=8):
    """What the host ran before the GPU's first activity: the first host events in order, then the
    longest ones (by their time inside that window; nested ops count in their parents too)."""
    early = sorted((e for e in host if e["ts"] < first_gpu_ts), key=lambda e: e["ts"])
    if not early:
        return []
    lines = ["host events before the first GPU activity, in order:"]
    t0 = early[0]["ts"]
    for e in early[:top]:
        lines.append(f"  +{(e['ts'] - t0) / 1e3:7.3f} ms {e['dur'] / 1e3:7.3f} ms {e.get('cat', ''):15s} {e['name'][:70]}")
    lines.append("  longest there:")
    inside = [(min(e["ts"] + e["dur"], first_gpu_ts) - e["ts"], e) for e in early]
    for span, e in sorted(inside, key=lambda p: -p[0])[:top]:
        lines.append(f"  {span / 1e3:7.3f} ms {e.get('cat', ''):15s} {e['name'][:70]}")
    return lines


def idle_lines(events, top=12):
    """Where the GPU idles between the first and the last activity of a trace.

    A gap before an activity is `host` when its launch call began after the GPU had gone idle (the
    host did not enqueue it in time: launch cost, a host-side wait) and `device` otherwise (it was
    queued, the GPU still waited: a cross-stream event, the kernel's own start-up)."""
    acts = sorted((e for e in events if e.get("cat") in GPU_ACTIVITY and "dur" in e), key=lambda e: e["ts"])
    if not acts:
        return ["idle: no GPU activity in the trace"]
    launches = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") == "cuda_runtime" and corr is not None:
            launches[corr] = e["ts"]
    span = acts[-1]["ts"] + acts[-1]["dur"] - acts[0]["ts"]
    # Host time around the GPU's span: from the first host event to the first GPU activity, and from
    # the last GPU activity to the end of the last host event (the synchronize that waits for it).
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation") and "dur" in e]
    before = acts[0]["ts"] - min(e["ts"] for e in host) if host else 0.0
    after = max(e["ts"] + e["dur"] for e in host) - (acts[-1]["ts"] + acts[-1]["dur"]) if host else 0.0
    busy = 0.0
    idle = {"host": 0.0, "device": 0.0}
    gaps = []
    cur_start, cur_end, prev_name = acts[0]["ts"], acts[0]["ts"] + acts[0]["dur"], acts[0]["name"]
    for e in acts[1:]:
        start, end = e["ts"], e["ts"] + e["dur"]
        if start > cur_end:
            busy += cur_end - cur_start
            gap = start - cur_end
            launched = launches.get((e.get("args") or {}).get("correlation"))
            cause = "host" if launched is not None and launched >= cur_end else "device"
            idle[cause] += gap
            gaps.append((gap, cause, prev_name, e["name"]))
            cur_start = start
        if end >= cur_end:
            cur_end, prev_name = end, e["name"]
    busy += cur_end - cur_start
    small = sum(g for g, *_ in gaps if g < 10)
    lines = [f"span {span / 1e3:.2f} ms: GPU busy {busy / 1e3:.2f} ms, idle {(span - busy) / 1e3:.2f} ms "
             f"(host-bound {idle['host'] / 1e3:.2f} ms, device-side {idle['device'] / 1e3:.2f} ms) in "
             f"{len(gaps)} gaps, {small / 1e3:.2f} ms of them in gaps under 10 us",
             f"host before the first GPU activity {before / 1e3:.2f} ms, after the last {after / 1e3:.2f} ms"]
    lines += host_before_lines(host, acts[0]["ts"])
    lines.append("largest gaps:")
    for gap, cause, before, after in sorted(gaps, key=lambda g: -g[0])[:top]:
        lines.append(f"  {gap:8.1f} us {cause:6s} {before[:60]} -> {after[:60]}")
    # Per stream (kernels only, the busiest first): a streamed step's compute stream idles where it
    # waits for a copy or a widening on another stream (device-side) or for the host (host-bound);
    # its kernel time against the resident step's says what contention costs the kernels themselves.
    streams = {}
    for e in acts:
        if e.get("cat") == "kernel":
            streams.setdefault((e.get("args") or {}).get("stream"), []).append(e)
    for sid, ks in sorted(streams.items(), key=lambda kv: -sum(k["dur"] for k in kv[1]))[:3]:
        kernel_time = sum(k["dur"] for k in ks)
        s_span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        s_idle = {"host": 0.0, "device": 0.0}
        end = ks[0]["ts"] + ks[0]["dur"]
        for k in ks[1:]:
            if k["ts"] > end:
                launched = launches.get((k.get("args") or {}).get("correlation"))
                s_idle["host" if launched is not None and launched >= end else "device"] += k["ts"] - end
            end = max(end, k["ts"] + k["dur"])
        lines.append(f"stream {sid}: {len(ks)} kernels, {kernel_time / 1e3:.2f} ms of kernel time in a "
                     f"{s_span / 1e3:.2f} ms span; idle host-bound {s_idle['host'] / 1e3:.2f} ms, "
                     f"device-side {s_idle['device'] / 1e3:.2f} ms")
    return lines


def run(args):
    for full_mode in [m for m in args.modes.split(",") if m]:
        mode_batch(full_mode)  # A bad +batch= stops the run before anything is timed.
    import torch
    import diffusers
    from safetensors.torch import load_file, save_file
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, HERE)
    from diffusers_offload_bench import export

    if not os.path.exists(os.path.join(args.dir, "transformer", "config.json")):
        export(args.dir, args.arch)
    device = torch.device("cuda")
    class_name = "FluxTransformer2DModel" if args.arch == "flux" else "ZImageTransformer2DModel"
    model_name = "flux" if args.arch == "flux" else "zimage"
    model = getattr(diffusers, class_name).from_pretrained(os.path.join(args.dir, "transformer"),
                                                           torch_dtype=torch.bfloat16).eval().to(device)
    inputs = draw_inputs(args.arch, model.config, args.caption_tokens)
    inputs_path = os.path.join(args.dir, "compute_inputs.safetensors")
    save_file({k: v.contiguous() for k, v in inputs.items()}, inputs_path)
    forward = diffusers_forward(args.arch, model, inputs, device)

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    flops = counter.get_total_flops()
    tflop = flops / 1e12
    limit_s = tflop / args.peak_tflops
    rows = []

    def row(system, mode, path, step_s, err, batch=1, **extra):
        # batch: samples in the step (a Stowage row's +batch=N); its FLOPs and limit are batch times one's.
        r = {"bench": "compute", "model": model_name, "system": system, "mode": mode, "path": path,
             "step_s": round(step_s, 6), "batch": batch, "tflop_per_step": round(tflop * batch, 3),
             "limit_s": round(limit_s * batch, 6), "x_limit": round(step_s / (limit_s * batch), 3), "rel_l2": err,
             "caption_tokens": args.caption_tokens, "machine": args.machine, "commit": args.commit}
        r.update(extra)
        rows.append(r)
        print(json.dumps(r), flush=True)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(r) + "\n")

    eager_s, eager_steps, eager_out = time_forward(forward, args.warmup, args.iters)
    reference = eager_out.float().cpu()
    row("diffusers", "bf16", "eager", eager_s, 0.0, steps_s=[round(s, 6) for s in eager_steps],
        torch=torch.__version__, attention_backend="default")

    if "compile" in args.diffusers:
        compiled = torch.compile(model)
        start = time.time()
        cforward = diffusers_forward(args.arch, compiled, inputs, device)
        with torch.no_grad():
            cforward()  # Compiles.
        compile_s = time.time() - start
        c_s, c_steps, c_out = time_forward(cforward, args.warmup, args.iters)
        row("diffusers_compile", "bf16", "torch.compile", c_s, rel_l2(c_out.float().cpu(), reference),
            steps_s=[round(s, 6) for s in c_steps], compile_s=round(compile_s, 1), torch=torch.__version__)
        del compiled, cforward
    del model, forward
    torch.cuda.empty_cache()

    for full_mode in [m for m in args.modes.split(",") if m]:
        # mode+FLAG=VALUE...: offload_bench flags of this row only (e.g. +pinned_huge_pages=false).
        mode, *flag_parts = full_mode.split("+")
        for part in flag_parts:
            if not re.fullmatch(r"[a-z_0-9]+=[A-Za-z0-9_.-]+", part):
                raise SystemExit(f"mode {full_mode}: '+{part}' is not +FLAG=VALUE")
        offload_flags = [f"--{part}" for part in flag_parts]
        # +batch=N: N samples in one forward (offload_bench --batch; sample 0's output is compared).
        batch = mode_batch(full_mode)
        file_tag = full_mode.replace("+", "__").replace("=", "-")
        out_file = os.path.join(args.dir, f"stowage_{file_tag}.safetensors")
        jsonl = os.path.join(args.dir, f"stowage_{file_tag}.jsonl")
        for f in (out_file, jsonl):
            if os.path.exists(f):
                os.remove(f)
        # *_streamed: the transformer group-offloaded block by block (block_pinned), its weights
        # streamed from pinned host memory every step (FP8: the FP8 bytes themselves).
        # *_high: the forwards on a stream of the highest priority (offload_bench --compute_priority=high),
        # so that a streamed row's widening takes only the SMs its compute leaves idle.
        high = mode.endswith("_high")
        base_mode = mode[: -len("_high")] if high else mode
        # *_d<N> (before any _high): a streamed row that prefetches N groups ahead (offload_bench's
        # row suffix; the server's block-level default is 1).
        depth_match = re.search(r"_d([0-9]+)$", base_mode)
        depth = int(depth_match.group(1)) if depth_match else None
        base_mode = base_mode[: depth_match.start()] if depth_match else base_mode
        # *_b<NN> (before any _d<N> or _high): a streamed row under a device budget of NN % of the weights'
        # bytes (offload_bench's row suffix): the groups that fit beside the slots stay resident.
        budget_match = re.search(r"_b([0-9]{1,2})$", base_mode)
        budget = int(budget_match.group(1)) if budget_match else None
        base_mode = base_mode[: budget_match.start()] if budget_match else base_mode
        # *_strided / *_coalesced (before any _d<N> or _high): a compressed row widened with that thread
        # layout of the kernels (offload_bench --widen_layout); without either, the kernels' default.
        layout = next((l for l in ("strided", "coalesced") if base_mode.endswith("_" + l)), None)
        base_mode = base_mode[: -len(layout) - 1] if layout else base_mode
        # *_wg (before any _strided, _coalesced or _high): a compressed row whose groups' weights widen in shared launches.
        per_group = base_mode.endswith("_wg")
        base_mode = base_mode[: -len("_wg")] if per_group else base_mode
        streamed = base_mode.endswith("_streamed")
        # int8_streamed / int8g_streamed / int4_streamed: streamed from a compressed host copy (per-channel
        # int8, group-wise int8, group-wise int4), widened to bf16 on the device into the slot, bf16 compute.
        # fp8_int4_streamed: FP8 compute, its FP8 weights streamed as an int4 copy widened back into e4m3.
        parts = base_mode.split("_")
        compress = {"int8": "block_int8", "int8g": "block_int8grouped", "int4": "block_int4"}.get(
            parts[1] if parts[0] == "fp8" and len(parts) == 3 else parts[0])
        # *_graphs: the same forward with CUDA graphs on (STOWAGE_CUDA_GRAPHS=1; the server's default is off).
        graphs = base_mode.endswith("_graphs")
        fp8 = mode.startswith("fp8")
        bench_row = compress or ("block_pinned" if streamed else "resident")
        if per_group and compress:
            bench_row += "_wg"
        if budget and streamed:
            bench_row += f"_b{budget}"
        if depth and streamed:
            bench_row += f"_d{depth}"
        cmd = [args.offload_bench, f"--model_dir={args.dir}", f"--rows={bench_row}",
               f"--inputs={inputs_path}", f"--caption_tokens={args.caption_tokens}",
               f"--save_output={out_file}", f"--out={jsonl}", f"--warmup={args.warmup}", f"--iters={args.iters}",
               f"--machine={args.machine}", f"--fused={'false' if mode == 'bf16_reference' else 'true'}",
               f"--compute={'fp8' if fp8 else 'bf16'}", f"--compute_priority={'high' if high else 'default'}"] + (
                   [f"--widen_layout={layout}"] if layout else []) + (
                   [f"--spill_dir={args.spill_dir}"] if args.spill_dir else []) + offload_flags
        trace = ""
        if args.profile_dir and mode != "bf16_reference":
            trace = os.path.join(args.dir, f"trace_{model_name}_{file_tag}.json")
            cmd.append(f"--profile={trace}")
        start = time.time()
        env = dict(os.environ, STOWAGE_CUDA_GRAPHS="1" if graphs else "0")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        sys.stdout.write(proc.stdout[-3000:])
        if proc.returncode != 0:
            sys.stdout.write(proc.stderr[-3000:])
            print(f"stowage {mode}: exit {proc.returncode}", flush=True)
            continue
        with open(jsonl, encoding="utf-8") as f:
            result = json.loads(f.readline())
        err = rel_l2(load_file(out_file)["output"].float(), reference)
        extra = {}
        if streamed:
            # floor_s: the bytes this mode streams per step over the bandwidth measured in the same process.
            # offload_bench's floor_s is the bf16 bytes' floor; a compressed row's own is floor_8bit_s.
            floor_s = result.get("floor_8bit_s") if compress else result.get("floor_s")
            extra = dict(placement="streamed", offload_row=bench_row, floor_s=floor_s,
                         compress=result.get("compress", "none"),
                         streamed_bytes=result.get("streamed_bytes"),
                         x_floor=round(result["step_s"] / floor_s, 3) if floor_s else None,
                         prepare_s=result.get("prepare_s"), page_cache_read_s=result.get("page_cache_read_s"),
                         prepare_fp8_s=result.get("prepare_fp8_s"),
                         prepare_pin_alloc_s=result.get("prepare_pin_alloc_s"),
                         prepare_quantize_s=result.get("prepare_quantize_s"),
                         peak_rss_bytes=result.get("peak_rss_bytes"),
                         base_rss_bytes=result.get("base_rss_bytes"),
                         base_rss_after_bytes=result.get("base_rss_after_bytes"),
                         base_rss_warm_bytes=result.get("base_rss_warm_bytes"),
                         h2d_bytes_per_s=result.get("h2d_bandwidth_bytes_per_s"),
                         widen_layout=result.get("widen_layout"), widen_layout_asked=layout,
                         prefetch_depth=result.get("prefetch_depth"),
                         resident_bytes=result.get("resident_bytes"), working_set_bytes=result.get("working_set_bytes"),
                         spilled_bytes=result.get("spilled_bytes"),
                         rss_after_prepare_bytes=result.get("rss_after_prepare_bytes"))
        row("stowage", "fp8" if fp8 else "bf16", "reference" if mode == "bf16_reference" else "fused",
            result["step_s"], err, peak_device_bytes=result.get("peak_device_bytes"),
            process_s=round(time.time() - start, 1), cuda_graphs=graphs and not streamed,
            compute_priority="high" if high else "default", offload_flags=flag_parts, batch=batch, **extra)
        if trace and os.path.exists(trace) and args.profile_dir:
            profile = os.path.join(args.profile_dir, f"profile_{model_name}.txt")
            summarize_trace(trace, profile, f"stowage {model_name} {full_mode}")
            if streamed:
                # Where the link and the compute wait (bench/trace_gaps.py), its totals only.
                gaps = subprocess.run([sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                                    "trace_gaps.py"), trace, "--min_gap_us", "200"],
                                      capture_output=True, text=True)
                with open(profile, "a", encoding="utf-8") as f:
                    f.write(f"trace_gaps (stowage {model_name} {full_mode}):\n")
                    f.write("".join(f"  {line}\n" for line in gaps.stdout.splitlines() if not line.startswith("  ")))
                    if gaps.returncode != 0:
                        f.write(f"  trace_gaps failed: {gaps.stderr.strip()[-500:]}\n")
    compressed_rows(args, model_name, rows)
    return rows


def compressed_rows(args, model_name, rows):
    """The streaming issue's rows, from the streamed modes of this run: each beside the resident steps of
    the same run (bf16, and the fastest resident mode), its own floor, host RSS above the process's base."""
    resident = [r for r in rows if r["system"] == "stowage" and r.get("placement") != "streamed"
                and r["path"] == "fused" and not r.get("cuda_graphs")]
    streamed = [r for r in rows if r["system"] == "stowage" and r.get("placement") == "streamed"]
    if not resident or not streamed:
        return
    weight_dir = os.path.join(args.dir, "transformer")
    bf16_bytes = sum(os.path.getsize(os.path.join(weight_dir, f)) for f in os.listdir(weight_dir)
                     if f.endswith(".safetensors"))
    for r in streamed:
        # Beside the resident rows of the same batch (+batch=N) only.
        same = [x for x in resident if x.get("batch", 1) == r.get("batch", 1)]
        if not same:
            print(f"compressed row of {r['mode']} {r.get('offload_flags')}: no resident row of batch "
                  f"{r.get('batch', 1)} in this run", flush=True)
            continue
        bf16 = [x["step_s"] for x in same if x["mode"] == "bf16"]
        fast = min(same, key=lambda x: x["step_s"])
        # offload_bench's row (block_pinned: the weights as they are), and the compute when it is FP8.
        row = r["offload_row"]
        if r["mode"] == "fp8":
            name = ("block" if row == "block_pinned" else row) + "_fp8_compute"
        else:
            name = "block_bf16" if row == "block_pinned" else row
        if r.get("widen_layout_asked"):
            name += "_" + r["widen_layout_asked"]
        if (r.get("prefetch_depth") or 1) != 1:
            name += f"_d{r['prefetch_depth']}"
        if r.get("compute_priority") == "high":
            name += "_high"
        if r.get("spilled_bytes"):
            name += "_spill"
        for part in r.get("offload_flags") or []:
            name += "+" + part
        out = {"bench": "compressed", "system": "stowage", "model": model_name, "row": name,
               "compute": r["mode"], "step_s": r["step_s"], "resident_bf16_step_s": bf16[0] if bf16 else None,
               "resident_fast_step_s": fast["step_s"], "resident_fast_mode": fast["mode"],
               "floor_s": r.get("floor_s"), "x_floor": r.get("x_floor"),
               "x_fast": round(r["step_s"] / max(fast["step_s"], r.get("floor_s") or 0), 3),
               "rel_l2": r["rel_l2"], "peak_rss_bytes": r.get("peak_rss_bytes"),
               "base_rss_bytes": r.get("base_rss_bytes"), "bf16_weight_bytes": bf16_bytes,
               "rss_above_base_x_bf16": round((r["peak_rss_bytes"] - r["base_rss_bytes"]) / bf16_bytes, 3)
               if r.get("peak_rss_bytes") and r.get("base_rss_bytes") else None,
               # The base measured again after the row freed its weights (the CUDA libraries a
               # forward loaded stay): above the larger of the two bases.
               "base_rss_after_bytes": r.get("base_rss_after_bytes"),
               "rss_above_base_after_x_bf16": round(
                   (r["peak_rss_bytes"] - max(r["base_rss_bytes"], r["base_rss_after_bytes"])) / bf16_bytes, 3)
               if r.get("peak_rss_bytes") and r.get("base_rss_bytes") and r.get("base_rss_after_bytes") else None,
               # Above the base with the kernel libraries loaded (offload_bench warms them with a small
               # stack's forward before any weights): the issue's base, "the same process kind
               # holding no weights".
               "base_rss_warm_bytes": r.get("base_rss_warm_bytes"),
               "rss_above_warm_base_x_bf16": round((r["peak_rss_bytes"] - r["base_rss_warm_bytes"]) / bf16_bytes, 3)
               if r.get("peak_rss_bytes") and r.get("base_rss_warm_bytes") else None,
               # Once the copies are prepared, before any forward (the peak above includes preparing's
               # transients): above the warm base. With --spill_dir, the bytes moved into a mapped file.
               "rss_after_prepare_bytes": r.get("rss_after_prepare_bytes"),
               "rss_after_prepare_above_warm_base_x_bf16": round(
                   (r["rss_after_prepare_bytes"] - r["base_rss_warm_bytes"]) / bf16_bytes, 3)
               if r.get("rss_after_prepare_bytes") and r.get("base_rss_warm_bytes") else None,
               "spilled_bytes": r.get("spilled_bytes"),
               # *_b<NN> rows: the weights a device budget kept resident, and the device working set.
               "resident_bytes": r.get("resident_bytes"), "working_set_bytes": r.get("working_set_bytes"),
               "prepare_s": r.get("prepare_s"), "page_cache_read_s": r.get("page_cache_read_s"),
               "prepare_x_read": round(r["prepare_s"] / r["page_cache_read_s"], 2)
               if r.get("prepare_s") and r.get("page_cache_read_s") else None,
               # Of prepare_s: the FP8 conversion, the pinned allocations (beside the quantizing) and
               # the quantizing.
               "prepare_fp8_s": r.get("prepare_fp8_s"), "prepare_pin_alloc_s": r.get("prepare_pin_alloc_s"),
               "prepare_quantize_s": r.get("prepare_quantize_s"),
               "compute_priority": r.get("compute_priority", "default"), "widen_layout": r.get("widen_layout"),
               "offload_flags": r.get("offload_flags"),
               "batch": r.get("batch", 1), "machine": args.machine, "commit": args.commit}
        print(json.dumps(out), flush=True)
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(json.dumps(out) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--arch", choices=["zimage", "flux"], required=True)
    r.add_argument("--dir", required=True)
    r.add_argument("--offload_bench", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--machine", default="unknown")
    r.add_argument("--commit", default="unknown")
    r.add_argument("--modes", default="bf16,bf16_reference,fp8")
    r.add_argument("--diffusers", default="eager,compile")
    r.add_argument("--warmup", type=int, default=3)
    r.add_argument("--iters", type=int, default=10)
    r.add_argument("--peak_tflops", type=float, default=790.0)
    r.add_argument("--caption_tokens", type=int, default=CAPTION_TOKENS,
                   help="1..4096: caption tokens of every system's forward (rows say caption_tokens)")
    r.add_argument("--profile_dir", default="")
    r.add_argument("--spill_dir", default="",
                   help="offload_bench --spill_dir for Stowage's rows: host tensors no file holds (FP8 compute's "
                        "converted weights) move into a mapped file there (PipelineConfig.host_spill_dir)")
    s = sub.add_parser("summarize_trace")
    s.add_argument("trace")
    s.add_argument("--out", required=True)
    s.add_argument("--title", default="trace")
    args = parser.parse_args()
    if args.command == "run":
        if not 1 <= args.caption_tokens <= 4096:
            parser.error(f"--caption_tokens must be 1..4096, not {args.caption_tokens}")
        run(args)
    else:
        summarize_trace(args.trace, args.out, args.title)


if __name__ == "__main__":
    main()
