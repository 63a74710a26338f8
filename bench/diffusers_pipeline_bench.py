"""The whole Z-Image pipeline in diffusers, for the end-to-end comparison (bench/e2e_bench.sh).

    python3 bench/diffusers_pipeline_bench.py export DIR
        Builds ZImagePipeline at Z-Image-Turbo's published shapes (bench/make_zimage_random_dir.py's
        FULL configs) with random bf16 weights and a byte-level tokenizer, and saves it with
        save_pretrained: the same files then feed diffusers and the Stowage server.
    python3 bench/diffusers_pipeline_bench.py run DIR --out ROWS.jsonl --machine M [--size 1024] [--steps 8]
            [--iters 5] [--compile]
        Loads DIR with ZImagePipeline.from_pretrained onto the GPU, times the first call after the
        load (first_s) and the median of --iters warm calls (warm_s); output_type "pil" (no PNG
        encoding). --compile adds torch.compile(pipe.transformer) (system "diffusers_compile"; its first
        call compiles). One row: {"bench":"e2e","system":"diffusers"|"diffusers_compile","steps":..,
        "size":..,"warm_s":..,"first_s":..,"machine":..}.

Needs torch, transformers, tokenizers and diffusers' source on PYTHONPATH (the GPU host has the first
three; carry diffusers' src).
"""

import argparse
import json
import os
import statistics
import sys
import time

PROMPT = "a lighthouse on a cliff at dusk, oil painting"


def randomize(modules):
    """bf16, eval mode, and real data in every tensor (default init leaves some at zero)."""
    import torch

    with torch.no_grad():
        for module in modules:
            module.to(torch.bfloat16).eval()
            for name, p in module.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, p.shape[-1] ** -0.5)
                else:
                    p.normal_(1.0 if "norm" in name else 0.0, 0.02)


def zimage_pipeline():
    """ZImagePipeline at Z-Image-Turbo's published shapes, random bf16 weights on the GPU, a byte-level
    tokenizer (also used by bench/diffusers_two_pipelines.py)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, decoders, Regex
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3Model

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from make_zimage_random_dir import FULL, QWEN2_PATTERN, byte_symbols

    torch.manual_seed(0)
    strip = lambda c: {k: v for k, v in c.items() if not k.startswith("_") and k != "architectures"}
    with torch.device("cuda"):  # Initialising 10 B parameters on the CPU takes minutes.
        transformer = ZImageTransformer2DModel(**strip(FULL["transformer"]))
        v = strip(FULL["vae"])
        vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            **v)
        text_encoder = Qwen3Model(Qwen3Config(**strip(FULL["text_encoder"]), max_position_embeddings=4096))
    randomize((transformer, vae, text_encoder))
    symbols = byte_symbols()
    tok = Tokenizer(models.BPE(vocab={symbols[b]: b for b in range(256)}, merges=[]))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    return pipe


def export(directory):
    start = time.time()
    pipe = zimage_pipeline()
    pipe.save_pretrained(directory, safe_serialization=True, max_shard_size="5GB")
    print(f"exported the pipeline to {directory} in {time.time() - start:.0f} s", flush=True)


def run(directory, out, machine, size, steps, iters, compile_transformer=False):
    import torch
    from diffusers import ZImagePipeline

    start = time.time()
    pipe = ZImagePipeline.from_pretrained(directory, torch_dtype=torch.bfloat16).to("cuda")
    if compile_transformer:  # The one line a user adds; the first call pays for the compilation.
        pipe.transformer = torch.compile(pipe.transformer)
    load_s = time.time() - start

    def call(seed):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        image = pipe(prompt=PROMPT, height=size, width=size, num_inference_steps=steps, guidance_scale=0.0,
                     generator=torch.Generator("cuda").manual_seed(seed), output_type="pil").images[0]
        torch.cuda.synchronize()
        assert image.size == (size, size)
        return time.perf_counter() - t0

    first = call(0)
    warm = [call(i + 1) for i in range(iters)]
    row = {"bench": "e2e", "system": "diffusers_compile" if compile_transformer else "diffusers", "model": "zimage",
           "mode": "bf16", "steps": steps, "size": size, "warm_s": statistics.median(warm),
           "first_s": first, "warm_runs_s": warm, "load_s": load_s,
           "peak_device_bytes": torch.cuda.max_memory_reserved(), "machine": machine}
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["export", "run"])
    parser.add_argument("dir")
    parser.add_argument("--out", default="e2e.jsonl")
    parser.add_argument("--machine", default="unknown")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--compile", action="store_true", help="torch.compile(pipe.transformer) after loading")
    args = parser.parse_args()
    if args.command == "export":
        export(args.dir)
    else:
        run(args.dir, args.out, args.machine, args.size, args.steps, args.iters, args.compile)


if __name__ == "__main__":
    main()
