"""Writes small parity fixtures for the C++ Z-Image components from diffusers' own classes.

Run on the GPU host (or any machine with torch, transformers and diffusers' source), from the
repository root, with diffusers' `src/` in a git-ignored folder:

    PYTHONPATH=.ref/diffusers/src python3 tests/parity/make_zimage_fixtures.py tests/fixtures/zimage_tiny

For each component it saves the randomly initialised model with `save_pretrained` (config.json +
safetensors, exactly the published layout), the inputs it was called with, and the reference outputs
in float32 and bfloat16, as safetensors; a tokenizer trained by the tokenizers library with Qwen2's
normalizer and pre-tokenizer, with its ids on test strings; and a whole tiny ZImagePipeline saved with
save_pretrained plus its images for fixed initial latents (seed 11, CPU generator, which the C++
pipeline's seed reproduces). The C++ tests are to load the same files and compare (relative error
<= 1e-5 in float32, <= 1e-2 in bfloat16; identical ids). Sizes are tiny so the fixtures can be
committed. Output committed in tests/fixtures/zimage_tiny (see tests/fixtures/README.md).
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
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
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


QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                 r"\s*[\r\n]+|\s+(?!\S)|\s+")
TOKENIZER_STRINGS = [
    "a photo of a cat", "Hello, World!  Two  spaces", "\u4e2d\u6587\u5b57\u7b26 \u65e5\u672c\u8a9e",
    "emoji \U0001F44D\U0001F3FD and \u2764\ufe0f", "tabs\tand\nnew\n\nlines   ", "e\u0301 (decomposed)",
    "<|im_start|>user\nthe prompt<|im_end|>\n<|im_start|>assistant\n",
]


def tokenizer_fixture(out):
    """A small byte-level BPE with Qwen2's normalizer and pre-tokenizer, trained by the tokenizers
    library, and the ids it gives on strings covering ASCII, CJK, emoji, whitespace runs, NFC and the
    chat template."""
    import json
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["the quick brown fox jumps over the lazy dog " * 20, "a photo of a cat on a mat " * 20,
              "\u4e2d\u6587 \u65e5\u672c\u8a9e " * 10] + TOKENIZER_STRINGS
    tok.train_from_iterator(corpus, trainer)
    os.makedirs(os.path.join(out, "pipeline", "tokenizer"), exist_ok=True)
    tok.save(os.path.join(out, "pipeline", "tokenizer", "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_ids_struct.json"), "w") as f:
        json.dump({"cases": [{"text": s, "ids": tok.encode(s).ids} for s in TOKENIZER_STRINGS]}, f,
                  ensure_ascii=False, indent=1)
    return tok


def text_encoder_fixture(out, vocab_size):
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(3)
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=48, num_hidden_layers=3, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=12, intermediate_size=96, rms_norm_eps=1e-6,
                         rope_theta=1e6, max_position_embeddings=512)
    model = Qwen3Model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05 + (1.0 if "norm" in name else 0.0))
    model.save_pretrained(os.path.join(out, "pipeline", "text_encoder"), safe_serialization=True)
    ids = torch.tensor([[5, 17, 42, 9, 100, 3, 77]])
    with torch.no_grad():
        hs = model(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]
    save_file({"ids": ids[0], "hidden_states_minus_2": hs.contiguous()}, os.path.join(out, "text_encoder_io.safetensors"))
    return model


def pipeline_fixture(out, tok):
    """The whole tiny pipeline through diffusers' ZImagePipeline, saved with save_pretrained so the C++
    loader reads the same directory, and its images for fixed seeds."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel
    from transformers import PreTrainedTokenizerFast

    root = os.path.join(out, "pipeline")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    text_encoder = text_encoder_fixture(out, len(tok.get_vocab()))
    torch.manual_seed(4)
    transformer = ZImageTransformer2DModel(all_patch_size=(2,), all_f_patch_size=(1,), in_channels=4, dim=64,
                                           n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                           cap_feat_dim=48, axes_dims=[8, 12, 12], axes_lens=[512, 64, 64]).eval()
    vae = AutoencoderKL(latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                        layers_per_block=1, norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False).eval()
    with torch.no_grad():
        for module in (transformer, vae):
            for name, p in module.named_parameters():
                # Norm scales near 1, everything else small and random (defaults leave some at zero).
                p.copy_(torch.randn_like(p) * 0.05 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
    pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                          transformer=transformer)
    pipe.save_pretrained(root, safe_serialization=True)
    images = {}
    for name, guidance in (("g0", 0.0), ("g1_5", 1.5)):
        latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(11))
        image = pipe(prompt="a red lantern", negative_prompt="blur", height=64, width=64, num_inference_steps=2,
                     guidance_scale=guidance, latents=latents, output_type="pt").images[0]
        images[f"image_{name}"] = image.float().contiguous()
    save_file(images, os.path.join(out, "pipeline_io.safetensors"))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/zimage_tiny"
    os.makedirs(out, exist_ok=True)
    transformer_fixture(out)
    vae_fixture(out)
    tok = tokenizer_fixture(out)
    pipeline_fixture(out, tok)
    import json
    import diffusers
    import tokenizers
    import transformers
    versions = {m.__name__: m.__version__ for m in (torch, diffusers, transformers, tokenizers)}
    with open(os.path.join(out, "versions.json"), "w", encoding="utf-8") as f:
        json.dump(versions, f, indent=1)
    print("fixtures written to", out, "with", versions)


if __name__ == "__main__":
    main()
