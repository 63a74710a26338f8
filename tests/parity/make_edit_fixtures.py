"""Writes the image-to-image and inpainting parity fixtures: diffusers' own ZImageImg2ImgPipeline,
ZImageInpaintPipeline, FluxImg2ImgPipeline and FluxInpaintPipeline run on the committed tiny pipelines
(tests/fixtures/zimage_tiny/pipeline, tests/fixtures/flux_tiny/pipeline) with a fixed input image and
mask, and the VAE encoder's output on that image.

Run on the GPU host (torch, transformers, diffusers' `src/`), from the repository root:

    PYTHONPATH=.ref/diffusers_slim/src python3 tests/parity/make_edit_fixtures.py tests/fixtures OUT

For each family (zimage_tiny, flux_tiny) it writes into OUT/<family>/:
  edit_image.png   the input image (8-bit RGB, the pipeline fixture's size), drawn from a seeded
                   numpy generator (smooth gradients plus noise), saved by PIL
  edit_mask.png    the mask (8-bit grayscale; white = repaint, black = keep), a rectangle
  edit_io.safetensors
    encoder_mean, encoder_logvar   vae.encode(image).latent_dist's mean and logvar (float32, the
                                   image as diffusers' VaeImageProcessor prepares it)
    <case>                         the pipeline's image ([3, H, W] in [0, 1], output_type="pt")
  edit_cases.json  each case's parameters (kind, strength, steps, guidance, prompt, negative prompt)
Every call runs on the CPU in float32 with generator torch.Generator().manual_seed(11), which the
C++ pipelines' seed reproduces (the encoder's sample is drawn first, then the noise). The C++ check
(zimage_parity_check / flux_parity_check, "edit" lines) decodes the same PNG files and compares.
"""

import json
import os
import sys

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

ZIMAGE_CASES = [
    dict(name="img2img_s06", kind="img2img", strength=0.6, steps=4, guidance=0.0, prompt="a red lantern",
         negative_prompt=""),
    dict(name="img2img_s03_g1_5", kind="img2img", strength=0.3, steps=4, guidance=1.5, prompt="a red lantern",
         negative_prompt="blur"),
    dict(name="inpaint_s1", kind="inpaint", strength=1.0, steps=3, guidance=0.0, prompt="a red lantern",
         negative_prompt=""),
    dict(name="inpaint_s075", kind="inpaint", strength=0.75, steps=4, guidance=0.0, prompt="a red lantern",
         negative_prompt=""),
]
FLUX_CASES = [
    dict(name="img2img_s06", kind="img2img", strength=0.6, steps=4, guidance=3.5, prompt="a red lantern",
         negative_prompt=""),
    dict(name="inpaint_s1", kind="inpaint", strength=1.0, steps=3, guidance=3.5, prompt="a red lantern",
         negative_prompt=""),
    dict(name="inpaint_s075", kind="inpaint", strength=0.75, steps=4, guidance=3.5, prompt="a red lantern",
         negative_prompt=""),
]


def input_image(width, height, seed):
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float64)
    base = np.stack([x / width, y / height, 0.5 + 0.5 * np.sin((x + y) / 7.0)], axis=-1) * 200.0 + 20.0
    pixels = np.clip(base + rng.normal(0.0, 12.0, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels, mode="RGB")


def input_mask(width, height):
    m = np.zeros((height, width), dtype=np.uint8)
    m[height // 4: 3 * height // 4, width // 3: width - width // 4] = 255
    return Image.fromarray(m, mode="L")


def run_family(src_root, out_root, family, width, height, cases, make_pipes, call_kwargs):
    out = os.path.join(out_root, family)
    os.makedirs(out, exist_ok=True)
    image = input_image(width, height, seed=5)
    mask = input_mask(width, height)
    image.save(os.path.join(out, "edit_image.png"))
    mask.save(os.path.join(out, "edit_mask.png"))
    # Read back what was written: the C++ side decodes these files.
    image = Image.open(os.path.join(out, "edit_image.png")).convert("RGB")
    mask = Image.open(os.path.join(out, "edit_mask.png"))
    img2img, inpaint = make_pipes(os.path.join(src_root, family, "pipeline"))
    tensors = {}
    with torch.no_grad():
        x = img2img.image_processor.preprocess(image).to(torch.float32)
        dist = img2img.vae.encode(x).latent_dist
        tensors["encoder_mean"] = dist.mean.contiguous()
        tensors["encoder_logvar"] = dist.logvar.contiguous()
    for case in cases:
        pipe = img2img if case["kind"] == "img2img" else inpaint
        kwargs = dict(prompt=case["prompt"], image=image, strength=case["strength"], height=height, width=width,
                      num_inference_steps=case["steps"], generator=torch.Generator().manual_seed(11),
                      output_type="pt", **call_kwargs(case))
        if case["kind"] == "inpaint":
            kwargs["mask_image"] = mask
        result = pipe(**kwargs).images[0]
        tensors[case["name"]] = result.float().contiguous()
        print(family, case["name"], "mean", float(result.mean()))
    save_file(tensors, os.path.join(out, "edit_io.safetensors"))
    with open(os.path.join(out, "edit_cases.json"), "w", encoding="utf-8") as f:
        json.dump({"width": width, "height": height, "seed": 11, "cases": cases}, f, indent=1)


def main():
    src_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures"
    out_root = sys.argv[2] if len(sys.argv) > 2 else src_root
    from diffusers import (FluxImg2ImgPipeline, FluxInpaintPipeline, ZImageImg2ImgPipeline, ZImageInpaintPipeline,
                           ZImagePipeline, FluxPipeline)

    def zimage_pipes(root):
        base = ZImagePipeline.from_pretrained(root, torch_dtype=torch.float32)
        return ZImageImg2ImgPipeline(**base.components), ZImageInpaintPipeline(**base.components)

    def flux_pipes(root):
        base = FluxPipeline.from_pretrained(root, torch_dtype=torch.float32)
        return FluxImg2ImgPipeline(**base.components), FluxInpaintPipeline(**base.components)

    run_family(src_root, out_root, "zimage_tiny", 64, 64, ZIMAGE_CASES, zimage_pipes,
               lambda c: dict(guidance_scale=c["guidance"], negative_prompt=c["negative_prompt"] or None))
    run_family(src_root, out_root, "flux_tiny", 48, 64, FLUX_CASES, flux_pipes,
               lambda c: dict(guidance_scale=c["guidance"], max_sequence_length=32))
    import diffusers
    import transformers
    versions = {m.__name__: m.__version__ for m in (torch, diffusers, transformers)}
    with open(os.path.join(out_root, "edit_versions.json"), "w", encoding="utf-8") as f:
        json.dump(versions, f, indent=1)
    print("edit fixtures written to", out_root, "with", versions)


if __name__ == "__main__":
    main()
