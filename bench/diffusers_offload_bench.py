"""The diffusers side of the side-by-side offload benchmark, and the table that puts both sides together.

Runs on the GPU host with diffusers' source on PYTHONPATH (never installed or committed here):

    # Full-size ZImageTransformer2DModel (or, with --arch flux, Flux.1 [dev]'s FluxTransformer2DModel)
    # with random bf16 weights, saved by diffusers itself:
    PYTHONPATH=.ref/diffusers/src python3 bench/diffusers_offload_bench.py export DIR [--arch flux]
    # One row per process (a process's peak RSS belongs to one configuration):
    PYTHONPATH=.ref/diffusers/src python3 bench/diffusers_offload_bench.py row ROW DIR --out F --machine M
    # Both sides' JSON lines as one Markdown table:
    python3 bench/diffusers_offload_bench.py table DIFFUSERS.jsonl STOWAGE.jsonl
    # The Flux rows as {"bench": "flux_offload", "system", "row", "step_s", "floor_s", "peak_rss_bytes",
    # "weight_bytes", "machine", ...} lines:
    python3 bench/diffusers_offload_bench.py flux_rows DIFFUSERS.jsonl STOWAGE.jsonl --out F --machine M

Rows (diffusers' `apply_group_offloading`, use_stream=True, CPU offload device):
    resident            the model on the GPU
    block_level         offload_type="block_level", num_blocks_per_group=1
    leaf_level          offload_type="leaf_level"
    block_level_lowmem  block_level + low_cpu_mem_usage=True
    leaf_level_lowmem   leaf_level + low_cpu_mem_usage=True
    layerwise_fp8       enable_layerwise_casting(storage float8_e4m3fn, compute bf16), on the GPU
    layerwise_fp8_block_level   the same, then block_level group offloading (streams fp8 weights)
The layerwise rows also report rel_l2: the relative L2 distance of their output from the same
process's bf16 resident output on the same inputs.

    # The 8-bit table and JSON lines ({"bench": "compressed", ...}) from both sides' rows:
    python3 bench/diffusers_offload_bench.py compressed DIFFUSERS.jsonl STOWAGE.jsonl --out F

Every row times one forward of the transformer (the directory's transformer/config.json says which)
at 1024x1024 (Z-Image: a 16x1x128x128 latent; Flux: 4096 packed 64-channel tokens, guidance 3.5 for
[dev]; both 4096 image tokens) with 512 caption tokens, t = 0.5, batch 1, under torch.no_grad(): `--warmup` untimed forwards,
then the median of `--iters` timed ones. Peak device memory is torch's max_memory_allocated over the
timed forwards; peak CPU RSS is the process's (getrusage), loading included. bench/offload_bench
--model_dir=DIR times the same forward on the same files with the same counts (bench/side_by_side.sh).
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

ROWS = ("resident", "block_level", "leaf_level", "block_level_lowmem", "leaf_level_lowmem")
LAYERWISE_ROWS = ("layerwise_fp8", "layerwise_fp8_block_level")
# The Stowage row that does what each diffusers row does (bench/offload_bench.cc's row names).
COUNTERPART = {
    "resident": "resident",
    "block_level": "block_pinned",
    "leaf_level": "leaf_pinned",
    "block_level_lowmem": "block_lowram",
    "leaf_level_lowmem": "leaf_lowram",
}


def export(directory, arch):
    import torch
    from diffusers import FluxTransformer2DModel, ZImageTransformer2DModel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if arch == "flux":
        from make_flux_random_dir import FULL
        model_class = FluxTransformer2DModel
    else:
        from make_zimage_random_dir import FULL
        model_class = ZImageTransformer2DModel

    config = {k: v for k, v in FULL["transformer"].items() if not k.startswith("_")}
    torch.manual_seed(0)
    start = time.time()
    with torch.device("cuda"):  # Initialising billions of parameters on the CPU takes minutes.
        model = model_class(**config)
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():  # Default init leaves some tensors at zero: give every tensor real data.
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name else 0.0, 0.02)
    target = os.path.join(directory, "transformer")
    model.save_pretrained(target, safe_serialization=True, max_shard_size="5GB")
    params = sum(p.numel() for p in model.parameters())
    print(f"exported {params / 1e9:.2f} B parameters to {target} in {time.time() - start:.0f} s", flush=True)


def forward_for(model, device):
    """The benchmark's forward of `model` at 1024x1024 with 512 caption tokens: a function of no arguments."""
    import torch

    config = model.config
    side = 1024 // 8
    torch.manual_seed(0)
    if type(model).__name__ == "FluxTransformer2DModel":
        # 4096 packed 2x2 tokens of 64 channels, T5 features, the CLIP pooled vector, t = 0.5,
        # guidance 3.5 for [dev]; the position ids FluxPipeline builds (bench/offload_bench.cc: the same).
        hidden = torch.randn(1, (side // 2) ** 2, config.in_channels, dtype=torch.bfloat16, device=device)
        text = torch.randn(1, 512, config.joint_attention_dim, dtype=torch.bfloat16, device=device)
        pooled = torch.randn(1, config.pooled_projection_dim, dtype=torch.bfloat16, device=device)
        t = torch.full((1,), 0.5, dtype=torch.bfloat16, device=device)
        guidance = torch.full((1,), 3.5, device=device) if config.guidance_embeds else None
        img_ids = torch.zeros(side // 2, side // 2, 3, device=device)
        img_ids[..., 1] += torch.arange(side // 2, device=device)[:, None]
        img_ids[..., 2] += torch.arange(side // 2, device=device)[None, :]
        img_ids = img_ids.reshape(-1, 3)
        txt_ids = torch.zeros(512, 3, device=device)
        return lambda: model(hidden_states=hidden, encoder_hidden_states=text, pooled_projections=pooled, timestep=t,
                             img_ids=img_ids, txt_ids=txt_ids, guidance=guidance, return_dict=False)[0][0]
    latents = torch.randn(config.in_channels, 1, side, side, dtype=torch.bfloat16, device=device)
    caption = torch.randn(512, config.cap_feat_dim, dtype=torch.bfloat16, device=device)
    t = torch.tensor([0.5], device=device)
    return lambda: model([latents], t, [caption], return_dict=False)[0][0]


def run_row(row, directory, out, machine, warmup, iters):
    import torch
    import diffusers
    from diffusers.hooks import apply_group_offloading

    if row not in ROWS + LAYERWISE_ROWS:
        raise SystemExit(f"unknown row {row!r}; rows: {', '.join(ROWS + LAYERWISE_ROWS)}")
    device = torch.device("cuda")
    torch.cuda.init()
    with open(os.path.join(directory, "transformer", "config.json"), encoding="utf-8") as f:
        class_name = json.load(f)["_class_name"]
    if class_name not in ("ZImageTransformer2DModel", "FluxTransformer2DModel"):
        raise SystemExit(f"{directory}/transformer is a {class_name}; rows run ZImageTransformer2DModel or "
                         "FluxTransformer2DModel")
    model = getattr(diffusers, class_name).from_pretrained(os.path.join(directory, "transformer"),
                                                           torch_dtype=torch.bfloat16).eval()
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    forward = forward_for(model, device)
    reference = None
    if row in LAYERWISE_ROWS:
        # The bf16 output on the same inputs, then fp8 storage as diffusers does it.
        model.to(device)
        with torch.no_grad():
            reference = forward().float()
        if row == "layerwise_fp8_block_level":
            model.to("cpu")
        model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)
        if row == "layerwise_fp8_block_level":
            apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                                   offload_type="block_level", num_blocks_per_group=1, use_stream=True)
    elif row == "resident":
        model.to(device)
    else:
        kind = "block_level" if row.startswith("block") else "leaf_level"
        apply_group_offloading(model, onload_device=device, offload_device=torch.device("cpu"),
                               offload_type=kind, num_blocks_per_group=1 if kind == "block_level" else None,
                               use_stream=True, low_cpu_mem_usage=row.endswith("_lowmem"))
    steps = []
    with torch.no_grad():
        for _ in range(warmup):
            forward()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        for _ in range(iters):
            start = time.perf_counter()
            output = forward()
            torch.cuda.synchronize()
            steps.append(time.perf_counter() - start)
    if not torch.isfinite(output).all():
        raise SystemExit(f"{row}: non-finite output")
    result = {
        "side": "diffusers", "row": row, "stowage_row": COUNTERPART.get(row, ""),
        "step_s": statistics.median(steps), "steps_s": steps,
        "peak_device_bytes": torch.cuda.max_memory_allocated(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "weight_bytes": weight_bytes, "warmup": warmup, "iters": iters,
        "model": class_name, "torch": torch.__version__, "machine": machine,
    }
    if reference is not None:
        result["rel_l2"] = ((output.float() - reference).norm() / reference.norm()).item()
    line = json.dumps(result)
    print(line, flush=True)
    with open(out, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def table(diffusers_path, stowage_path):
    diffusers = {r["row"]: r for r in map(json.loads, open(diffusers_path, encoding="utf-8"))}
    stowage = {r["row"]: r for r in map(json.loads, open(stowage_path, encoding="utf-8"))}
    # The floor: weight bytes at the pinned host->device bandwidth the Stowage side measured.
    bandwidth = next(iter(stowage.values()), {}).get("h2d_bandwidth_bytes_per_s")

    def cells(r, streamed):
        """step s, x floor, peak VRAM GB, peak RSS GB of one side's row (dashes when absent)."""
        if not r:
            return ["–"] * 4
        floor = f"{r['step_s'] / (r['weight_bytes'] / bandwidth):.2f}" if streamed and bandwidth else "–"
        return [f"{r['step_s']:.3f}", floor, f"{r['peak_device_bytes'] / 1e9:.2f}",
                f"{r['peak_rss_bytes'] / 1e9:.1f}"]

    # Paired rows, then Stowage-only rows (e.g. deeper prefetch).
    lines = [(row, diffusers.get(row), stowage.get(COUNTERPART[row])) for row in ROWS]
    lines += [("–", None, s) for name, s in stowage.items() if name not in COUNTERPART.values()]
    print("| config | diffusers step s | Stowage step s | diffusers x floor | Stowage x floor | "
          "diffusers peak VRAM GB | Stowage peak VRAM GB | diffusers peak RSS GB | Stowage peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, d, s in lines:
        streamed = name != "resident"
        dc, sc = cells(d, streamed), cells(s, streamed)
        label = f"{name} / {s['row']}" if s else name
        print("| " + " | ".join([label] + [x for pair in zip(dc, sc) for x in pair]) + " |")


def compressed(diffusers_path, stowage_path, out, machine):
    """The 8-bit rows of both sides as {"bench": "compressed", ...} lines (appended to `out`) and a table."""
    diffusers = {r["row"]: r for r in map(json.loads, open(diffusers_path, encoding="utf-8"))}
    stowage = {r["row"]: r for r in map(json.loads, open(stowage_path, encoding="utf-8"))}
    lines = []
    for system, rows, resident, names in (
            ("stowage", stowage, stowage.get("resident"), ("resident", "block_pinned", "block_int8", "block_fp8")),
            ("diffusers", diffusers, diffusers.get("resident"),
             ("resident", "block_level", "layerwise_fp8", "layerwise_fp8_block_level"))):
        for name in names:
            r = rows.get(name)
            if r is None:
                continue
            lines.append({"bench": "compressed", "system": system, "row": name, "step_s": r["step_s"],
                          "resident_bf16_step_s": resident["step_s"] if resident else None,
                          "rel_l2": r.get("rel_l2", 0.0) if name not in ("resident", "block_pinned", "block_level") else 0.0,
                          "peak_rss_bytes": r["peak_rss_bytes"], "bf16_weight_bytes": r["weight_bytes"],
                          "peak_device_bytes": r["peak_device_bytes"], "machine": machine})
    with open(out, "a", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print("| system | row | step s | x resident bf16 step | rel L2 vs bf16 | peak RSS / bf16 weights | peak VRAM GB |")
    print("|---|---|---|---|---|---|---|")
    for r in lines:
        ratio = f"{r['step_s'] / r['resident_bf16_step_s']:.2f}" if r["resident_bf16_step_s"] else "–"
        print(f"| {r['system']} | {r['row']} | {r['step_s']:.3f} | {ratio} | {r['rel_l2']:.4f} | "
              f"{r['peak_rss_bytes'] / r['bf16_weight_bytes']:.2f} | {r['peak_device_bytes'] / 1e9:.2f} |")


def flux_rows(diffusers_path, stowage_path, out, machine, diffusers_bandwidth=None):
    """Both sides' rows on the Flux transformer as the issue's {"bench": "flux_offload", ...} lines
    (appended to `out`) and a table. floor_s: the weights at the pinned host->device bandwidth that
    the row's own process measured (Stowage rows), the Stowage side's first measurement in the same
    run (diffusers rows), or, for diffusers rows taken from an earlier run
    (run_flux_suite.sh's DIFFUSERS_FROM), `diffusers_bandwidth` (bytes/s) measured in that run.
    Each row keeps the machine line (and commit) it was measured at; `machine` fills rows without."""
    sides = {"diffusers": [json.loads(l) for l in open(diffusers_path, encoding="utf-8")],
             "stowage": [json.loads(l) for l in open(stowage_path, encoding="utf-8")]}
    bandwidth = next((r["h2d_bandwidth_bytes_per_s"] for r in sides["stowage"]
                      if r.get("h2d_bandwidth_bytes_per_s")), None)
    if not bandwidth:
        raise SystemExit(f"{stowage_path} has no row with h2d_bandwidth_bytes_per_s: no floor to compare with")
    lines = []
    for system, rows in sides.items():
        for r in rows:
            # A Stowage row's own process measured the link just before it ran.
            own = r.get("h2d_bandwidth_bytes_per_s") or (diffusers_bandwidth if system == "diffusers" else None)
            floor = r["weight_bytes"] / (own or bandwidth)
            lines.append({"bench": "flux_offload", "system": system, "row": r["row"], "step_s": r["step_s"],
                          "floor_s": floor, "x_floor": r["step_s"] / floor, "peak_rss_bytes": r["peak_rss_bytes"],
                          "rss_x_weights": r["peak_rss_bytes"] / r["weight_bytes"],
                          "peak_device_bytes": r["peak_device_bytes"], "weight_bytes": r["weight_bytes"],
                          "model": r.get("model", ""), "machine": r.get("machine") or machine})
    with open(out, "a", encoding="utf-8") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print("| system | row | step s | floor s | x floor | peak RSS GB | RSS / weights | peak VRAM GB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in lines:
        print(f"| {r['system']} | {r['row']} | {r['step_s']:.3f} | {r['floor_s']:.3f} | {r['x_floor']:.2f} | "
              f"{r['peak_rss_bytes'] / 1e9:.1f} | {r['rss_x_weights']:.2f} | {r['peak_device_bytes'] / 1e9:.2f} |")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    e = sub.add_parser("export")
    e.add_argument("dir")
    e.add_argument("--arch", choices=["zimage", "flux"], default="zimage")
    r = sub.add_parser("row")
    r.add_argument("row", choices=ROWS + LAYERWISE_ROWS)
    r.add_argument("dir")
    r.add_argument("--out", required=True)
    r.add_argument("--machine", default="unknown")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--iters", type=int, default=3)
    t = sub.add_parser("table")
    t.add_argument("diffusers")
    t.add_argument("stowage")
    c = sub.add_parser("compressed")
    c.add_argument("diffusers")
    c.add_argument("stowage")
    c.add_argument("--out", required=True)
    c.add_argument("--machine", default="unknown")
    fl = sub.add_parser("flux_rows")
    fl.add_argument("diffusers")
    fl.add_argument("stowage")
    fl.add_argument("--out", required=True)
    fl.add_argument("--machine", default="unknown")
    fl.add_argument("--diffusers_bandwidth", type=float, default=None,
                    help="bytes/s for the diffusers rows' floor when they come from another run")
    args = parser.parse_args()
    if args.command == "export":
        export(args.dir, args.arch)
    elif args.command == "flux_rows":
        flux_rows(args.diffusers, args.stowage, args.out, args.machine, args.diffusers_bandwidth)
    elif args.command == "row":
        run_row(args.row, args.dir, args.out, args.machine, args.warmup, args.iters)
    elif args.command == "compressed":
        compressed(args.diffusers, args.stowage, args.out, args.machine)
    else:
        table(args.diffusers, args.stowage)


if __name__ == "__main__":
    main()
