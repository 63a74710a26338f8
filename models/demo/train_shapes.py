"""Trains the demo pipeline: Z-Image's architecture at a tiny size (diffusers' ZImageTransformer2DModel,
transformers' Qwen3Model, diffusers' AutoencoderKL, a byte-level tokenizer) taught to draw one coloured
shape on a coloured background from captions such as "a red circle at the top left on a blue background".

The training set is drawn on the fly: 8 colours, 3 shapes, 9 positions (captions.py says the grammar).
Stage 1 trains the VAE to reconstruct such images; stage 2 trains the text encoder and the transformer
together with the flow-matching objective ZImagePipeline samples with (x_s = (1 - s) x0 + s noise, the
transformer called at t = 1 - s predicts x0 - noise, which the pipeline negates into the velocity), with
10 % of captions dropped to "" so that guidance works, and keeps an exponential moving average of the
weights. Then it saves the pipeline with `save_pretrained` (float32, diffusers format), reloads it
with `ZImagePipeline.from_pretrained`, draws the evaluation prompts at several step counts and
guidance scales, and scores each image with captions.check_image (the same rule as the C++ test).

Run on the GPU host from the repository root, with diffusers' src/ in the git-ignored .ref folder:

    PYTHONPATH=.ref/diffusers/src python3 models/demo/train_shapes.py OUT_DIR \
        [--vae-seconds 75] [--dit-seconds 300]

Writes OUT_DIR/shapes (the pipeline; committed as models/demo/shapes), OUT_DIR/train_log.jsonl,
OUT_DIR/eval.json and OUT_DIR/samples.png.
"""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
import captions  # noqa: E402
from make_zimage_random_dir import QWEN2_PATTERN, byte_symbols  # noqa: E402

SIZE = 128


def log(out, record):
    record["time_s"] = round(time.time() - START, 1)
    print(json.dumps(record), flush=True)
    with open(os.path.join(out, "train_log.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def make_tokenizer():
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, decoders, Regex
    from transformers import PreTrainedTokenizerFast

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
    return tokenizer


def train_vae(out, device, seconds):
    from diffusers import AutoencoderKL

    torch.manual_seed(1)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=16,
                        scaling_factor=1.0, shift_factor=0.0, use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=True).to(device)
    opt = torch.optim.AdamW(vae.parameters(), lr=5e-4, weight_decay=0.0)
    gen = torch.Generator(device=device).manual_seed(2)
    step, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        images, _ = captions.render_batch(64, SIZE, gen, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            posterior = vae.encode(images).latent_dist
            z = posterior.sample(generator=gen)
            rec = vae.decode(z).sample
        rec = rec.float()
        mse = F.mse_loss(rec, images)
        loss = mse + 0.1 * F.l1_loss(rec, images) + 1e-7 * posterior.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 200 == 0:
            log(out, {"stage": "vae", "step": step, "mse": round(mse.item(), 5)})
    vae.eval()
    with torch.no_grad():
        zs = []
        for _ in range(16):
            images, _ = captions.render_batch(128, SIZE, gen, device)
            zs.append(vae.encode(images).latent_dist.mode().float())
        zs = torch.cat(zs)
        shift, scale = zs.mean().item(), 1.0 / zs.std().item()
        images, _ = captions.render_batch(256, SIZE, gen, device)
        rec = vae.decode(vae.encode(images).latent_dist.mode()).sample
        rec_mse = F.mse_loss(rec, images).item()
    vae.register_to_config(scaling_factor=scale, shift_factor=shift)
    log(out, {"stage": "vae_done", "steps": step, "eval_mse": round(rec_mse, 5), "scaling_factor": scale,
              "shift_factor": shift})
    return vae


def train_dit(out, device, seconds, vae, tokenizer):
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(3)
    text_encoder = Qwen3Model(Qwen3Config(vocab_size=259, hidden_size=128, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                          intermediate_size=384, rms_norm_eps=1e-6, rope_theta=1e6,
                                          max_position_embeddings=1024)).to(device)
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=128, n_layers=4, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True, cap_feat_dim=128, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[16, 24, 24], axes_lens=[1024, 128, 128]).to(device)
    params = list(text_encoder.parameters()) + list(transformer.parameters())
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)

    # Every caption's token ids once (the chat template around it, as the pipeline tokenizes).
    texts = [""] + captions.all_captions()
    templated = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True, enable_thinking=True) for t in texts]
    enc = tokenizer(templated, padding="longest", return_tensors="pt")
    all_ids, all_mask = enc.input_ids.to(device), enc.attention_mask.to(device).bool()
    index = {t: i for i, t in enumerate(texts)}

    gen = torch.Generator(device=device).manual_seed(4)
    shift = 3.0
    step, t0, losses = 0, time.time(), []
    batch = 128
    while time.time() - t0 < seconds:
        images, attrs = captions.render_batch(batch, SIZE, gen, device)
        with torch.no_grad():
            z = vae.encode(images).latent_dist.mode().float()
            z = (z - vae.config.shift_factor) * vae.config.scaling_factor
        drop = torch.rand(batch, generator=gen, device=device) < 0.1
        rows = torch.tensor([0 if drop[i] else index[captions.caption(a)] for i, a in enumerate(attrs)], device=device)
        ids, mask = all_ids[rows], all_mask[rows]
        width = int(mask.sum(1).max())
        ids, mask = ids[:, :width], mask[:, :width]
        u = torch.rand(batch, generator=gen, device=device)
        shifted = shift * u / (1 + (shift - 1) * u)
        sigma = torch.where(torch.rand(batch, generator=gen, device=device) < 0.5, u, shifted)
        noise = torch.randn(z.shape, generator=gen, device=device)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * z + s * noise
        with torch.autocast("cuda", dtype=torch.bfloat16):
            hidden = text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
            caps = [hidden[i][mask[i]] for i in range(batch)]
            outs = transformer([xt[i].unsqueeze(1) for i in range(batch)], 1 - sigma, caps, return_dict=False)[0]
        pred = torch.stack([o.float() for o in outs]).squeeze(2)
        loss = F.mse_loss(pred, z - noise)
        warm = min(1.0, (step + 1) / 200)
        for g in opt.param_groups:
            g["lr"] = 3e-4 * warm
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            torch._foreach_mul_(ema, decay)
            torch._foreach_add_(ema, [p.detach() for p in params], alpha=1 - decay)
        losses.append(loss.item())
        step += 1
        if step % 250 == 0:
            log(out, {"stage": "dit", "step": step, "loss": round(sum(losses) / len(losses), 5),
                      "step_s": round((time.time() - t0) / step, 4)})
            losses = []
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    log(out, {"stage": "dit_done", "steps": step, "samples": step * batch})
    return text_encoder.eval(), transformer.eval()


def evaluate(out, directory, device):
    import numpy as np
    from diffusers import ZImagePipeline
    from PIL import Image

    pipe = ZImagePipeline.from_pretrained(directory, torch_dtype=torch.float32).to(device)
    pipe.set_progress_bar_config(disable=True)
    prompts = captions.eval_prompts()
    results, grid_rows = [], []
    for steps in (8, 16):
        for guidance in (0.0, 1.0, 2.0):
            score = {"fg": 0, "bg": 0, "position": 0, "all": 0}
            row = []
            for k, (attrs, seed) in enumerate(prompts):
                image = pipe(prompt=captions.caption(attrs), height=SIZE, width=SIZE, num_inference_steps=steps,
                             guidance_scale=guidance, generator=torch.Generator("cpu").manual_seed(seed),
                             output_type="np").images[0]
                pixels = (image * 255).round().astype(np.uint8)
                verdict = captions.check_image(pixels, attrs)
                for key in ("fg", "bg", "position"):
                    score[key] += verdict[key]
                score["all"] += verdict["fg"] and verdict["bg"] and verdict["position"]
                if k < 12:
                    row.append(pixels)
            n = len(prompts)
            record = {"steps": steps, "guidance": guidance, "prompts": n,
                      **{k: round(v / n, 3) for k, v in score.items()}}
            results.append(record)
            log(out, {"stage": "eval", **record})
            grid_rows.append(np.concatenate(row, axis=1))
    Image.fromarray(np.concatenate(grid_rows, axis=0)).save(os.path.join(out, "samples.png"))
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump(results, f, indent=1)


def main():
    global START
    START = time.time()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--vae-seconds", type=float, default=75)
    parser.add_argument("--dit-seconds", type=float, default=300)
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    tokenizer = make_tokenizer()
    vae = train_vae(args.out, device, args.vae_seconds)
    text_encoder, transformer = train_dit(args.out, device, args.dit_seconds, vae, tokenizer)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae.float(), text_encoder=text_encoder.float(),
                          tokenizer=tokenizer, transformer=transformer.float())
    directory = os.path.join(args.out, "shapes")
    pipe.save_pretrained(directory, safe_serialization=True)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(directory) for f in fs)
    log(out=args.out, record={"stage": "saved", "bytes": total})
    del pipe
    evaluate(args.out, directory, device)


if __name__ == "__main__":
    main()
