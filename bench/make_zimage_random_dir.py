"""Writes a Z-Image model directory without weights, for the server's random-weights mode:
model_index.json, the components' config.json files (Z-Image-Turbo's published shapes, or tiny ones),
the scheduler config and a byte-level tokenizer.json (special tokens included). The C++ loader builds
the architecture from it with `random_weights: true` and never reads safetensors.

    /usr/bin/python3 bench/make_zimage_random_dir.py OUT_DIR [--size full|tiny]

Standard library only, so it runs on the build machine and on the GPU host.
"""

import argparse
import json
import os

FULL = {
    "transformer": dict(_class_name="ZImageTransformer2DModel", all_patch_size=[2], all_f_patch_size=[1],
                        in_channels=16, dim=3840, n_layers=30, n_refiner_layers=2, n_heads=30, n_kv_heads=30,
                        norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0, t_scale=1000.0,
                        axes_dims=[32, 48, 48], axes_lens=[1536, 512, 512]),
    "vae": dict(_class_name="AutoencoderKL", in_channels=3, out_channels=3, latent_channels=16,
                block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
                mid_block_add_attention=True),
    "text_encoder": dict(architectures=["Qwen3Model"], vocab_size=151936, hidden_size=2560, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=9728,
                         rms_norm_eps=1e-6, rope_theta=1e6),
}
TINY = {
    "transformer": dict(FULL["transformer"], in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=2,
                        n_kv_heads=2, cap_feat_dim=64, axes_dims=[8, 12, 12], axes_lens=[1024, 128, 128]),
    "vae": dict(FULL["vae"], latent_channels=4, block_out_channels=[16, 32, 32, 32], layers_per_block=1,
                norm_num_groups=8),
    "text_encoder": dict(FULL["text_encoder"], vocab_size=259, hidden_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128),
}
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")


def byte_symbols():
    """GPT-2's byte -> printable character table."""
    direct = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in direct:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def write(path, value):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    args = parser.parse_args()
    configs = FULL if args.size == "full" else TINY
    write(os.path.join(args.out, "model_index.json"), {
        "_class_name": "ZImagePipeline", "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "text_encoder": ["transformers", "Qwen3Model"], "tokenizer": ["transformers", "Qwen2Tokenizer"],
        "transformer": ["diffusers", "ZImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKL"]})
    for name, config in configs.items():
        write(os.path.join(args.out, name, "config.json"), config)
    write(os.path.join(args.out, "scheduler", "scheduler_config.json"),
          {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
           "use_dynamic_shifting": False})
    symbols = byte_symbols()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    write(os.path.join(args.out, "tokenizer", "tokenizer.json"), {
        "added_tokens": [{"id": 256 + i, "content": s, "special": True} for i, s in enumerate(specials)],
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN2_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "model": {"type": "BPE", "vocab": {symbols[b]: b for b in range(256)}, "merges": []}})
    print("wrote", args.out)


if __name__ == "__main__":
    main()
