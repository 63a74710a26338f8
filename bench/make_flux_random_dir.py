"""Writes a Flux.1 model directory without weights, for the server's random-weights mode:
model_index.json, the components' config.json files (Flux.1 [dev]'s published shapes: the 11.9 B
transformer, CLIP-L, T5-XXL v1.1 and the 16-channel VAE; or tiny ones), the scheduler config, and
the two tokenizer folders copied from a directory that has them (by default the committed parity
fixture, tests/fixtures/flux_tiny/pipeline: a small CLIP BPE and a small T5 SentencePiece model whose
ids all lie below the published vocabularies, so they drive the full-size encoders). The C++ loader
builds the architecture from it with `random_weights: true` and never reads safetensors.

    /usr/bin/python3 bench/make_flux_random_dir.py OUT_DIR [--size full|tiny] [--variant dev|schnell]
        [--tokenizers DIR]

Standard library only, so it runs on the build machine and on the GPU host.
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_zimage_random_dir import write  # noqa: E402  One JSON writer for both folders.

FULL = {
    "transformer": dict(_class_name="FluxTransformer2DModel", patch_size=1, in_channels=64, num_layers=19,
                        num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
                        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                        axes_dims_rope=[16, 56, 56]),
    "text_encoder": dict(architectures=["CLIPTextModel"], model_type="clip_text_model", vocab_size=49408,
                         hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
                         max_position_embeddings=77, hidden_act="quick_gelu", layer_norm_eps=1e-5,
                         bos_token_id=0, pad_token_id=1, eos_token_id=2, projection_dim=768),
    "text_encoder_2": dict(architectures=["T5EncoderModel"], model_type="t5", vocab_size=32128, d_model=4096,
                           d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
                           relative_attention_max_distance=128, feed_forward_proj="gated-gelu",
                           layer_norm_epsilon=1e-6, is_encoder_decoder=False),
    "vae": dict(_class_name="AutoencoderKL", in_channels=3, out_channels=3, latent_channels=16,
                block_out_channels=[128, 256, 512, 512], layers_per_block=2, norm_num_groups=32,
                scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
                mid_block_add_attention=True,
                down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4),
}
TINY = {
    "transformer": dict(FULL["transformer"], in_channels=16, num_layers=1, num_single_layers=2,
                        attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                        pooled_projection_dim=24, axes_dims_rope=[4, 6, 6]),
    "text_encoder": dict(FULL["text_encoder"], vocab_size=4096, hidden_size=24, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=2, projection_dim=24),
    "text_encoder_2": dict(FULL["text_encoder_2"], vocab_size=4096, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                           num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16),
    "vae": dict(FULL["vae"], latent_channels=4, block_out_channels=[8, 16, 16, 16], layers_per_block=1,
                norm_num_groups=4),
}
MODEL_INDEX = {
    "_class_name": "FluxPipeline",
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "tokenizer": ["transformers", "CLIPTokenizer"],
    "tokenizer_2": ["transformers", "T5Tokenizer"],
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
# FluxPipeline's published scheduler: dynamic shifting by image tokens.
SCHEDULER = {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0,
             "use_dynamic_shifting": True, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
             "max_image_seq_len": 4096, "time_shift_type": "exponential"}
DEFAULT_TOKENIZERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures",
                                  "flux_tiny", "pipeline")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--size", choices=["full", "tiny"], default="full")
    parser.add_argument("--variant", choices=["dev", "schnell"], default="dev",
                        help="dev: guidance embedding (guidance_embeds true); schnell: none")
    parser.add_argument("--tokenizers", default=DEFAULT_TOKENIZERS,
                        help="a Flux directory whose tokenizer/ and tokenizer_2/ folders are copied")
    args = parser.parse_args()
    for folder in ("tokenizer", "tokenizer_2"):
        if not os.path.isdir(os.path.join(args.tokenizers, folder)):
            raise SystemExit(f"{args.tokenizers} has no {folder}/ folder (give --tokenizers DIR)")
    configs = FULL if args.size == "full" else TINY
    write(os.path.join(args.out, "model_index.json"), MODEL_INDEX)
    for name, config in configs.items():
        config = dict(config)
        if name == "transformer":
            config["guidance_embeds"] = args.variant == "dev"
        write(os.path.join(args.out, name, "config.json"), config)
    write(os.path.join(args.out, "scheduler", "scheduler_config.json"), SCHEDULER)
    for folder in ("tokenizer", "tokenizer_2"):
        target = os.path.join(args.out, folder)
        shutil.rmtree(target, ignore_errors=True)
        shutil.copytree(os.path.join(args.tokenizers, folder), target)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
