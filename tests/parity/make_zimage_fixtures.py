"""Writes small parity fixtures for the C++ Z-Image components from diffusers' own classes.

Run on the GPU host (or any machine with torch, transformers and diffusers' source), from the
repository root, with diffusers' `src/` in a git-ignored folder:

    PYTHONPATH=.ref/diffusers/src python3 tests/parity/make_zimage_fixtures.py tests/fixtures/zimage_tiny

For each component it saves the randomly initialised model with `save_pretrained` (config.json +
safetensors, exactly the published layout), the inputs it was called with, and the reference outputs
in float32 and bfloat16, as safetensors. The C++ tests load the same files and compare (relative
error <= 1e-5 in float32, <= 1e-2 in bfloat16). Sizes are tiny so the fixtures can be committed.
"""

import os
import sys

import torch
from safetensors.torch import save_file


def transformer_fixture(out):
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(0)
    config = dict(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64, n_layers=2,
                  n_refiner_layers=1, n_heads=2, n_kv_heads=2, norm_eps=1e-5, qk_norm=True,
                  cap_feat_dim=48, rope_theta=256.0, t_scale=1000.0, axes_dims=[8, 12, 12],
                  axes_lens=[128, 64, 64])
    model = ZImageTransformer2DModel(**config).eval()
    # Default initialisation leaves some weights at zero (pad tokens, modulation): randomise all.
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if p.dim() == 1 and p.numel() in (32, 48, 64) else 0.0))
    model.save_pretrained(os.path.join(out, "transformer"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(4, 1, 6, 10, generator=g)
    caption = torch.randn(7, 48, generator=g)
    t = torch.tensor([0.25])
    outputs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        m = model.to(dtype)
        with torch.no_grad():
            y = m([latents.to(dtype)], t, [caption.to(dtype)], return_dict=False)[0][0]
        outputs[f"output_{name}"] = y.float().contiguous()
    save_file({"latents": latents, "caption": caption, "t": t, **outputs},
              os.path.join(out, "transformer_io.safetensors"))


def vae_fixture(out):
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                        down_block_types=("DownEncoderBlock2D",) * 2,
                        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16),
                        layers_per_block=1, norm_num_groups=4, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
                        mid_block_add_attention=True).eval()
    vae.save_pretrained(os.path.join(out, "vae"), safe_serialization=True)
    g = torch.Generator().manual_seed(2)
    z = torch.randn(1, 4, 5, 6, generator=g)
    with torch.no_grad():
        y = vae.decode(z / 0.3611 + 0.1159).sample
    save_file({"latents": z, "output_float32": y.contiguous()}, os.path.join(out, "vae_io.safetensors"))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/zimage_tiny"
    os.makedirs(out, exist_ok=True)
    transformer_fixture(out)
    vae_fixture(out)
    print("fixtures written to", out)


if __name__ == "__main__":
    main()
