"""The diffusers baseline of the two-pipeline benchmark (bench/two_pipelines.py): what a diffusers user
does to serve Z-Image-Turbo and Flux.1 [dev] from one GPU — one process holding both pipelines, each
with `enable_model_cpu_offload()` (a component goes to the GPU when it runs and leaves when the next
one does), switching between them per request.

    PYTHONPATH=.ref/diffusers/src python3 bench/diffusers_two_pipelines.py --out ROWS.jsonl \
        [--flux_tokenizers DIR] [--size 1024] [--steps 8] [--rounds 2] [--budget_gib 24] [--machine M]

Both pipelines at their published shapes with random bf16 weights (bench/make_zimage_random_dir.py's
and bench/make_flux_random_dir.py's FULL configs; Z-Image's byte-level tokenizer as in
bench/diffusers_pipeline_bench.py; Flux's tokenizers from --flux_tokenizers, by default the
committed parity fixture's). One unmeasured call per pipeline, then --rounds alternating calls
(Z-Image, Flux, ...); one process has one GPU queue, so "concurrent" arrivals would only queue
behind each other and are not run. Latency: the call (output_type "pil": no PNG encoding, which the
server's figures include). Peak device bytes: torch's peak reserve over the measured calls plus the
CUDA context (what the process holds outside the allocator, measured at start), as the server reports.

    python3 bench/diffusers_two_pipelines.py summarize CALLS.jsonl [CALLS.jsonl ...] --out ROWS.jsonl \
        [--resident_from ROWS.jsonl] [--budget_gib 24]
        The rows below from the per-call lines of runs that a time limit cut short (every
        two_pipelines_call line of the files, grouped by pipeline; resident_latency_s from the
        resident server's alternating rows of --resident_from, as bench/two_pipelines.py writes them).

Each measured call is appended at once as {"bench":"two_pipelines_call",...}; at the end, rows
{"bench":"two_pipelines","strategy":"diffusers_model_cpu_offload","pipeline":"zimage"|"flux",
"arrival":"alternating","latency_s":<mean>,"latencies_s":[..],"peak_device_bytes":..,"budget_bytes":..,
"ok":<every call succeeded and the peak stayed within the budget>,"size":..,"steps":..,"machine":..}
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
GIB = 1 << 30
PROMPTS = {"zimage": "a lighthouse on a cliff at dusk, oil painting",
           "flux": "a red fox in fresh snow, morning light, photograph"}


def flux_pipeline(tokenizers):
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModel, CLIPTokenizer, T5Config, T5EncoderModel
    from diffusers_pipeline_bench import randomize
    from make_flux_random_dir import FULL, SCHEDULER

    strip = lambda c: {k: v for k, v in c.items() if not k.startswith("_") and k not in ("architectures", "model_type")}
    torch.manual_seed(1)
    with torch.device("cuda"):  # One module at a time, cast to bf16 at once: fp32 Flux is 48 GB.
        transformer = FluxTransformer2DModel(**strip(FULL["transformer"])).to(torch.bfloat16)
        t5 = T5EncoderModel(T5Config(**strip(FULL["text_encoder_2"]))).to(torch.bfloat16)
        clip = CLIPTextModel(CLIPTextConfig(**strip(FULL["text_encoder"]))).to(torch.bfloat16)
        vae = AutoencoderKL(**strip(FULL["vae"])).to(torch.bfloat16)
    randomize((transformer, t5, clip, vae))
    scheduler = FlowMatchEulerDiscreteScheduler(**strip(SCHEDULER))
    clip_tok = CLIPTokenizer.from_pretrained(os.path.join(tokenizers, "tokenizer"))
    t5_tok = AutoTokenizer.from_pretrained(os.path.join(tokenizers, "tokenizer_2"))
    return FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer)


def timed_call(torch, pipe, prompt, size, steps, seed, guidance_scale):
    """One text-to-image call of a diffusers pipeline: (start, end, error) with perf_counter times around
    it (the device synchronised before and after; output_type "pil": no PNG encoding). An exception is
    the call's error (an out-of-memory error is the point of a budget), as is an image of another size."""
    kwargs = dict(prompt=prompt, height=size, width=size, num_inference_steps=steps,
                  generator=torch.Generator("cpu").manual_seed(seed), output_type="pil", guidance_scale=guidance_scale)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    try:
        image = pipe(**kwargs).images[0]
        torch.cuda.synchronize()
        error = None if image.size == (size, size) else f"image of {image.size}"
    except Exception as e:  # noqa: BLE001 -- reported in the row.
        error = f"{type(e).__name__}: {str(e)[:300]}"
    return t0, time.perf_counter(), error


def context_bytes(torch):
    """Device bytes the process holds outside the caching allocator (CUDA context, libraries)."""
    try:
        used = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout
        for line in used.splitlines():
            pid, mib = [x.strip() for x in line.split(",")]
            if int(pid) == os.getpid():
                return int(mib) * (1 << 20) - torch.cuda.memory_reserved()
    except (OSError, ValueError, subprocess.TimeoutExpired):
        pass
    return 0


def summary_row(name, calls, budget, resident_latency=None, peak=None, **extra):
    """The issue's row for pipeline `name` from its two_pipelines_call lines. peak: the process's
    peak when known (a whole run); else the highest peak seen by the time of any of these calls."""
    peak = max(c["peak_device_bytes_so_far"] for c in calls) if peak is None else peak
    errors = [c["error"] for c in calls if c["error"]]
    machines = sorted({c["machine"] for c in calls})
    return {"bench": "two_pipelines", "strategy": calls[0]["strategy"], "pipeline": name, "arrival": "alternating",
            "latency_s": statistics.mean(c["latency_s"] for c in calls), "resident_latency_s": resident_latency,
            "latencies_s": [c["latency_s"] for c in calls], "peak_device_bytes": peak, "budget_bytes": budget,
            "ok": not errors and peak <= budget, "errors": errors, "size": calls[0]["size"],
            "steps": calls[0]["steps"], "machine": machines[0] if len(machines) == 1 else machines, **extra}


def summarize(argv):
    parser = argparse.ArgumentParser(prog="diffusers_two_pipelines.py summarize")
    parser.add_argument("calls", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resident_from", default="")
    parser.add_argument("--budget_gib", type=float, default=24)
    args = parser.parse_args(argv)
    calls = [r for path in args.calls for r in map(json.loads, open(path, encoding="utf-8"))
             if r.get("bench") == "two_pipelines_call"]
    if not calls:
        raise SystemExit(f"no two_pipelines_call lines in {args.calls}")
    resident = {}
    if args.resident_from:
        resident = {r["pipeline"]: r["latency_s"] for r in map(json.loads, open(args.resident_from, encoding="utf-8"))
                    if r.get("strategy") == "resident" and r.get("arrival") == "alternating"}
    budget = int(args.budget_gib * GIB)
    with open(args.out, "a", encoding="utf-8") as f:
        for name in sorted({c["pipeline"] for c in calls}):
            row = summary_row(name, [c for c in calls if c["pipeline"] == name], budget, resident.get(name))
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "summarize":
        summarize(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--flux_tokenizers", default=os.path.join(HERE, "..", "tests", "fixtures", "flux_tiny",
                                                                  "pipeline"))
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--budget_gib", type=float, default=24)
    parser.add_argument("--machine", default="unknown")
    args = parser.parse_args()

    import torch
    from diffusers_pipeline_bench import zimage_pipeline

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    context = context_bytes(torch)
    start = time.time()
    pipes = {}
    for name, build in (("zimage", zimage_pipeline), ("flux", lambda: flux_pipeline(args.flux_tokenizers))):
        pipe = build()
        pipe.enable_model_cpu_offload()  # Moves every component to the host; each comes back when it runs.
        torch.cuda.empty_cache()
        pipes[name] = pipe
    print(f"built both pipelines in {time.time() - start:.0f} s", flush=True)

    def call(name, seed):
        t0, t1, error = timed_call(torch, pipes[name], PROMPTS[name], args.size, args.steps, seed,
                                   0.0 if name == "zimage" else 3.5)
        return t1 - t0, error

    for name in pipes:  # Unmeasured.
        call(name, 0)
    torch.cuda.reset_peak_memory_stats()
    calls = []
    for i in range(args.rounds * 2):
        name = ("zimage", "flux")[i % 2]
        latency, error = call(name, i + 1)
        calls.append({"bench": "two_pipelines_call", "strategy": "diffusers_model_cpu_offload", "pipeline": name,
                      "latency_s": latency, "error": error,
                      "peak_device_bytes_so_far": torch.cuda.max_memory_reserved() + context,
                      "size": args.size, "steps": args.steps, "machine": args.machine})
        with open(args.out, "a", encoding="utf-8") as f:  # Each call at once: a run cut short keeps them.
            f.write(json.dumps(calls[-1]) + "\n")
    peak = torch.cuda.max_memory_reserved() + context
    budget = int(args.budget_gib * GIB)
    with open(args.out, "a", encoding="utf-8") as f:
        for name in pipes:
            row = summary_row(name, [c for c in calls if c["pipeline"] == name], budget, peak=peak,
                              context_bytes=context, torch=torch.__version__)
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
