"""Many pipelines, one GPU, realistic traffic (issue 24): four pipelines under one device budget,
a seeded Poisson arrival trace with Zipf popularity, two tenants and two priorities, served first in
arrival order (FIFO) and then by the placement-aware scheduler, beside the same trace on an
unbudgeted server that keeps everything resident.

    python3 bench/multi_tenant.py stowage --server BIN --stowctl BIN --zimage DIR --flux DIR \
        --out ROWS.jsonl --logs LOG_DIR [--budget_gib 24] [--size 1024] [--requests 200] [--rate 0.5]
        [--zipf 1.1] [--trace_seed 1] [--steps zimage=8,zimage-ft=8,flux-schnell=4,flux-dev=28]
        [--strategies resident,fifo,scheduler] [--reorder_ms 4000] [--flood_requests 30]
        [--flux_compress none|int8|int4] [--flux_keep_gib 4] [--keep_resident zimage/text_encoder]
        [--no_convolution_lane]
        [--text_encoder_compress none|int8|int4]
        [--zimage_ft_compress off|none|int8|int4] [--zimage_ft_keep_gib 0]
        [--streamed_group_cache] [--cuda_expandable_segments] [--cuda_max_split_size_mb 0] [--compute bf16|fp8] [--text_encoder_compute bf16|fp8] [--t5_compute bf16|fp8] [--max_batch_size 1] [--max_queue_delay_ms 0] [--batch_in resident,fifo,scheduler]
        [--device cuda|sim] [--dtype bfloat16]
        [--machine M] [--commit C]

The four pipelines (random weights drawn from the folders' configs: bench/make_zimage_random_dir.py,
bench/make_flux_random_dir.py), in popularity order:
  zimage        Z-Image-Turbo.
  flux-schnell  the Flux folder with its transformer drawn from another seed (component_weight_seeds):
                a stand-in for [schnell] with [dev]'s config (the same 11.9 B shapes but [dev]'s small
                guidance embedder, which [schnell] lacks), sharing CLIP, T5 and the VAE with flux-dev
                — one copy each, deduplicated by content.
  zimage-ft     a Z-Image fine-tune: the transformer drawn from another seed, the Qwen3 text encoder
                and VAE shared with zimage.
  flux-dev      Flux.1 [dev].
Every strategy serves the same pipelines the same way: --compute fp8 runs each transformer's block
linears as FP8 GEMMs (PipelineConfig.compute; half the transformer's bytes on the host and the device,
CUDA only), for the resident rows too. --max_batch_size > 1 lets requests of one pipeline, size and
step count queued together run as one batch (set with the admin SetBatching as each strategy named in
--batch_in starts, holding a batch open up to --max_queue_delay_ms; off for the others), so a streamed
transformer streams once for all of them: --batch_in resident,scheduler compares the scheduler with
batching against FIFO as it was.
Each request picks a pipeline with Zipf(--zipf) popularity (zimage hot, three cold), a tenant
("alice" 70 %, "bob" 30 %) and a priority (1 for 20 %, else 0), seed and arrival time from
--trace_seed: every strategy replays the same trace.

Strategies (one after the other on one loaded server unless --separate_servers: resident first,
without a budget, then the admin SetMemoryBudget, the footprint strategy and the budgeted placement
set at run time, FIFO and the scheduler switched with the admin SetScheduler — every row of a run
from one process, one load):
  resident   no budget; every component kept resident (workflow keep_resident rules): each
             pipeline's latency when nothing ever moves (resident_p50_s of every row).
  fifo       the budget; the big text encoders (Qwen3, T5) streamed block by block (from an int8 or
             int4 host copy with --text_encoder_compress), the Flux
             transformers group-offloaded (--flux_keep_gib resident, the rest streamed, --flux_compress),
             the fine-tune's transformer too with --zimage_ft_compress (else moved whole),
             everything else moved whole by the footprint strategy (never the --keep_resident
             components: a kept text encoder stays whole on the device); requests run in arrival order
             (within priority and tenant fairness): SchedulerConfig.max_reorder_delay_ms 0.
  scheduler  the same placement; max_reorder_delay_ms --reorder_ms: a request whose pipeline is on
             the device may pass older ones that would move weights, each passed over for at most
             that long. Then the flood phase: alice's requests for the hot pipeline alone
             (--flood_requests, Poisson at --flood_rate: within her fair share, half the device
             with two tenants of equal weight — a tenant asking for more than her share queues
             behind her own requests under any fair scheduler), and again while bob floods the hot
             pipeline with four closed-loop clients: alice's p99 with the flood against alone.
Latency is the client's (request sent to PNG received) over the OpenAI images API (`user` is the
tenant, `priority` ours); bytes moved per request are the replies' X-Stowage-Host-To-Device-Bytes
(whole components moved onto the device and streamed groups alike; a batch member counts its share
of its batch's bytes) and mean_batch_size the replies' X-Stowage-Batch-Size; peaks are the replies' device
reserve plus CUDA context, and on CUDA also nvidia-smi's memory.used sampled every 0.2 s.

Rows:
  {"bench":"multi_tenant","strategy":..,"pipeline":<name>|"all","requests":..,"p50_s":..,"p99_s":..,
   "resident_p50_s":..,"resident_p99_s":..,"images_per_s":..,"bytes_moved_per_request":..,
   "mean_batch_size":..,"serving":{"compute","max_batch_size","max_queue_delay_ms"},
   "peak_device_bytes":..,"peak_nvidia_smi_bytes":..,"budget_bytes":..,"ok":..,"errors":[..],
   "size":..,"steps":..,"trace":{..},"machine":..,"commit":..}
  {"bench":"multi_tenant","strategy":"scheduler","phase":"flood","tenant":"alice","pipeline":"zimage",
   "p50_s":..,"p99_s":..,"alone_p50_s":..,"alone_p99_s":..,"p99_vs_alone":..,"flood_images":..,"ok":..,...}
`ok`: every request succeeded and every peak stayed within the budget.

    python3 bench/multi_tenant.py table ROWS.jsonl      the rows as a Markdown table.
    python3 bench/multi_tenant.py analyze LOGS ROWS     per strategy: mean run times (queueing
        excluded), the utilisation they imply, stage medians, allocator shortfalls (and where the
        allocator's unallocated room lay at out-of-memory errors), whole-component onloads, the scheduler's reorders, the spare-room caches' margin (its changes and the measured
        requests at each) and each streamed component's forwards and cache hits (its own, on one server).
    python3 bench/multi_tenant.py replay LOGS ROWS      the scheduler strategy's requests replayed
        through a model with and without preemption.

Standard library only.
"""

import argparse
import base64
import datetime
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_pipelines import Server  # noqa: E402  (the server process: config file, port file, stop)

GIB = 1 << 30
POPULARITY = ("zimage", "flux-schnell", "zimage-ft", "flux-dev")
TOKEN = "multi-tenant-bench"
PROMPTS = ("a lighthouse on a cliff at dusk, oil painting", "a red fox in fresh snow, morning light",
           "a bowl of ramen, studio photograph", "an astronaut reading in a library, watercolor")
BLOCK = "offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true"


def percentile(values, q):
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def make_trace(count, rate, zipf, seed, steps, pipelines=POPULARITY, tenants=(("alice", 0.7), ("bob", 0.3))):
    """The seeded arrival trace: [{"t", "pipeline", "tenant", "priority", "seed", "steps", "prompt"}]."""
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf for k in range(len(pipelines))]
    t = 0.0
    trace = []
    for i in range(count):
        t += rng.expovariate(rate)
        pipeline = rng.choices(pipelines, weights)[0]
        tenant = rng.choices([n for n, _ in tenants], [w for _, w in tenants])[0]
        trace.append({"t": t, "pipeline": pipeline, "tenant": tenant, "priority": 1 if rng.random() < 0.2 else 0,
                      "seed": 1000 + i, "steps": steps[pipeline], "prompt": PROMPTS[i % len(PROMPTS)]})
    return trace


def generate(server, request, size):
    """One image over HTTP: a result dict (latency_s, h2d, peak, error)."""
    body = json.dumps({"model": request["pipeline"], "prompt": request["prompt"], "size": f"{size}x{size}",
                       "num_inference_steps": request["steps"], "seed": request["seed"],
                       "user": request["tenant"], "priority": request["priority"],
                       "response_format": "b64_json"}).encode()
    http = urllib.request.Request(f"http://{server.http}/v1/images/generations", data=body,
                                  headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    result = {"pipeline": request["pipeline"], "tenant": request["tenant"], "priority": request["priority"],
              "h2d": 0, "peak": 0, "batch": 1, "preempted_s": 0.0, "error": None}
    try:
        with urllib.request.urlopen(http, timeout=900) as reply:
            payload = json.loads(reply.read())
            result["peak"] = int(reply.headers.get("X-Stowage-Peak-Device-Reserved-Bytes", "0"))
            result["h2d"] = int(reply.headers.get("X-Stowage-Host-To-Device-Bytes", "0"))
            result["batch"] = int(reply.headers.get("X-Stowage-Batch-Size", "1"))
            result["preempted_s"] = float(reply.headers.get("X-Stowage-Preempted-Seconds", "0"))
        if not base64.b64decode(payload["data"][0]["b64_json"]).startswith(b"\x89PNG"):
            result["error"] = "reply is not a PNG"
    except urllib.error.HTTPError as e:
        result["error"] = f"HTTP {e.code}: {e.read()[:300].decode(errors='replace')}"
    except Exception as e:  # noqa: BLE001 -- any failed reply is that request's error, not the run's end.
        result["error"] = f"{type(e).__name__}: {e}"
    result["latency_s"] = time.perf_counter() - start
    result["done"] = time.perf_counter()
    return result


def replay(server, trace, size, stop_when_done=None):
    """Sends each request of `trace` at its arrival time (open loop): (results, start, end)."""
    results = [None] * len(trace)
    threads = []
    start = time.perf_counter()

    def one(i):
        results[i] = generate(server, trace[i], size)

    for i, request in enumerate(trace):
        delay = start + request["t"] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        thread = threading.Thread(target=one, args=(i,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if stop_when_done is not None:
        stop_when_done.set()
    return results, start, max((r["done"] for r in results), default=start)


class SmiSampler:
    """nvidia-smi's memory.used of GPU 0, sampled every 0.2 s while running (CUDA only)."""

    def __init__(self, enabled):
        self.enabled, self.peak, self.stop_event = enabled, 0, threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def __enter__(self):
        if self.enabled:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop_event.set()
        if self.enabled:
            self.thread.join()

    def run(self):
        while not self.stop_event.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                                      "-i", "0"], capture_output=True, text=True, timeout=10).stdout
                self.peak = max(self.peak, int(out.strip().splitlines()[0]) << 20)
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self.stop_event.wait(0.2)


def config_text(budget_bytes, strategy, reorder_ms, pin=False):
    """`pin`: host copies page-locked although the server starts without a budget (one server for
    every strategy: its budget is set at run time, and its moves should run at the link's speed)."""
    kind = "KIND_SIMULATED" if ARGS.device == "sim" else "KIND_CUDA"
    pinned = " pin_host_copies: true" if pin else ""
    cache = " streamed_group_cache { enabled: true }" if ARGS.streamed_group_cache else ""
    lane = " convolution_lane: false" if ARGS.no_convolution_lane else ""
    device = f"device {{ kind: {kind} memory_budget_bytes: {budget_bytes}{pinned}{cache}{lane} }}"
    sources = {"zimage": (ARGS.zimage, ""), "zimage-ft": (ARGS.zimage, "transformer"),
               "flux-dev": (ARGS.flux, ""), "flux-schnell": (ARGS.flux, "transformer")}
    pipelines = ""
    for name in POPULARITY:
        directory, reseeded = sources[name]
        seeds = f' component_weight_seeds {{ key: "{reseeded}" value: 2 }}' if reseeded else ""
        # No load-time warm-up: each strategy's first request per pipeline is sent unmeasured instead.
        pipelines += (f'pipelines {{ name: "{name}" model_dir: "{directory}" random_weights: true weight_seed: 1 '
                      f'dtype: "{ARGS.dtype}" warmup: false{seeds}{pipeline_serving_fields(name)} }}\n')
    scheduler = f"scheduler {{ {scheduler_fields(reorder_ms, ARGS.preemption if reorder_ms else 'none')} }}"
    expandable = "cuda_expandable_segments: true\n" if ARGS.cuda_expandable_segments else ""
    if ARGS.cuda_max_split_size_mb:
        expandable += f"cuda_max_split_size_mb: {ARGS.cuda_max_split_size_mb}\n"
    return (f'{expandable}grpc_address: "127.0.0.1:0"\nhttp_address: "127.0.0.1:0"\nmetrics_address: "none"\n'
            f'queue_depth: 64\nauth {{ admin_token: "{TOKEN}" }}\n{device}\n{scheduler}\n{pipelines}{strategy}\n')


def pipeline_serving_fields(name):
    """What every strategy's pipelines share: the transformer's compute mode, and the Z-Image text
    encoder's (Qwen3, which Z-Image and its fine-tune share) with --text_encoder_compute fp8, and
    Flux's T5 (both Flux pipelines share it) with --t5_compute fp8."""
    fields = ' compute { key: "transformer" value: COMPUTE_FP8 }' if ARGS.compute == "fp8" else ""
    if ARGS.text_encoder_compute == "fp8" and name.startswith("zimage"):
        fields += ' compute { key: "text_encoder" value: COMPUTE_FP8 }'
    if ARGS.t5_compute == "fp8" and name.startswith("flux"):
        fields += ' compute { key: "text_encoder_2" value: COMPUTE_FP8 }'
    return fields


def batching_strategies():
    return [s for s in ARGS.batch_in.split(",") if s]


def apply_batching(server, strategy):
    """Dynamic batching for `strategy`'s requests, through the admin API (SetBatching on every
    pipeline): --max_batch_size where --batch_in names the strategy, else off."""
    if ARGS.max_batch_size <= 1:
        return
    size = ARGS.max_batch_size if strategy in batching_strategies() else 1
    for name in POPULARITY:
        stowctl(server, "set-batching", f"--pipeline={name}", f"--max_batch_size={size}",
                f"--max_queue_delay_ms={ARGS.max_queue_delay_ms}")


PREEMPTION = {"none": "PREEMPTION_NONE", "priority": "PREEMPTION_PRIORITY", "resident": "PREEMPTION_RESIDENT"}


def scheduler_fields(reorder_ms, preemption="none"):
    """A SchedulerConfig's text. Both tenants listed (equal weights): logs and metrics name them
    instead of "other". `preemption` (--preemption) applies to the scheduler strategy only."""
    return (f"max_reorder_delay_ms: {reorder_ms} preemption: {PREEMPTION[preemption]} "
            f'tenant_weights {{ key: "alice" value: 1 }} tenant_weights {{ key: "bob" value: 1 }}')


def stowctl(server, *args):
    command = [ARGS.stowctl, f"--target={server.grpc}", f"--token={TOKEN}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"stowctl {' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def keep_all():
    rules = "".join(f'rules {{ keep_resident: "{c}" }} ' for c in ("text_encoder", "text_encoder_2", "transformer", "vae"))
    return f"strategy {{ workflow {{ {rules}}} }}"


def keep_list():
    return [c for c in ARGS.keep_resident.split(",") if c]


def budgeted_strategy():
    """The budgeted servers' start-up strategy: footprint, never evicting the --keep_resident ones."""
    return f"strategy {{ {budgeted_strategy_fields()} }}"


def budgeted_strategy_fields():
    keep = "".join(f' keep_resident: "{c}"' for c in keep_list())
    return f"footprint {{ reserve_bytes: 0{keep} }}"


def place_budgeted(server):
    """The budgeted placement, through the admin API as an operator would set it. Components shared
    by content are registered under the first pipeline that loaded them (zimage/, flux-schnell/).
    A --keep_resident text encoder is not streamed: it stays whole on the device."""
    compress = {"none": "", "int8": " compress: COMPRESS_INT8_GROUPED", "int4": " compress: COMPRESS_INT4"}
    for component in ("zimage/text_encoder", "flux-schnell/text_encoder_2"):
        if component in keep_list() or component.split("/")[1] in keep_list():  # An id, or a name.
            continue
        stowctl(server, "enable-group-offload", f"--component={component}",
                f"--options={BLOCK}{compress[ARGS.text_encoder_compress]}")
    for component in ("flux-schnell/transformer", "flux-dev/transformer"):
        stowctl(server, "enable-group-offload", f"--component={component}",
                f"--options={BLOCK} budget_bytes: {int(ARGS.flux_keep_gib * GIB)}{compress[ARGS.flux_compress]}")
    if ARGS.zimage_ft_compress != "off":
        # The fine-tune's transformer streamed (compressed) instead of swapping whole with the hot
        # one's: with --keep_resident zimage/transformer,zimage/text_encoder the hot pipeline never moves.
        stowctl(server, "enable-group-offload", "--component=zimage-ft/transformer",
                f"--options={BLOCK} budget_bytes: {int(ARGS.zimage_ft_keep_gib * GIB)}"
                f"{compress[ARGS.zimage_ft_compress]}")


def decision_time(line):
    """A placement-log line's time (its first word, RFC 3339 UTC) as comparable (seconds, nanos)."""
    stamp = line.split(" ", 1)[0].rstrip("Z")
    seconds, _, fraction = stamp.partition(".")
    return seconds, int((fraction + "000000000")[:9]) if fraction.isdigit() else 0


def save_logs(server, name, since=None):
    """The placement log (decisions from `since`, an RFC 3339 UTC time, when given) and the
    placement now."""
    log = stowctl(server, "placement-log", "--limit=4096")
    if since is not None:
        start = decision_time(since)
        log = "".join(line for line in log.splitlines(keepends=True) if decision_time(line) >= start)
    with open(os.path.join(ARGS.logs, f"{name}.placement_log.txt"), "w", encoding="utf-8") as f:
        f.write(log)
    with open(os.path.join(ARGS.logs, f"{name}.placement.txt"), "w", encoding="utf-8") as f:
        f.write(stowctl(server, "placement"))


def rows_for(strategy, results, start, end, budget, smi_peak, resident):
    rows = []
    for pipeline in POPULARITY + ("all",):
        mine = [r for r in results if pipeline == "all" or r["pipeline"] == pipeline]
        if not mine:
            continue
        good = [r for r in mine if r["error"] is None]
        latencies = [r["latency_s"] for r in good]
        peak = max((r["peak"] for r in mine), default=0)
        within = budget == 0 or (peak <= budget and (smi_peak == 0 or smi_peak <= budget))
        row = {"bench": "multi_tenant", "strategy": strategy, "pipeline": pipeline, "requests": len(mine),
               "p50_s": round(percentile(latencies, 0.5), 4), "p99_s": round(percentile(latencies, 0.99), 4),
               "resident_p50_s": None, "resident_p99_s": None,
               "images_per_s": round(len(good) / (end - start), 4) if pipeline == "all" and end > start else None,
               "bytes_moved_per_request": int(sum(r["h2d"] for r in good) / max(1, len(good))),
               "mean_batch_size": round(sum(r["batch"] for r in good) / max(1, len(good)), 3),
               "preempted": sum(1 for r in good if r.get("preempted_s", 0) > 0),
               "mean_preempted_s": round(sum(r.get("preempted_s", 0) for r in good) / max(1, len(good)), 4),
               "peak_device_bytes": peak, "peak_nvidia_smi_bytes": smi_peak, "budget_bytes": budget,
               "ok": len(good) == len(mine) and within,
               "errors": sorted({r["error"] for r in mine if r["error"]})[:5],
               "size": ARGS.size, "steps": STEPS, "trace": TRACE_INFO,
               "keep_resident": keep_list() if strategy != "resident" else [],
               "serving": {"compute": ARGS.compute, "text_encoder_compute": ARGS.text_encoder_compute,
                           "t5_compute": ARGS.t5_compute,
                           "max_batch_size": ARGS.max_batch_size if strategy in batching_strategies() else 1,
                           "max_queue_delay_ms": ARGS.max_queue_delay_ms,
                           "preemption": ARGS.preemption if strategy == "scheduler" else "none",
                           "convolution_lane": not ARGS.no_convolution_lane},
               "placement": {} if strategy == "resident" else {
                   "flux_compress": ARGS.flux_compress, "flux_keep_gib": ARGS.flux_keep_gib,
                   "text_encoder_compress": ARGS.text_encoder_compress,
                   "zimage_ft_compress": ARGS.zimage_ft_compress, "zimage_ft_keep_gib": ARGS.zimage_ft_keep_gib,
                   "streamed_group_cache": ARGS.streamed_group_cache,
                   "cuda_expandable_segments": ARGS.cuda_expandable_segments,
                   "cuda_max_split_size_mb": ARGS.cuda_max_split_size_mb},
               "machine": ARGS.machine,
               "commit": ARGS.commit}
        own = (row["p50_s"], row["p99_s"]) if strategy == "resident" else resident.get(pipeline)
        if own:
            row["resident_p50_s"], row["resident_p99_s"] = own
        rows.append(row)
    return rows


def flood_phase(server, budget):
    """Alice's hot-pipeline requests alone, then under bob's closed-loop flood: two rows."""
    trace = make_trace(ARGS.flood_requests, ARGS.flood_rate, 0.0, ARGS.trace_seed + 1, STEPS,
                       pipelines=(POPULARITY[0],), tenants=(("alice", 1.0),))
    for request in trace:
        request["priority"] = 0  # Bob's priority: the phase measures tenant fairness, not priority.
    alone, _, _ = replay(server, trace, ARGS.size)
    stop = threading.Event()
    flood = []

    def flooder(k):
        i = 0
        while not stop.is_set():
            request = {"pipeline": POPULARITY[0], "tenant": "bob", "priority": 0, "seed": 50000 + 1000 * k + i,
                       "steps": STEPS[POPULARITY[0]], "prompt": PROMPTS[i % len(PROMPTS)]}
            flood.append(generate(server, request, ARGS.size))
            i += 1

    flooders = [threading.Thread(target=flooder, args=(k,)) for k in range(4)]
    for t in flooders:
        t.start()
    time.sleep(ARGS.flood_lead_s)  # Bob's queue fills before alice's first request.
    flooded, _, _ = replay(server, trace, ARGS.size, stop_when_done=stop)
    for t in flooders:
        t.join()
    a = [r["latency_s"] for r in alone if r["error"] is None]
    f = [r["latency_s"] for r in flooded if r["error"] is None]
    errors = sorted({r["error"] for r in alone + flooded + flood if r["error"]})
    # Bob's requests beyond the tenant queue limit may be refused (RESOURCE_EXHAUSTED): that is the
    # limit working, not a failure; alice's must all succeed.
    alice_ok = all(r["error"] is None for r in alone + flooded)
    return [{"bench": "multi_tenant", "strategy": "scheduler", "phase": "flood", "tenant": "alice",
             "pipeline": POPULARITY[0], "requests": len(trace), "rate_per_s": ARGS.flood_rate,
             "p50_s": round(percentile(f, 0.5), 4), "p99_s": round(percentile(f, 0.99), 4),
             "alone_p50_s": round(percentile(a, 0.5), 4), "alone_p99_s": round(percentile(a, 0.99), 4),
             "p99_vs_alone": round(percentile(f, 0.99) / percentile(a, 0.99), 3) if a and f else None,
             "flood_images": sum(1 for r in flood if r["error"] is None),
             "flood_refused": sum(1 for r in flood if r["error"]), "ok": alice_ok, "errors": errors[:5],
             "budget_bytes": budget, "size": ARGS.size, "steps": STEPS, "machine": ARGS.machine,
             "commit": ARGS.commit}]


def measure(server, strategy, budget, resident):
    """Warm-ups (unmeasured: each pipeline's first placement under this strategy), the trace, and
    for the scheduler the flood phase: the strategy's rows."""
    for pipeline in POPULARITY:
        generate(server, {"pipeline": pipeline, "tenant": "warmup", "priority": 0, "seed": 1,
                          "steps": STEPS[pipeline], "prompt": PROMPTS[0]}, ARGS.size)
    with SmiSampler(ARGS.device == "cuda") as smi:
        results, start, end = replay(server, TRACE, ARGS.size)
    rows = rows_for(strategy, results, start, end, budget, smi.peak, resident)
    if strategy == "scheduler" and ARGS.flood_requests > 0:
        rows += flood_phase(server, budget)
    return rows


def run_strategy(strategy, budget, resident):
    """One strategy on a server of its own."""
    print(f"== {strategy}", flush=True)
    server_budget = 0 if strategy == "resident" else budget
    placement = keep_all() if strategy == "resident" else budgeted_strategy()
    reorder = ARGS.reorder_ms if strategy == "scheduler" else 0
    server = Server(ARGS.server, config_text(server_budget, placement, reorder),
                    os.path.join(ARGS.logs, f"{strategy}.log"))
    try:
        if strategy != "resident":
            place_budgeted(server)
        apply_batching(server, strategy)
        rows = measure(server, strategy, server_budget, resident)
        save_logs(server, strategy)
    finally:
        server.stop()
    return emit(rows)


def run_on_one_server(strategies, budget, resident):
    """The strategies on one loaded server (budgeted.log; one_server.log with resident): one load
    instead of one per strategy. With resident first, the server starts without a budget (host
    copies pinned), keeps every component resident for that strategy, and then gets the budget, the
    footprint strategy and the budgeted placement through the admin API (SetMemoryBudget moves what
    no longer fits to the host). FIFO and the scheduler are switched with the admin SetScheduler
    (stowctl set-scheduler), which also starts the tenants' fair shares afresh. Each strategy's slice
    of the server log becomes <strategy>.log and its decisions <strategy>.placement_log.txt, as with
    a server each."""
    with_resident = strategies[0] == "resident"
    log_path = os.path.join(ARGS.logs, "one_server.log" if with_resident else "budgeted.log")
    config = config_text(0, keep_all(), 0, pin=True) if with_resident else config_text(budget, budgeted_strategy(), 0)
    server = Server(ARGS.server, config, log_path)
    rows = []
    budgeted = not with_resident
    try:
        if budgeted:
            place_budgeted(server)
        for strategy in strategies:
            print(f"== {strategy} (one server: {', '.join(strategies)})", flush=True)
            # Nothing runs between strategies: every decision from here on is this strategy's.
            since = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            if strategy != "resident" and not budgeted:
                # After the resident rows: the budget (what no longer fits moves to the host), the
                # footprint strategy and the budgeted placement, as an operator would set them.
                budgeted = True
                stowctl(server, "set-memory-budget", f"--memory_budget_bytes={budget}")
                stowctl(server, "set-strategy", f"--strategy={budgeted_strategy_fields()}")
                place_budgeted(server)
            reorder = ARGS.reorder_ms if strategy == "scheduler" else 0
            preemption = ARGS.preemption if strategy == "scheduler" else "none"
            stowctl(server, "set-scheduler", f"--scheduler={scheduler_fields(reorder, preemption)}")
            apply_batching(server, strategy)
            server.log.flush()
            offset = os.path.getsize(log_path)
            got = measure(server, strategy, 0 if strategy == "resident" else budget, resident)
            if strategy == "resident":
                resident = {r["pipeline"]: (r["p50_s"], r["p99_s"]) for r in got}
            with open(log_path, "rb") as whole, open(os.path.join(ARGS.logs, f"{strategy}.log"), "wb") as part:
                whole.seek(offset)
                part.write(whole.read())
            save_logs(server, strategy, since=since)
            rows += emit(got)
    finally:
        server.stop()
    return rows


def emit(rows):
    with open(ARGS.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def table(rows):
    print("| strategy | pipeline | requests | p50 s | p99 s | p50 x resident | p99 x resident | images/s | "
          "GB moved/request | peak GiB | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r.get("phase") == "flood":
            continue
        x50 = r["p50_s"] / r["resident_p50_s"] if r.get("resident_p50_s") else 0
        x99 = r["p99_s"] / r["resident_p99_s"] if r.get("resident_p99_s") else 0
        peak = max(r["peak_device_bytes"], r.get("peak_nvidia_smi_bytes", 0)) / GIB
        print(f"| {r['strategy']} | {r['pipeline']} | {r['requests']} | {r['p50_s']:.3f} | {r['p99_s']:.3f} | "
              f"{x50:.2f} | {x99:.2f} | {r['images_per_s'] or ''} | {r['bytes_moved_per_request'] / 1e9:.2f} | "
              f"{peak:.2f} | {r['ok']} |")
    for r in rows:
        if r.get("phase") == "flood":
            print(f"\nflood: alice p99 {r['p99_s']:.3f} s under bob's flood vs {r['alone_p99_s']:.3f} s alone "
                  f"({r['p99_vs_alone']}x); bob got {r['flood_images']} images, {r['flood_refused']} refused")


def measured_requests(log_path, trace):
    """The trace's requests as one strategy's server log reports them: each one's arrival (the
    trace's time: the log's line is written after the PNG encoding, so its time is not the run's
    end), pipeline, priority, steps, own run time and server-side latency (queue wait + run), in
    the trace's order; found by their seeds (the trace's request i has seed 1000 + i)."""
    by_seed, renewed, since_renewal = {}, False, set()
    for line in open(log_path, encoding="utf-8", errors="replace"):
        if " device_thread_renewed " in line:
            renewed, since_renewal = True, set()
        if " I request " not in line or " status=OK " not in line:
            continue
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        fields[" first_after_renewal"] = renewed and fields["pipeline"] not in since_renewal  # Not a log field.
        since_renewal.add(fields["pipeline"])
        by_seed.setdefault(int(fields.get("seed", "-1")), fields)  # The trace's, not the flood's after it.
    out = []
    for i, request in enumerate(trace):
        fields = by_seed.get(request["seed"])
        if fields is None or fields["pipeline"] != request["pipeline"]:
            continue
        run_s, wait_s = float(fields["run_s"]), float(fields.get("queue_wait_s", "0"))
        stages = dict((k, float(v)) for k, v in (p.split(":", 1) for p in fields.get("stages", "none").split(",")
                                                 if ":" in p))
        out.append({"arrival": request["t"], "pipeline": request["pipeline"], "priority": request["priority"],
                    "steps": request["steps"], "run": run_s, "latency": wait_s + run_s, "stages": stages,
                    "first_after_renewal": fields[" first_after_renewal"]})
    return out


def renewal_excess(runs):
    """What a thread renewal cost each run after it: `runs` as (pipeline, stages {name: s}, first run of
    its pipeline since a renewal) — for each first run, what its prompt encoding + denoising took over the
    median of its pipeline's other runs (the stages a renewal of the worker's thread slows by rebuilding
    cuDNN's attention graphs: multi-tenant run 16; the decode, which a renewal is for, is left out);
    None for the other runs and where the pipeline has no other run."""
    def work(stages):
        return stages.get("encode_prompt", 0.0) + stages["denoise"]
    others = {}
    for pipeline, stages, first in runs:
        if not first and "denoise" in stages:
            others.setdefault(pipeline, []).append(work(stages))
    return [work(stages) - percentile(others[pipeline], 0.5)
            if first and "denoise" in stages and pipeline in others else None
            for pipeline, stages, first in runs]


def remove_renewal_cost(requests):
    """What if thread renewals cost nothing (the convolution lane's aim): each pipeline's first run after
    a renewal loses its renewal_excess. Changes `requests` (measured_requests') in place; returns how many
    runs it shortened and by how many seconds in all."""
    shortened, seconds = 0, 0.0
    excess = renewal_excess([(r["pipeline"], r["stages"], r["first_after_renewal"]) for r in requests])
    for r, extra in zip(requests, excess):
        if extra is not None and extra > 0:
            r["run"] -= extra
            shortened, seconds = shortened + 1, seconds + extra
    return shortened, seconds


def encode_times(requests):
    """Each pipeline's PNG encoding time, which a reply's run time includes but the worker does not
    wait for (the caller's thread encodes while the next request runs): where a request started as
    soon as the one before it left the device (it had waited), that one's run ended its encoding
    earlier. The median per pipeline (0 where no such pair was seen)."""
    starts = sorted((r["arrival"] + r["latency"] - r["run"], r) for r in requests)
    seen = {}
    for (start, r), (next_start, n) in zip(starts, starts[1:]):
        if n["latency"] - n["run"] > 0.01:  # The next one waited: the worker went on at once.
            seen.setdefault(r["pipeline"], []).append(max(0.0, start + r["run"] - next_start))
    return {p: percentile(v, 0.5) for p, v in seen.items()}


def replay_model(requests, resident_pipelines, reorder_s, preemption, encode=None):
    """A model of one device's worker replaying `requests` (their arrivals and own run times): strict
    priority, first come first served within it, a request of a resident pipeline (nothing to move)
    ahead of an older one while that one waited less than `reorder_s`; with `preemption`
    ("priority" or "resident", SchedulerConfig.preemption) the request it would pick next runs
    between two steps of the running one when it preempts (shorter: by each pipeline's mean run;
    steps equal shares of a run; a
    preempted run assumed no slower for the pause; `encode`: each pipeline's PNG encoding, in the
    run time and the latency but not the worker's time). Returns each request's latency (server
    side: arrival to reply), in the requests' order."""
    encode = encode or {}
    order = sorted(range(len(requests)), key=lambda i: requests[i]["arrival"])
    waiting, latency, arrived = [], [None] * len(requests), 0
    t = 0.0

    def admit(until):
        nonlocal arrived
        while arrived < len(order) and requests[order[arrived]]["arrival"] <= until:
            waiting.append(order[arrived])
            arrived += 1

    def pick(now):
        top = max(requests[i]["priority"] for i in waiting)
        level = [i for i in waiting if requests[i]["priority"] == top]  # In arrival order.
        oldest = level[0]
        if reorder_s > 0 and requests[oldest]["pipeline"] not in resident_pipelines and \
                now - requests[oldest]["arrival"] < reorder_s:
            resident = [i for i in level if requests[i]["pipeline"] in resident_pipelines]
            if resident:
                return resident[0]
        return oldest

    # Which run is shorter goes by expected seconds, as the server's once it has seen each pipeline
    # run: each pipeline's mean run.
    runs = {}
    for r in requests:
        runs.setdefault(r["pipeline"], []).append(r["run"])
    expected = {p: sum(v) / len(v) for p, v in runs.items()}

    def cost(i):
        return expected[requests[i]["pipeline"]]

    def run(i, now, may_be_preempted):
        r = requests[i]
        tail = min(encode.get(r["pipeline"], 0.0), r["run"])
        step = (r["run"] - tail) / r["steps"]
        paused = 0.0
        for done in range(1, r["steps"] + 1):
            now += step
            if done == r["steps"] or not may_be_preempted or preemption == "none":
                continue
            admit(now)
            if not waiting:
                continue
            j = pick(now)
            c = requests[j]
            preempts = c["priority"] > r["priority"] or (
                preemption == "resident" and c["priority"] == r["priority"] and c["pipeline"] in resident_pipelines
                and cost(j) < cost(i) * (r["steps"] - done) / r["steps"] and paused < reorder_s)
            if preempts:
                waiting.remove(j)
                start = now
                now = run(j, now, False)
                paused += now - start
        latency[i] = now + tail - r["arrival"]
        return now

    while arrived < len(order) or waiting:
        if not waiting:
            t = max(t, requests[order[arrived]]["arrival"])
        admit(t)
        i = pick(t)
        waiting.remove(i)
        t = run(i, t, True)
    return latency


def replay_preemption(log_dir, rows_path, run_x=None, renewal_free=False):
    """Estimates what preemption between steps would change on a run's trace: the scheduler
    strategy's requests (arrivals and own run times from its server log) replayed through
    replay_model without preemption (against the measured latencies: how good the model is) and
    with each policy, each pipeline's server-side p50 and p99 beside the resident strategy's
    measured ones. A model, not a measurement: it assumes a preempted run is no slower afterwards
    (its spare-room cache may have given room to the preempting request) and the hot pipeline (the
    --keep_resident transformer's) moves nothing. `run_x` ({pipeline: x}): what if that pipeline's
    runs under the budget took x times its resident runs (each request's run scaled by x over the
    ratio of the pipeline's mean runs): which run times the targets need. `renewal_free`: the first run
    of each pipeline after a thread renewal without what the renewal cost it (remove_renewal_cost)."""
    rows = [json.loads(line) for line in open(rows_path, encoding="utf-8")]
    info = next((r["trace"] for r in rows if "trace" in r), {})
    steps = next((r["steps"] for r in rows if "steps" in r), {})
    trace = make_trace(info["requests"], info["rate_per_s"], info["zipf"], info["seed"], steps)
    keep = next((r.get("keep_resident") for r in rows if r.get("keep_resident")), [])
    resident_pipelines = {c.split("/")[0] for c in keep if c.endswith("/transformer")}
    reorder_s = next((r.get("reorder_ms", 4000) for r in rows if r.get("strategy") == "scheduler"), 4000) / 1000
    measured = measured_requests(os.path.join(log_dir, "scheduler.log"), trace)
    resident = measured_requests(os.path.join(log_dir, "resident.log"), trace)
    encode = encode_times(measured)  # From the runs as measured.
    scaled = False
    if renewal_free:
        shortened, seconds = remove_renewal_cost(measured)
        scaled = True
    for pipeline, x in (run_x or {}).items():
        mine = [r for r in measured if r["pipeline"] == pipeline]
        base = [r["run"] for r in resident if r["pipeline"] == pipeline]
        if not mine or not base:
            raise SystemExit(f"--run_x: no requests of pipeline '{pipeline}' in both strategies")
        factor = x * (sum(base) / len(base)) / (sum(r["run"] for r in mine) / len(mine))
        for r in mine:
            r["run"] *= factor
        scaled = True
    print(f"replay of {len(measured)} requests (scheduler strategy), resident pipelines {sorted(resident_pipelines)}, "
          f"reorder bound {reorder_s:g} s; server-side latency p50 / p99 s (x the resident strategy's measured)")
    if run_x:
        print("  runs scaled: " + ", ".join(f"{p} {x:g}x its resident run" for p, x in sorted(run_x.items())))
    if renewal_free:
        print(f"  renewals made free: {shortened} first runs after a renewal shortened by {seconds:.3f} s in all")
    print("  PNG encoding per pipeline (in a reply's run time, off the worker): "
          + ", ".join(f"{p} {e:.3f} s" for p, e in sorted(encode.items())))
    models = {policy: replay_model(measured, resident_pipelines, reorder_s, policy, encode)
              for policy in ("none", "priority", "resident")}
    for pipeline in ("all",) + POPULARITY:
        def sel(reqs, values):
            return [v for r, v in zip(reqs, values) if pipeline == "all" or r["pipeline"] == pipeline]
        base = sel(resident, [r["latency"] for r in resident])
        if not base:
            continue
        b50, b99 = percentile(base, 0.5), percentile(base, 0.99)
        cells = [] if scaled else [("measured", sel(measured, [r["latency"] for r in measured]))]
        cells += [(f"model {policy}", sel(measured, values)) for policy, values in models.items()]
        text = ", ".join(f"{name} {percentile(v, 0.5):.3f} ({percentile(v, 0.5) / b50:.2f}x) / "
                         f"{percentile(v, 0.99):.3f} ({percentile(v, 0.99) / b99:.2f}x)" for name, v in cells)
        print(f"  {pipeline:13s} resident {b50:.3f} / {b99:.3f}; {text}")


# Placement decisions that move whole components from the host onto the device (peer copies,
# onload_from_peer, cross no host link and are left out).
WHOLE_MOVES = ("onload", "prefetch_pipeline")


def renewal_cost(runs, firsts):
    """analyze's line for what thread renewals cost (renewal_excess of analyze's `runs`, `firsts` one flag
    per run: its pipeline's first since a renewal); "" without such runs."""
    extra = [e for e in renewal_excess([(run[0], run[-1], first) for run, first in zip(runs, firsts)])
             if e is not None]
    if not extra:
        return ""
    return (f"first run of a pipeline after a renewal: {len(extra)}, their prompt encoding + denoising "
            f"{percentile(extra, 0.5):+.3f} s against the pipeline's other runs (median; largest {max(extra):+.3f} s)")


def logged_bytes(words):
    """Bytes of a placement log's size column ("4.02", "GiB"); 0 where the line has none."""
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    try:
        return int(float(words[0]) * units[words[1]])
    except (IndexError, KeyError, ValueError):
        return 0


def margin_events(lines):
    """(out-of-memory errors, margin widenings, margin narrowings) in placement log lines: the runs that
    ran out of device memory and how the spare-room caches' margin answered (widen_cache_margin,
    narrow_cache_margin)."""
    counts = {"oom": 0, "widen_cache_margin": 0, "narrow_cache_margin": 0}
    for line in lines:
        words = line.split()
        # The action follows the time and the request id (blank for decisions of no request).
        for action in words[1:3]:
            if action in counts:
                counts[action] += 1
                break
    return counts["oom"], counts["widen_cache_margin"], counts["narrow_cache_margin"]


def request_number(request_id):
    """req-411 -> 411; None for anything else (a decision of no request)."""
    head, _, tail = request_id.rpartition("-")
    return int(tail) if head and tail.isdigit() else None


def margin_by_request(lines, request_ids, initial):
    """How many of `request_ids` ran at each spare-room cache margin, from placement log lines: a
    request runs at the margin the last widen_cache_margin / narrow_cache_margin before or during it
    set (by request number; a decision of no request counts from the request after the one logged
    before it), and at `initial` before any. Returns [(margin label, requests)], a label's requests
    together, in the order the margins first came."""
    changes, last = [], None  # (request number, label), in log order.
    for line in lines:
        words = line.split()
        number = request_number(words[1]) if len(words) > 1 else None
        if number is not None:
            last = number
        for i in (1, 2):
            if i + 2 < len(words) and words[i] in ("widen_cache_margin", "narrow_cache_margin"):
                at = -1 if last is None else (last if number is not None else last + 0.5)
                changes.append((at, f"{words[i + 1]} {words[i + 2]}"))
                break
    counts = {}
    for request_id in request_ids:
        number = request_number(request_id)
        label = initial
        for at, margin in changes:
            if number is not None and at <= number:
                label = margin
        counts[label] = counts.get(label, 0) + 1
    order = [initial] + [m for _, m in changes]
    return [(m, counts[m]) for i, m in enumerate(order) if m in counts and m not in order[:i]]


# What a group-offloaded component's line in a placement dump says of its run so far:
# "...; 216 forwards; spare-room cache 0 groups (0 B), 911 onloads served (149.04 GiB not copied)".
# (the cache's part only once it held or served something).
CACHE_COUNTS = re.compile(r"; (\d+) forwards(?:; spare-room cache (.*?), (\d+) onloads served "
                          r"\(([0-9.]+) ([KMGT]?i?B) not copied\))?")
# "..., 6.26 GiB per forward, ...": the bytes one forward of a streamed component streams.
PER_FORWARD = re.compile(r"([0-9.]+) ([KMGT]?i?B) per forward")


def decode_note(decodes):
    """What running short cost the decode stage: `decodes` [(seconds, ran short)] of a pipeline's
    runs; the range of those that ran short beside the median of the rest ("" when none did)."""
    short = [d for d, s in decodes if s]
    rest = [d for d, s in decodes if not s]
    if not short or not rest:
        return ""
    return (f"; their decode {min(short):.3f}–{max(short):.3f} s against the others' median "
            f"{percentile(rest, 0.5):.3f} s")


def oom_fragments(lines):
    """Where the allocator's room lay at the placement log's out-of-memory decisions: LibTorch's
    message ("X GiB is reserved by PyTorch but unallocated", at the error) and, since session 44,
    the decision's "; allocator: ..." note (after the failed run unwound: what long-lived tensors
    pin) — ranges over the errors; "" when no decision says either."""
    at_error, pinned, small, free_segments = [], [], [], []
    gib = float(1 << 30)
    for line in lines:
        words = line.split()
        if "oom" not in words[1:3]:
            continue
        m = re.search(r"([0-9.]+) (GiB|MiB|KiB|bytes) is reserved by PyTorch but unallocated", line)
        if m:  # LibTorch writes "bytes" where the placement log writes "B".
            at_error.append(logged_bytes([m.group(1), "B" if m.group(2) == "bytes" else m.group(2)]) / gib)
        m = re.search(r"; allocator: [0-9]+ bytes reserved but unallocated: ([0-9]+) in [0-9]+ segments that hold "
                      r"live blocks too \(([0-9]+) of them in [0-9]+ segments of 20 MiB or less\), ([0-9]+) in", line)
        if m:
            pinned.append(int(m.group(1)) / gib)
            small.append(int(m.group(2)) / gib)
            free_segments.append(int(m.group(3)) / gib)
    parts = []
    span = lambda values: f"{min(values):.2f}-{max(values):.2f} GiB"
    if at_error:
        parts.append(f"reserved but unallocated at the {len(at_error)} errors {span(at_error)}")
    if pinned:
        parts.append(f"after them in segments holding live blocks {span(pinned)} (in segments of 20 MiB or less "
                     f"{span(small)}), in free segments {span(free_segments)}")
    return "allocator at out-of-memory errors: " + "; ".join(parts) if parts else ""


def analyze(log_dir, rows_path):
    """Where a run's time and bytes went, from its server and placement logs: per strategy, each
    pipeline's mean run time (the server's run_s, queueing excluded) of the measured requests (the
    first request of each pipeline, unmeasured, left out), the utilisation that implies at the
    trace's arrival rate, the whole-component onloads per component, the scheduler's reorders and
    the cross-pipeline prefetches (those over the whole run: warm-up and flood phase included). A
    batch's members each log the batch's run time: each counts its share (run_s / batch_size) toward
    the utilisation, and the mean batch size is printed."""
    rows = [json.loads(line) for line in open(rows_path, encoding="utf-8") if line.strip()]
    trace = next((r["trace"] for r in rows if "trace" in r), {})
    rate, count = trace.get("rate_per_s"), trace.get("requests")
    # Each strategy's bytes to the device per measured request (the replies' figure, its "all" row).
    per_request = {r.get("strategy"): r.get("bytes_moved_per_request") for r in rows
                   if r.get("pipeline") == "all" and "bytes_moved_per_request" in r}
    resident_stages = {}  # Pipeline -> stage -> the resident strategy's median.
    # On one loaded server (one_server.log) a strategy's placement dump counts what every strategy
    # before it did too: each strategy's own is the difference from the one before.
    one_server = os.path.exists(os.path.join(log_dir, "one_server.log"))
    before_counts, before_margin = {}, None
    for strategy in ("resident", "fifo", "scheduler"):
        log = os.path.join(log_dir, f"{strategy}.log")
        if not os.path.exists(log):
            continue
        runs, renewals, renewed, ids = [], 0, "worker thread", []
        firsts, since_renewal = [], set()  # Per run: its pipeline's first since a renewal.
        for line in open(log, encoding="utf-8", errors="replace"):
            # Since session 41: the device worker went on on a fresh thread after an allocator
            # out-of-memory error (per-thread cuDNN plans chosen short of memory are left behind);
            # since session 45 only the device's convolutions do ("thread=convolutions").
            if " device_thread_renewed " in line:
                renewals += 1
                since_renewal = set()
                if " thread=convolutions " in line:
                    renewed = "convolutions' thread"

            if " I request " not in line or " status=OK " not in line:
                continue
            fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
            ids.append(fields.get("id", ""))
            firsts.append(renewals > 0 and fields["pipeline"] not in since_renewal)
            since_renewal.add(fields["pipeline"])
            runs.append((fields["pipeline"], float(fields["run_s"]), max(1, int(fields.get("batch_size", "1"))),
                         float(fields.get("queue_wait_s", "0")),
                         # Logged since session 39: the allocator's retries and out-of-memory errors.
                         int(fields.get("allocator_retries", "0")), int(fields.get("allocator_ooms", "0")),
                         # Logged since session 40: each stage's time ("denoise:0.612,decode:0.101").
                         dict((k, float(v)) for k, v in (p.split(":", 1) for p in fields.get("stages", "none").split(",")
                                                         if ":" in p))))
        # The unmeasured first request of each pipeline, then the trace's (the flood phase's after it).
        runs = runs[len(POPULARITY):len(POPULARITY) + count if count else None]
        ids = ids[len(POPULARITY):len(POPULARITY) + count if count else None]
        firsts = firsts[len(POPULARITY):len(POPULARITY) + count if count else None]
        per, waits, short, stages, decodes = {}, {}, {}, {}, {}
        for pipeline, run_s, batch_size, wait_s, retries, ooms, stage_s in runs:
            if "decode" in stage_s:
                decodes.setdefault(pipeline, []).append((stage_s["decode"], bool(retries or ooms)))
            per.setdefault(pipeline, []).append(run_s)
            for stage, seconds in stage_s.items():
                stages.setdefault(pipeline, {}).setdefault(stage, []).append(seconds)
            waits.setdefault(pipeline, []).append(wait_s)
            # Each member of a batch logs the batch's counts: a member's share.
            short.setdefault(pipeline, []).append((retries / batch_size, ooms / batch_size))
        mean = sum(r[1] for r in runs) / max(1, len(runs))
        share = sum(r[1] / r[2] for r in runs) / max(1, len(runs))  # A batch's time split among its members.
        batch = sum(r[2] for r in runs) / max(1, len(runs))
        print(f"{strategy}: {len(runs)} measured requests, mean run {mean:.3f} s"
              + (f", utilisation at {rate}/s {rate * share:.0%}" if rate else "")
              + (f", mean batch {batch:.2f} (a request's share of its batch's run {share:.3f} s)" if batch > 1 else "")
              + (f", {renewed} renewed {renewals}x after allocator out-of-memory errors" if renewals else ""))
        cost = renewal_cost(runs, firsts)
        if cost:
            print("  " + cost)
        for pipeline in POPULARITY:
            if pipeline in per:
                # The server's queue wait (admission to the device queue until the run starts): with
                # the run time, what a request's latency is made of.
                w = waits[pipeline]
                # Runs during which the allocator ran short (retried after giving its cached blocks
                # back, or raised an out-of-memory error a library or placement recovered from).
                s = short[pipeline]
                hit = [(a, b) for a, b in s if a or b]
                print(f"  {pipeline:13s} mean run {sum(per[pipeline]) / len(per[pipeline]):.3f} s (n={len(per[pipeline])}), "
                      f"queue wait p50 {percentile(w, 0.5):.3f} s, mean {sum(w) / len(w):.3f} s"
                      + (f"; allocator ran short in {len(hit)} runs ({sum(a for a, _ in hit):g} retries, "
                         f"{sum(b for _, b in hit):g} OOMs)" if hit else "")
                      + decode_note(decodes.get(pipeline, [])))
                if pipeline in stages:
                    # The median of each stage: which one a slower run spends its extra time in (beside
                    # the resident strategy's, from the same analysis, where it ran first).
                    medians = {k: percentile(v, 0.5) for k, v in stages[pipeline].items()}
                    if strategy == "resident":
                        resident_stages[pipeline] = medians
                    base = resident_stages.get(pipeline, {}) if strategy != "resident" else {}
                    print("    stage p50: " + ", ".join(
                        f"{k} {m:.3f} s" + (f" ({m / base[k]:.2f}x resident)" if base.get(k) else "")
                        for k, m in medians.items()))
        placement_log = os.path.join(log_dir, f"{strategy}.placement_log.txt")
        if os.path.exists(placement_log):
            onloads, reorders, prefetches, cache_releases, onload_bytes = {}, 0, 0, 0, 0
            lines = open(placement_log, encoding="utf-8", errors="replace").readlines()
            for line in lines:
                words = line.split()
                # The action follows the time and the request id (blank for decisions of no request).
                at = next((i for i in (1, 2) if i + 1 < len(words) and words[i] in WHOLE_MOVES), None)
                if at is not None and (words[at] == "onload" or "its first groups" not in line):
                    # A whole component onto the device from the host: an onload, or a next pipeline's
                    # component prefetched whole (its first streamed groups are streaming, not a move).
                    if words[at] == "onload":
                        onloads[words[at + 1]] = onloads.get(words[at + 1], 0) + 1
                    onload_bytes += logged_bytes(words[at + 2:at + 4])
                elif len(words) >= 2 and words[1] == "schedule":
                    reorders += 1
                if "prefetch_pipeline" in words[1:3]:
                    prefetches += 1
                if "release_group_cache" in words[1:3]:
                    cache_releases += 1
            print("  onloads: " + ", ".join(f"{c} {n}" for c, n in sorted(onloads.items()))
                  + f"; reorders: {reorders}; pipeline prefetches: {prefetches}"
                  + f"; spare-room cache releases: {cache_releases}")
            ooms, widened, narrowed = margin_events(lines)
            print(f"  out of memory: {ooms}; cache margin widened {widened}, narrowed {narrowed}")
            fragments = oom_fragments(lines)
            if fragments:
                print("  " + fragments)
            if widened or narrowed:
                # How long each margin held: the spare-room caches are that much smaller for every
                # streamed request at it (multi-tenant run 15).
                start = before_margin if one_server and before_margin else "the configured margin"
                print("  measured requests by cache margin: " + ", ".join(
                    f"{margin} {n}" for margin, n in margin_by_request(lines, ids, start)))
            # What the order of requests can change: whole components moved onto the device (over the
            # whole run, warm-up included, so an upper bound for the measured requests) against
            # everything the link carried for them (streamed groups, prefetches and those moves).
            moved = per_request.get(strategy)
            if moved and count:
                share = onload_bytes / (moved * count)
                print(f"  bytes to the device per measured request {moved / 1e9:.2f} GB, of which whole-component "
                      f"onloads at most {onload_bytes / count / 1e9:.2f} GB ({share:.1%}; {onload_bytes} bytes over "
                      f"the run); the rest streamed")
        # The spare-room cache per streamed component, from the placement at the strategy's end.
        placement = os.path.join(log_dir, f"{strategy}.placement.txt")
        if os.path.exists(placement):
            component = None
            for line in open(placement, encoding="utf-8", errors="replace"):
                if line.startswith("device ") and "; cache margin " in line:
                    before_margin = line.split('; cache margin ', 1)[1].split(';')[0].strip()
                    print(f"  cache margin at the end: {before_margin}")
                if line.startswith("  ") and not line.startswith("    "):
                    component = line.split()[0]
                elif component and (m := CACHE_COUNTS.search(line)) and one_server:
                    forwards = int(m.group(1))
                    served = int(m.group(3)) if m.group(3) else 0
                    saved = logged_bytes([m.group(4), m.group(5)]) if m.group(4) else 0
                    f0, s0, b0 = before_counts.get(component, (0, 0, 0))
                    before_counts[component] = (forwards, served, saved)
                    if forwards > f0:
                        # The share of its forwards' bytes the cache spared (runs 11 and 18 on one trace:
                        # what set the Flux pipelines' p50s apart).
                        per = PER_FORWARD.search(line)
                        per_forward = logged_bytes([per.group(1), per.group(2)]) if per else 0
                        share = (f", {100 * (saved - b0) / ((forwards - f0) * per_forward):.1f} % of its forwards' "
                                 f"{per.group(1)} {per.group(2)} each" if per_forward else "")
                        print(f"  {component}: spare-room cache {m.group(2) or '0 groups (0 B)'} at the end; this "
                              f"strategy's {forwards - f0} forwards, {served - s0} onloads served "
                              f"({(saved - b0) / (1 << 30):.2f} GiB not copied){share}")
                elif "spare-room cache" in line and component:
                    print(f"  {component}: spare-room cache" + line.split("spare-room cache", 1)[1].rstrip())


def main():
    global ARGS, STEPS, TRACE, TRACE_INFO
    # A time limit's SIGTERM ends the run through the `finally`s that stop the servers it started.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("stowage")
    s.add_argument("--server", required=True)
    s.add_argument("--stowctl", required=True)
    s.add_argument("--zimage", required=True)
    s.add_argument("--flux", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--logs", required=True)
    s.add_argument("--budget_gib", type=float, default=24)
    s.add_argument("--size", type=int, default=1024)
    s.add_argument("--requests", type=int, default=200)
    s.add_argument("--rate", type=float, default=0.5, help="mean arrivals per second (Poisson)")
    s.add_argument("--zipf", type=float, default=1.1)
    s.add_argument("--trace_seed", type=int, default=1)
    s.add_argument("--steps", default="zimage=8,zimage-ft=8,flux-schnell=4,flux-dev=28")
    s.add_argument("--strategies", default="resident,fifo,scheduler")
    s.add_argument("--reorder_ms", type=int, default=4000)
    s.add_argument("--preemption", choices=sorted(PREEMPTION), default="none",
                   help="the scheduler strategy's SchedulerConfig.preemption: a waiting request runs between "
                        "the denoising steps of the running one when its priority is higher (priority), or also "
                        "when its pipeline moves nothing and its work is less than the running one has left, "
                        "within --reorder_ms of pause (resident)")
    s.add_argument("--separate_servers", action="store_true",
                   help="start a server for each budgeted strategy instead of switching one loaded server "
                        "from FIFO to the scheduler with the admin SetScheduler")
    s.add_argument("--flood_requests", type=int, default=30)
    s.add_argument("--flood_lead_s", type=float, default=2.0)
    s.add_argument("--flood_rate", type=float, default=0.3,
                   help="alice's arrivals per second in the flood phase (keep it within her fair share)")
    s.add_argument("--flux_compress", choices=["none", "int8", "int4"], default="none")
    s.add_argument("--text_encoder_compress", choices=["none", "int8", "int4"], default="none",
                   help="the streamed Qwen3 and T5 (not --keep_resident ones) from an int8 (grouped) or int4 host copy")
    s.add_argument("--flux_keep_gib", type=float, default=4.0)
    s.add_argument("--no_convolution_lane", action="store_true",
                   help="DeviceConfig.convolution_lane false: the convolutions on the worker's thread, and "
                        "allocator shortfalls renew the worker itself (the server before session 45)")
    s.add_argument("--cuda_expandable_segments", action="store_true",
                   help="ServerConfig.cuda_expandable_segments: the CUDA allocator maps memory in expandable "
                        "segments (no blocks too small for a VAE decode beside the spare-room caches)")
    s.add_argument("--cuda_max_split_size_mb", type=int, default=0,
                   help="ServerConfig.cuda_max_split_size_mb (0: off; 21..1048576): the CUDA allocator never "
                        "splits cached blocks larger than this, so its retry after a refusal can give whole "
                        "ones back (for hosts that refuse expandable segments)")
    s.add_argument("--streamed_group_cache", action="store_true",
                   help="DeviceConfig.streamed_group_cache on: a streamed transformer keeps what the budget's "
                        "free room holds of its groups between the steps of a request")
    s.add_argument("--zimage_ft_compress", choices=["off", "none", "int8", "int4"], default="off",
                   help="stream the fine-tune's transformer (none: bf16, or compressed) instead of moving it "
                        "whole (off, the default)")
    s.add_argument("--zimage_ft_keep_gib", type=float, default=0.0,
                   help="with --zimage_ft_compress: its device bytes kept resident")
    s.add_argument("--keep_resident", default="",
                   help="comma-separated component ids the budgeted strategies keep on the device "
                        "(FootprintStrategy.keep_resident), e.g. zimage/text_encoder: the hot pipeline's text "
                        "encoder, shared with zimage-ft, whole instead of streamed")
    s.add_argument("--compute", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: every transformer's block linears as FP8 GEMMs in every strategy (CUDA only)")
    s.add_argument("--text_encoder_compute", choices=["bf16", "fp8"], default="bf16",
                   help="Z-Image's Qwen3 text encoder (resident beside the hot transformer) as FP8 GEMMs: half "
                        "its 7.3 GiB, room the streamed transformers' spare-room caches can use")
    s.add_argument("--t5_compute", choices=["bf16", "fp8"], default="bf16",
                   help="Flux's T5 text encoder (text_encoder_2) as FP8 GEMMs: half its 8.9 GiB, so "
                        "--keep_resident flux-schnell/text_encoder_2 keeps it whole where bf16 would not fit")
    s.add_argument("--max_batch_size", type=int, default=1,
                   help="1..64; above 1, queued requests of one pipeline, size and steps run as one batch")
    s.add_argument("--max_queue_delay_ms", type=int, default=0,
                   help="0..60000: how long a batch may wait for more members (BatchingConfig)")
    s.add_argument("--batch_in", default="resident,fifo,scheduler",
                   help="the strategies that batch (--max_batch_size); e.g. resident,scheduler keeps FIFO as it was")
    s.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--machine", default="unknown")
    s.add_argument("--commit", default="unknown")
    t = sub.add_parser("table")
    t.add_argument("rows")
    a = sub.add_parser("analyze")
    a.add_argument("logs", help="the --logs folder of a run")
    a.add_argument("rows", help="that run's rows (for its arrival rate)")
    r = sub.add_parser("replay")
    r.add_argument("logs", help="the --logs folder of a run with resident and scheduler strategies")
    r.add_argument("rows", help="that run's rows")
    r.add_argument("--renewal_free", action="store_true",
                   help="each pipeline's first run after a thread renewal without what its prompt encoding and "
                        "denoising took over the pipeline's median (what the convolution lane should save)")
    r.add_argument("--run_x", default="",
                   help="e.g. flux-dev=1.1,flux-schnell=1.1: those pipelines' runs as that many times their "
                        "resident runs (what run times the targets need)")
    ARGS = parser.parse_args()
    if ARGS.command == "replay":
        run_x = dict((k, float(v)) for k, v in (i.split("=") for i in ARGS.run_x.split(",") if i))
        replay_preemption(ARGS.logs, ARGS.rows, run_x, ARGS.renewal_free)
        return
    if ARGS.command == "table":
        table([json.loads(line) for line in open(ARGS.rows, encoding="utf-8")])
        return
    if ARGS.command == "analyze":
        analyze(ARGS.logs, ARGS.rows)
        return
    STEPS = dict((k, int(v)) for k, v in (item.split("=") for item in ARGS.steps.split(",")))
    if sorted(STEPS) != sorted(POPULARITY):
        raise SystemExit(f"--steps must name each of {', '.join(POPULARITY)}")
    if ARGS.rate <= 0 or ARGS.flood_rate <= 0:
        raise SystemExit("--rate and --flood_rate must be above 0 (arrivals per second)")
    if not 1 <= ARGS.max_batch_size <= 64 or not 0 <= ARGS.max_queue_delay_ms <= 60000:
        raise SystemExit("--max_batch_size must be 1..64 and --max_queue_delay_ms 0..60000")
    if any(s not in ("resident", "fifo", "scheduler") for s in batching_strategies()):
        raise SystemExit("--batch_in: names among resident, fifo, scheduler")
    if ARGS.preemption == "resident" and ARGS.reorder_ms <= 0:
        raise SystemExit("--preemption resident bounds each running request's pause by --reorder_ms: set it above 0")
    for flag, value in (("--compute", ARGS.compute), ("--text_encoder_compute", ARGS.text_encoder_compute),
                        ("--t5_compute", ARGS.t5_compute)):
        if value == "fp8" and ARGS.device == "sim":
            raise SystemExit(f"{flag} fp8 needs --device cuda (FP8 tensor cores)")
    TRACE = make_trace(ARGS.requests, ARGS.rate, ARGS.zipf, ARGS.trace_seed, STEPS)
    TRACE_INFO = {"requests": ARGS.requests, "rate_per_s": ARGS.rate, "zipf": ARGS.zipf, "seed": ARGS.trace_seed,
                  "popularity": list(POPULARITY), "tenants": {"alice": 0.7, "bob": 0.3}, "high_priority": 0.2}
    os.makedirs(ARGS.logs, exist_ok=True)
    budget = int(ARGS.budget_gib * GIB)
    # The resident figures come only from this run's resident strategy: a ratio never divides by
    # another run's number (without it, resident_p50_s/resident_p99_s stay null).
    resident = {}
    rows = []
    strategies = ARGS.strategies.split(",")
    if any(s not in ("resident", "fifo", "scheduler") for s in strategies) or len(set(strategies)) != len(strategies):
        raise SystemExit("--strategies: distinct names among resident, fifo, scheduler")
    if not ARGS.separate_servers and len(strategies) > 1:
        # Resident first (its rows are the others' reference), then the budgeted ones on the same server.
        order = [s for s in ("resident", "fifo", "scheduler") if s in strategies]
        rows = run_on_one_server(order, budget, resident)
        table(rows)
        return
    for strategy in strategies:
        got = run_strategy(strategy, budget, resident)
        if strategy == "resident":
            resident = {r["pipeline"]: (r["p50_s"], r["p99_s"]) for r in got}
        rows += got
    table(rows)


if __name__ == "__main__":
    main()
