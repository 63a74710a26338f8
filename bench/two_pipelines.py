"""Two pipelines, one device budget: Z-Image and Flux.1 served by one Stowage server whose device
budget holds neither pipeline's weights together with the other's (issue 11, part 5).

    python3 bench/two_pipelines.py stowage --server BIN --stowctl BIN --zimage DIR --flux DIR \
        --out ROWS.jsonl --logs LOG_DIR [--budget_gib 24] [--size 1024] [--steps 8] [--machine M] \
        [--device cuda|sim] [--phases footprint,workflow,...] [--dtype bfloat16] [--resident_from ROWS.jsonl]
        [--compute bf16|fp8] [--streamed_group_cache]

DIR: model directories drawn with random weights (bench/make_zimage_random_dir.py,
bench/make_flux_random_dir.py). Two servers run, one after the other:
  1. "resident": no budget, every component kept resident (workflow keep_resident rules) — each
     pipeline's latency when nothing ever moves (resident_latency_s of every row).
  2. the budgeted server (memory_budget_bytes = --budget_gib GiB); its placement changes between
     phases through the admin API (set-strategy, enable/disable-group-offload), as an operator would:
       footprint     the default footprint strategy: whole components move when memory runs short.
       workflow      a rule set: each text encoder leaves right after it ran, each transformer
                     after the VAE ran (a request leaves the device to the next one).
       stream_te     footprint, with the big text encoders (Qwen3, T5) group-offloaded (streamed,
                     never resident), the transformers moved whole.
       best          footprint, Qwen3 and T5 streamed, each transformer group-offloaded with a
                     device budget that keeps part of it resident for good (--zimage_keep_gib,
                     --flux_keep_gib), VAEs resident: nothing moves between the pipelines.
       best_int8     best, with the streamed groups of the text encoders and transformers sent as
                     int8 with per-channel scales (group offload compress: COMPRESS_INT8): half the
                     bytes over PCIe per step; the resident part stays exact, the streamed part is
                     lossy (< 1 % per weight), so images differ slightly from the other phases'.
       best_mixed    best for Z-Image (exact), best_int8 for Flux (whose 23.8 GB transformer streams
                     half of itself every step; Z-Image's streamed part is small enough that
                     widening int8 costs it more than the halved copy saves).
       fit           the streaming issue's modes (with --compute fp8: 5.7 + 11.2 GiB of FP8
                     transformers fit the budget together): footprint keeping both transformers, both
                     VAEs and CLIP resident for good (keep_resident), Qwen3 and T5 streamed from
                     int8 group-wise host copies (COMPRESS_INT8_GROUPED: half the bf16 bytes over
                     PCIe, once per request): nothing moves whole between the pipelines.
--compute fp8 runs both transformers' block linears as FP8 GEMMs on both servers (the resident one
too: every ratio is against the same compute); --streamed_group_cache turns the device's spare-room
cache on (streamed groups kept in budget room nothing else holds).
Each phase (and the resident server) first sends one unmeasured request per pipeline, then
--rounds alternating requests (Z-Image, Flux, Z-Image, ...), then --rounds pairs sent concurrently
(one per pipeline at once). Requests go over the OpenAI-compatible HTTP API; a request's latency is
the client's (request sent to PNG received). Peak device bytes are the replies' peak as the GPU sees
it (X-Stowage-Peak-Device-Reserved-Bytes: allocator reserve plus CUDA context). After each phase the
placement log (why each move happened) and the placement are saved under --logs.

Rows, one per (phase, pipeline, arrival):
  {"bench":"two_pipelines","strategy":..,"pipeline":"zimage"|"flux","arrival":"alternating"|"concurrent",
   "latency_s":<mean>,"resident_latency_s":<the resident server's mean for the same arrival>,
   "latencies_s":[..],"peak_device_bytes":..,"budget_bytes":..,"ok":<every request succeeded and the
   peak stayed within the budget>,"errors":[..],"size":..,"steps":..,"machine":..}

    python3 bench/two_pipelines.py table ROWS.jsonl
        The rows as a Markdown table (mean latency, x resident, peak GiB).

Standard library only (HTTP and subprocess); the diffusers baseline is
bench/diffusers_two_pipelines.py.
"""

import argparse
import base64
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

GIB = 1 << 30
PIPELINES = ("zimage", "flux")
PROMPTS = {"zimage": "a lighthouse on a cliff at dusk, oil painting",
           "flux": "a red fox in fresh snow, morning light, photograph"}
TOKEN = "two-pipelines-bench"
BLOCK = "offload_type: BLOCK_LEVEL num_blocks_per_group: 1 use_stream: true"
KEEP_ALL = ('strategy { workflow { rules { keep_resident: "text_encoder" } rules { keep_resident: "text_encoder_2" } '
            'rules { keep_resident: "transformer" } rules { keep_resident: "vae" } } }')
FOOTPRINT = "footprint { reserve_bytes: 0 }"
# The fit phase's whole components, never evicted (the text encoders stream instead).
FIT_KEEP = ("zimage/transformer", "flux/transformer", "zimage/vae", "flux/vae", "flux/text_encoder")
WORKFLOW = ('workflow { rules { after { component: "text_encoder" offload: "text_encoder" } } '
            'rules { after { component: "text_encoder_2" offload: "text_encoder_2" } } '
            'rules { after { component: "vae" offload: "transformer" } } }')


class AdminError(Exception):
    """An admin call the phase needs was refused (the phase is reported as failed, the run goes on)."""


class Server:
    def __init__(self, binary, config_text, log_path):
        self.log_path = log_path
        ports = log_path + ".ports.json"
        if os.path.exists(ports):
            os.remove(ports)
        config = log_path + ".textproto"
        with open(config, "w", encoding="utf-8") as f:
            f.write(config_text)
        self.log = open(log_path, "w", encoding="utf-8")
        self.proc = subprocess.Popen([binary, f"--config={config}", f"--port_file={ports}"], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.time() + 900  # Drawing ~27 B random parameters and the warm-up take a while.
        while not os.path.exists(ports) or os.path.getsize(ports) == 0:
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise SystemExit(f"server did not start; log {log_path}:\n" + open(log_path).read()[-4000:])
            time.sleep(0.1)
        addresses = json.load(open(ports))
        self.grpc, self.http = addresses["grpc_address"], addresses["http_address"]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def generate(server, pipeline, size, steps, seed):
    """One image over HTTP: (latency_s, peak_device_reserved_bytes, error or None)."""
    body = json.dumps({"model": pipeline, "prompt": PROMPTS[pipeline], "size": f"{size}x{size}",
                       "num_inference_steps": steps, "seed": seed, "response_format": "b64_json"}).encode()
    request = urllib.request.Request(f"http://{server.http}/v1/images/generations", data=body,
                                     headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    try:
        with urllib.request.urlopen(request, timeout=600) as reply:
            payload = json.loads(reply.read())
            peak = int(reply.headers.get("X-Stowage-Peak-Device-Reserved-Bytes", "0"))
    except urllib.error.HTTPError as e:
        return time.perf_counter() - start, 0, f"HTTP {e.code}: {e.read()[:500].decode(errors='replace')}"
    except (urllib.error.URLError, OSError) as e:
        return time.perf_counter() - start, 0, f"{type(e).__name__}: {e}"
    latency = time.perf_counter() - start
    png = base64.b64decode(payload["data"][0]["b64_json"])
    if not png.startswith(b"\x89PNG"):
        return latency, peak, "reply is not a PNG"
    return latency, peak, None


def run_phase(server, size, steps):
    """Warm-up, alternating and concurrent requests: {(pipeline, arrival): [(latency, peak, error)]}."""
    results = {}
    seed = 1
    for pipeline in PIPELINES:  # Unmeasured: the phase's first placement happens here.
        generate(server, pipeline, size, steps, seed)
    for i in range(ARGS.rounds * len(PIPELINES)):
        pipeline = PIPELINES[i % len(PIPELINES)]
        seed += 1
        results.setdefault((pipeline, "alternating"), []).append(generate(server, pipeline, size, steps, seed))
    for _ in range(ARGS.rounds):
        outcome = {}

        def one(p, s):
            outcome[p] = generate(server, p, size, steps, s)

        threads = []
        for pipeline in PIPELINES:
            seed += 1
            threads.append(threading.Thread(target=one, args=(pipeline, seed)))
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for pipeline in PIPELINES:
            results.setdefault((pipeline, "concurrent"), []).append(outcome[pipeline])
    return results


def stowctl(server, *args):
    command = [ARGS.stowctl, f"--target={server.grpc}", f"--token={TOKEN}", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AdminError(f"{' '.join(args[:2])} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def save_placement(server, name):
    with open(os.path.join(ARGS.logs, f"{name}.placement_log.txt"), "w", encoding="utf-8") as f:
        f.write(stowctl(server, "placement-log", "--limit=500"))
    with open(os.path.join(ARGS.logs, f"{name}.placement.txt"), "w", encoding="utf-8") as f:
        f.write(stowctl(server, "placement"))


def config_text(budget_bytes, strategy):
    cache = " streamed_group_cache { enabled: true }" if ARGS.streamed_group_cache else ""
    device = ("device { kind: KIND_SIMULATED memory_budget_bytes: %d%s }" if ARGS.device == "sim"
              else "device { kind: KIND_CUDA memory_budget_bytes: %d%s }") % (budget_bytes, cache)
    compute = ' compute { key: "transformer" value: COMPUTE_FP8 }' if ARGS.compute == "fp8" else ""
    pipelines = "".join(
        f'pipelines {{ name: "{name}" model_dir: "{directory}" random_weights: true dtype: "{ARGS.dtype}"{compute} }}\n'
        for name, directory in (("zimage", ARGS.zimage), ("flux", ARGS.flux)))
    return (f'grpc_address: "127.0.0.1:0"\nhttp_address: "127.0.0.1:0"\nmetrics_address: "none"\n'
            f'queue_depth: 16\nauth {{ admin_token: "{TOKEN}" }}\n{device}\n{pipelines}{strategy}\n')


def set_phase(server, phase):
    """The budgeted server's placement for `phase`, through the admin API."""
    for pipeline in PIPELINES:  # Back to whole components (fails harmlessly where nothing is offloaded).
        subprocess.run([ARGS.stowctl, f"--target={server.grpc}", f"--token={TOKEN}", "disable-group-offload",
                        f"--pipeline={pipeline}"], capture_output=True, timeout=600)
    if phase == "workflow":
        stowctl(server, "set-strategy", f"--strategy={WORKFLOW}")
        return
    if phase == "fit":
        keep = "".join(f' keep_resident: "{c}"' for c in FIT_KEEP)
        stowctl(server, "set-strategy", f"--strategy=footprint {{ reserve_bytes: 0{keep} }}")
        for component in ("zimage/text_encoder", "flux/text_encoder_2"):
            stowctl(server, "enable-group-offload", f"--component={component}",
                    f"--options={BLOCK} compress: COMPRESS_INT8_GROUPED")
        return
    stowctl(server, "set-strategy", f"--strategy={FOOTPRINT}")
    def compress(component):
        int8 = phase == "best_int8" or (phase == "best_mixed" and component.startswith("flux/"))
        return " compress: COMPRESS_INT8" if int8 else ""

    if phase in ("stream_te", "best", "best_int8", "best_mixed"):
        # CLIP-L (0.25 GB) stays whole.
        for component in ("zimage/text_encoder", "flux/text_encoder_2"):
            stowctl(server, "enable-group-offload", f"--component={component}",
                    f"--options={BLOCK}{compress(component)}")
    if phase in ("best", "best_int8", "best_mixed"):
        for component, keep in (("zimage/transformer", ARGS.zimage_keep_gib), ("flux/transformer", ARGS.flux_keep_gib)):
            stowctl(server, "enable-group-offload", f"--component={component}",
                    f"--options={BLOCK} budget_bytes: {int(keep * GIB)}{compress(component)}")


def main_stowage():
    os.makedirs(ARGS.logs, exist_ok=True)
    budget = int(ARGS.budget_gib * GIB)
    if ARGS.resident_from:
        # The resident server's means from an earlier run on the same machine and sizes.
        resident_mean = {(r["pipeline"], r["arrival"]): r["latency_s"]
                         for r in map(json.loads, open(ARGS.resident_from, encoding="utf-8"))
                         if r.get("strategy") == "resident" and r.get("size") == ARGS.size
                         and r.get("steps") == ARGS.steps and r.get("compute", "bf16") == ARGS.compute}
        if len(resident_mean) != 2 * len(PIPELINES):
            raise SystemExit(f"{ARGS.resident_from} lacks resident rows for size {ARGS.size}, {ARGS.steps} steps, "
                             f"{ARGS.compute} compute")
        rows = []
    else:
        print(f"== resident server (no budget)", flush=True)
        server = Server(ARGS.server, config_text(0, KEEP_ALL), os.path.join(ARGS.logs, "resident.log"))
        try:
            resident = run_phase(server, ARGS.size, ARGS.steps)
            save_placement(server, "resident")
        finally:
            server.stop()
        resident_mean = {k: statistics.mean(r[0] for r in v) for k, v in resident.items()}
        rows = emit([row("resident", k, v, resident_mean, 0) for k, v in resident.items()])
    print(f"== budgeted server ({ARGS.budget_gib} GiB)", flush=True)
    server = Server(ARGS.server, config_text(budget, f"strategy {{ {FOOTPRINT} }}"),
                    os.path.join(ARGS.logs, "budgeted.log"))
    try:
        for phase in ARGS.phases.split(","):
            print(f"== phase {phase}", flush=True)
            try:
                set_phase(server, phase)
            except AdminError as e:
                print(f"phase {phase} not run: {e}", flush=True)
                rows += emit([row(phase, (p, a), [(0.0, 0, str(e))], resident_mean, budget)
                              for p in PIPELINES for a in ("alternating", "concurrent")])
                continue
            results = run_phase(server, ARGS.size, ARGS.steps)
            save_placement(server, phase)
            rows += emit([row(phase, k, v, resident_mean, budget) for k, v in results.items()])
    finally:
        server.stop()
    table(rows)


def emit(rows):
    """Appends `rows` to --out at once (a run cut short keeps the phases it finished)."""
    with open(ARGS.out, "a", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def row(strategy, key, results, resident_mean, budget):
    pipeline, arrival = key
    errors = [e for _, _, e in results if e]
    peak = max(p for _, p, _ in results)
    return {"bench": "two_pipelines", "strategy": strategy, "pipeline": pipeline, "arrival": arrival,
            "latency_s": statistics.mean(r[0] for r in results), "resident_latency_s": resident_mean[key],
            "latencies_s": [r[0] for r in results], "peak_device_bytes": peak, "budget_bytes": budget,
            "ok": not errors and (budget == 0 or peak <= budget), "errors": errors, "size": ARGS.size,
            "steps": ARGS.steps, "compute": ARGS.compute, "streamed_group_cache": ARGS.streamed_group_cache,
            "machine": ARGS.machine, "commit": ARGS.commit}


def table(rows):
    print("| strategy | pipeline | arrival | mean latency s | x resident | peak GiB | budget GiB | ok |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["latency_s"] / r["resident_latency_s"] if r.get("resident_latency_s") else float("nan")
        print(f"| {r['strategy']} | {r['pipeline']} | {r.get('arrival', '')} | {r['latency_s']:.3f} | {ratio:.2f} | "
              f"{r['peak_device_bytes'] / GIB:.2f} | {r['budget_bytes'] / GIB:.3g} | {r['ok']} |")


def main():
    global ARGS
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
    s.add_argument("--steps", type=int, default=8)
    s.add_argument("--rounds", type=int, default=2)
    s.add_argument("--machine", default="unknown")
    s.add_argument("--commit", default="unknown")
    s.add_argument("--device", choices=["cuda", "sim"], default="cuda")
    s.add_argument("--dtype", default="bfloat16")
    s.add_argument("--compute", choices=["bf16", "fp8"], default="bf16",
                   help="fp8: both transformers' block linears as FP8 GEMMs, on both servers")
    s.add_argument("--streamed_group_cache", action="store_true",
                   help="the device's spare-room cache for streamed groups (both servers)")
    s.add_argument("--phases", default="footprint,workflow,stream_te,best,best_int8,best_mixed")
    s.add_argument("--resident_from", default="",
                   help="take the resident latencies from this earlier rows file instead of running the resident server")
    s.add_argument("--zimage_keep_gib", type=float, default=4.0,
                   help="best*: device bytes the Z-Image transformer keeps resident")
    s.add_argument("--flux_keep_gib", type=float, default=12.0,
                   help="best*: device bytes the Flux transformer keeps resident")
    t = sub.add_parser("table")
    t.add_argument("rows")
    ARGS = parser.parse_args()
    if ARGS.command == "table":
        table([json.loads(line) for line in open(ARGS.rows, encoding="utf-8")])
    else:
        main_stowage()


if __name__ == "__main__":
    main()
