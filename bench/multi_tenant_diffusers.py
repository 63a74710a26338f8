"""The diffusers baseline of the multi-tenant benchmark (bench/multi_tenant.py, issue 24): what a
diffusers user does to serve the same four pipelines from one GPU — one process holding Z-Image-Turbo,
its fine-tune, Flux.1 [dev] and the [schnell] stand-in, each with `enable_model_cpu_offload()` (a
component goes to the GPU when it runs and leaves when the next one does; between calls everything is
on the host), serving the requests of the same seeded trace one at a time in arrival order.

    PYTHONPATH=.ref/diffusers/src python3 bench/multi_tenant_diffusers.py --out ROWS.jsonl \
        [--requests 12] [--trace_requests 100] [--rate 0.8] [--zipf 1.1] [--trace_seed 1]
        [--steps zimage=8,zimage-ft=8,flux-schnell=4,flux-dev=8] [--size 1024] [--budget_gib 24]
        [--flux_tokenizers DIR] [--serve_s 300] [--machine M] [--commit C]

The trace is bench/multi_tenant.py's (make_trace with the same --trace_requests, --rate, --zipf,
--trace_seed and --steps: the same arrivals, pipelines, tenants, seeds and prompts); its first
--requests are served (fewer when --serve_s of serving pass first: rows count those served) (diffusers' model offloading takes ~20-30 s per 1024² image on the H200, so a
whole trace does not fit a device call). The pipelines are built as in bench/diffusers_two_pipelines.py
(published shapes, random bf16 weights); the fine-tune and the [schnell] stand-in are the same
pipelines with their transformer drawn from another seed, sharing every other module object (one copy
in host RAM, as Stowage's content deduplication shares them). Shared modules carry one pipeline's
offload hooks at a time, so the process calls enable_model_cpu_offload() again on the pipeline it
switches to (hooks only: its modules are on the host between calls).

A request's latency is its completion time less its arrival time (the process serves one request at
a time, so later arrivals queue behind earlier ones; tenants and priorities change nothing here);
run_s is its own call. Bytes moved per request: the weights of the modules the call ran (every one
moves onto the GPU each call). Peaks: torch's peak reserve plus the CUDA context (what the process
holds outside the allocator, measured at start), and nvidia-smi's memory.used sampled every 0.2 s.

Each served request is appended at once as {"bench":"multi_tenant_call",...}; then rows in
bench/multi_tenant.py's format with "strategy":"diffusers_model_cpu_offload", per pipeline and "all":
{"bench":"multi_tenant","strategy":..,"pipeline":..,"requests":..,"p50_s":..,"p99_s":..,"run_s":..,
 "images_per_s":..,"bytes_moved_per_request":..,"peak_device_bytes":..,
 "peak_nvidia_smi_bytes":..,"budget_bytes":..,"ok":..,"errors":[..],"trace":{..},"machine":..,"commit":..}
No ratio to all-resident here: that side would come from another call (bench/multi_tenant.py's
resident rows), and a ratio never divides by another run's number.
"""

import argparse
import json
import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from multi_tenant import GIB, POPULARITY, SmiSampler, make_trace, percentile  # noqa: E402

STRATEGY = "diffusers_model_cpu_offload"


def other_transformer(template, seed):
    """A transformer of `template`'s class and config with random bf16 weights from `seed`, on the host."""
    import torch
    from diffusers_pipeline_bench import randomize

    torch.manual_seed(seed)
    with torch.device("cuda"):  # Initialising billions of parameters on the CPU takes minutes.
        module = type(template).from_config(template.config)
    randomize((module,))
    module.to("cpu")
    torch.cuda.empty_cache()
    return module


def build(flux_tokenizers):
    """The four pipelines: {name: (pipeline, modules it runs)}."""
    import torch
    from diffusers import FluxPipeline, ZImagePipeline
    from diffusers_pipeline_bench import zimage_pipeline
    from diffusers_two_pipelines import flux_pipeline

    pipes = {}
    zimage = zimage_pipeline()
    zimage.to("cpu")
    torch.cuda.empty_cache()
    pipes["zimage"] = zimage
    pipes["zimage-ft"] = ZImagePipeline(scheduler=zimage.scheduler, vae=zimage.vae, text_encoder=zimage.text_encoder,
                                        tokenizer=zimage.tokenizer, transformer=other_transformer(zimage.transformer, 11))
    flux = flux_pipeline(flux_tokenizers)
    flux.to("cpu")
    torch.cuda.empty_cache()
    pipes["flux-dev"] = flux
    pipes["flux-schnell"] = FluxPipeline(scheduler=flux.scheduler, vae=flux.vae, text_encoder=flux.text_encoder,
                                         tokenizer=flux.tokenizer, text_encoder_2=flux.text_encoder_2,
                                         tokenizer_2=flux.tokenizer_2,
                                         transformer=other_transformer(flux.transformer, 12))
    return pipes


def weight_bytes(pipe):
    """The bytes of every module the pipeline runs for a text-to-image call (its VAE encoder is not run,
    but diffusers moves the whole AutoencoderKL)."""
    import torch

    total = 0
    for name, module in pipe.components.items():
        if isinstance(module, torch.nn.Module):
            total += sum(p.numel() * p.element_size() for p in module.parameters())
            total += sum(b.numel() * b.element_size() for b in module.buffers())
    return total


def rows(calls, served_start, served_end, budget, peak, smi_peak, trace_info, machine, commit):
    out = []
    for name in ("all",) + POPULARITY:
        mine = [c for c in calls if name == "all" or c["pipeline"] == name]
        if not mine:
            continue
        ok_calls = [c for c in mine if not c["error"]]
        latencies = [c["latency_s"] for c in ok_calls]
        errors = [c["error"] for c in mine if c["error"]]
        row = {"bench": "multi_tenant", "strategy": STRATEGY, "pipeline": name, "requests": len(mine),
               "p50_s": percentile(latencies, 0.5) if latencies else None,
               "p99_s": percentile(latencies, 0.99) if latencies else None,
               "run_s": sum(c["run_s"] for c in ok_calls) / len(ok_calls) if ok_calls else None,
               "images_per_s": len(ok_calls) / (served_end - served_start) if name == "all" else None,
               "bytes_moved_per_request": sum(c["bytes_moved"] for c in mine) / len(mine),
               "peak_device_bytes": peak, "peak_nvidia_smi_bytes": smi_peak, "budget_bytes": budget,
               "ok": not errors and peak <= budget and (smi_peak or 0) <= budget, "errors": errors[:5],
               "trace": trace_info, "machine": machine, "commit": commit}
        out.append(row)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--requests", type=int, default=12, help="the first N requests of the trace are served")
    parser.add_argument("--trace_requests", type=int, default=100, help="the trace's length (as bench/multi_tenant.py --requests)")
    parser.add_argument("--rate", type=float, default=0.8)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--trace_seed", type=int, default=1)
    parser.add_argument("--steps", default="zimage=8,zimage-ft=8,flux-schnell=4,flux-dev=8")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--budget_gib", type=float, default=24)
    parser.add_argument("--flux_tokenizers", default=os.path.join(HERE, "..", "tests", "fixtures", "flux_tiny",
                                                                  "pipeline"))
    parser.add_argument("--serve_s", type=float, default=300,
                        help="stop starting requests after this many seconds of serving (rows cover those served)")
    parser.add_argument("--machine", default="unknown")
    parser.add_argument("--commit", default="unknown")
    args = parser.parse_args()
    steps = dict(kv.split("=") for kv in args.steps.split(","))
    steps = {k: int(v) for k, v in steps.items()}
    if set(steps) != set(POPULARITY):
        raise SystemExit(f"--steps needs each of {POPULARITY}")
    if not 1 <= args.requests <= args.trace_requests:
        raise SystemExit("--requests must be 1..--trace_requests")
    trace = make_trace(args.trace_requests, args.rate, args.zipf, args.trace_seed, steps)[:args.requests]
    trace_info = {"requests": args.trace_requests, "first": args.requests, "rate": args.rate, "zipf": args.zipf,
                  "seed": args.trace_seed, "steps": steps, "size": args.size}

    import torch
    from diffusers_two_pipelines import context_bytes, timed_call

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    context = context_bytes(torch)
    args.context_bytes = context
    start = time.time()
    pipes = build(args.flux_tokenizers)
    moved = {name: weight_bytes(pipe) for name, pipe in pipes.items()}
    print(f"built the four pipelines in {time.time() - start:.0f} s; bytes per call: {moved}", flush=True)
    active = [None]

    def call(name, request):
        if active[0] != name:  # Shared modules carry the hooks of one pipeline at a time.
            pipes[name].enable_model_cpu_offload()
            active[0] = name
        return timed_call(torch, pipes[name], request["prompt"], args.size, request["steps"], request["seed"],
                          0.0 if name.startswith("zimage") else 3.5)

    # One unmeasured small call per pipeline: kernels loaded, hooks installed once.
    for name in POPULARITY:
        call(name, {"prompt": "warm-up", "steps": 1, "seed": 0})
    torch.cuda.reset_peak_memory_stats()
    calls = []
    # A time limit's SIGTERM (the suite's `timeout`) ends the serving loop: the rows then cover the
    # requests served so far instead of being lost.
    signal.signal(signal.SIGTERM, stop_serving)
    with SmiSampler(True) as smi:
        served_start = time.perf_counter()
        try:
            serve(trace, calls, served_start, smi, call, moved, args)
        except StopServing:
            print(f"SIGTERM after {len(calls)} requests: rows cover those", flush=True)
        served_end = time.perf_counter()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    smi_peak = smi.peak
    peak = torch.cuda.max_memory_reserved() + context
    budget = int(args.budget_gib * GIB)
    write_rows(args.out, rows(calls, served_start, served_end, budget, peak, smi_peak, trace_info,
                              args.machine, args.commit), context_bytes=context, torch=torch.__version__)


class StopServing(Exception):
    pass


def stop_serving(signum, frame):
    raise StopServing()


def write_rows(path, out, **extra):
    with open(path, "a", encoding="utf-8") as f:
        for row in out:
            row.update(extra)
            f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


def serve(trace, calls, served_start, smi, call, moved, args):
    import torch
    for request in trace:
        if time.perf_counter() - served_start > args.serve_s:
            print(f"--serve_s {args.serve_s} reached after {len(calls)} requests", flush=True)
            return
        arrival = served_start + request["t"]
        if time.perf_counter() < arrival:
            time.sleep(arrival - time.perf_counter())
        began, done, error = call(request["pipeline"], request)
        calls.append({"bench": "multi_tenant_call", "strategy": STRATEGY, "pipeline": request["pipeline"],
                      "tenant": request["tenant"], "priority": request["priority"], "seed": request["seed"],
                      "arrival_s": request["t"], "latency_s": done - arrival, "run_s": done - began,
                      "bytes_moved": moved[request["pipeline"]], "error": error,
                      "peak_device_bytes_so_far": torch.cuda.max_memory_reserved() + args.context_bytes,
                      "peak_nvidia_smi_bytes_so_far": smi.peak, "machine": args.machine, "commit": args.commit})
        with open(args.out, "a", encoding="utf-8") as f:  # Each call at once: a run cut short keeps them.
            f.write(json.dumps(calls[-1]) + "\n")
        print(json.dumps(calls[-1]), flush=True)


def summarize(calls_path, budget_gib):
    """Rows from the call rows a run appended (a run killed before it wrote its rows): served from
    its first arrival to its last completion; peaks the last call's so-far peaks."""
    calls = []
    with open(calls_path, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row.get("bench") == "multi_tenant":
                raise SystemExit(f"{calls_path} already has its rows")
            if row.get("bench") == "multi_tenant_call":
                calls.append(row)
    if not calls:
        raise SystemExit(f"{calls_path} has no multi_tenant_call rows")
    end = max(c["arrival_s"] + c["latency_s"] for c in calls)
    last = calls[-1]
    return rows(calls, 0.0, end, int(budget_gib * GIB), last["peak_device_bytes_so_far"],
                last["peak_nvidia_smi_bytes_so_far"], {"first": len(calls), "from_calls": True},
                last["machine"], last["commit"])


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "summarize":
        if len(sys.argv) not in (3, 4):
            raise SystemExit("usage: multi_tenant_diffusers.py summarize CALLS.jsonl [BUDGET_GIB] >> CALLS.jsonl")
        for row in summarize(sys.argv[2], float(sys.argv[3]) if len(sys.argv) == 4 else 24):
            print(json.dumps(row))
    else:
        main()
