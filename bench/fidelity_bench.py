"""Fidelity of lossy modes on the trained demo pipeline `shapes` (models/demo): its caption-rule accuracy
on the 48 evaluation prompts (models/demo/captions.eval_prompts, 8 steps, guidance 0, the training's
evaluation protocol) and each image's PSNR against the same prompt and seed in bf16 — random weights
amplify any perturbation through the layers and say little about a trained model.

    python3 bench/fidelity_bench.py --server BIN --stowctl BIN --out ROWS.jsonl --machine M --commit C \\
        [--modes float32,bf16,fp8] [--model_dir models/demo/shapes]

Each mode is one server process (stowage_server --config with the shapes directory; fp8 sets
PipelineConfig.compute {transformer: COMPUTE_FP8}; stream_<format> streams the transformer's blocks
from host copies compressed to that format: group_offload with compress COMPRESS_<FORMAT>; fp8_stream_int4:
FP8 compute, the FP8 weights streamed as int4 and widened back into e4m3 on the device);
images come back through stowctl. Rows:
{"bench": "fidelity", "pipeline": "shapes", "mode", "accuracy", "fg", "bg", "position", "psnr_db" (mean
over the prompts, against bf16), "psnr_min_db", "prompts", "machine", "commit"}.
"""

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "models", "demo"))
import captions  # noqa: E402

def streamed(compress, compute=""):
    return ('dtype: "bfloat16"', compute + ' group_offload { enabled: true exclude: "text_encoder" exclude: "vae" '
            f'defaults {{ use_stream: true compress: {compress} }} }}')


FP8 = 'compute { key: "transformer" value: COMPUTE_FP8 }'


MODES = {
    "float32": ('dtype: "float32"', ""),
    "bf16": ('dtype: "bfloat16"', ""),
    "fp8": ('dtype: "bfloat16"', FP8),
    "stream_int8": streamed("COMPRESS_INT8"),
    "stream_fp8": streamed("COMPRESS_FP8"),
    "stream_int8_grouped": streamed("COMPRESS_INT8_GROUPED"),
    "stream_int4": streamed("COMPRESS_INT4"),
    # FP8 compute with its FP8 weights streamed as int4 and widened on the device back into e4m3
    # (CUDA only: the simulated device refuses int4 of float8).
    "fp8_stream_int4": streamed("COMPRESS_INT4", FP8),
}


def start(server, config_text, tmp):
    config = os.path.join(tmp, "config.textproto")
    with open(config, "w") as f:
        f.write(config_text)
    ports = os.path.join(tmp, "ports.json")
    log = open(os.path.join(tmp, "server.log"), "w")
    proc = subprocess.Popen([server, f"--config={config}", f"--port_file={ports}"], stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.time() + 300
    while not (os.path.exists(ports) and os.path.getsize(ports) > 0):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise RuntimeError("server did not start: " + open(log.name).read()[-3000:])
        time.sleep(0.05)
    with open(ports) as f:
        return proc, json.load(f)["grpc_address"]


def images_for(mode, args, tmp):
    import numpy as np
    from PIL import Image

    dtype, compute = MODES[mode]
    text = (f'grpc_address: "127.0.0.1:0"\nmetrics_address: "none"\n'
            f'pipelines {{ name: "shapes" model_dir: "{os.path.abspath(args.model_dir)}" {dtype} {compute} default_size: 128 }}\n')
    proc, target = start(args.server, text, tmp)
    out = []
    try:
        for i, (attrs, seed) in enumerate(captions.eval_prompts(args.prompts)):
            png = os.path.join(tmp, f"{mode}_{i}.png")
            subprocess.run([args.stowctl, f"--target={target}", "generate", f"--prompt={captions.caption(attrs)}",
                            f"--steps={args.steps}", "--guidance=0", f"--seed={seed}", f"--out={png}", "--json"],
                           check=True, capture_output=True, timeout=120)
            out.append((attrs, np.asarray(Image.open(png).convert("RGB"))))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return out


def psnr(a, b):
    import numpy as np

    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True)
    parser.add_argument("--stowctl", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--machine", default="unknown")
    parser.add_argument("--commit", default="unknown")
    parser.add_argument("--modes", default="float32,bf16,fp8")
    parser.add_argument("--model_dir", default=os.path.join(ROOT, "models", "demo", "shapes"))
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if "bf16" not in modes:
        modes.insert(0, "bf16")  # PSNR is against bf16.
    results = {}
    for mode in sorted(modes, key=lambda m: m != "bf16"):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                results[mode] = images_for(mode, args, tmp)
            except (RuntimeError, subprocess.SubprocessError) as e:
                print(f"{mode}: {e}", flush=True)
    for mode in modes:
        if mode not in results:
            continue
        scores = [captions.check_image(pixels, attrs) for attrs, pixels in results[mode]]
        row = {"bench": "fidelity", "pipeline": "shapes", "mode": mode, "prompts": len(scores), "steps": args.steps,
               "accuracy": sum(s["fg"] and s["bg"] and s["position"] for s in scores) / len(scores),
               "fg": sum(s["fg"] for s in scores) / len(scores), "bg": sum(s["bg"] for s in scores) / len(scores),
               "position": sum(s["position"] for s in scores) / len(scores), "machine": args.machine,
               "commit": args.commit}
        if "bf16" in results and mode != "bf16":
            values = [psnr(a[1], b[1]) for a, b in zip(results[mode], results["bf16"])]
            finite = [v for v in values if math.isfinite(v)]
            row["psnr_db"] = round(sum(finite) / len(finite), 2) if finite else None
            row["psnr_min_db"] = round(min(finite), 2) if finite else None
            row["identical_images"] = len(values) - len(finite)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
