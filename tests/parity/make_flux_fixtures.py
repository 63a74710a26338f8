"""Writes small parity fixtures for the C++ Flux.1 components from diffusers' and transformers' own
classes (FluxTransformer2DModel [dev] and [schnell], CLIPTextModel, T5EncoderModel, and a whole tiny
FluxPipeline with its tokenizers).

Run on the GPU host (or any machine with torch, transformers, tokenizers, sentencepiece and diffusers'
source), from the repository root, with diffusers' `src/` in a git-ignored folder:

    PYTHONPATH=.ref/diffusers/src python3 tests/parity/make_flux_fixtures.py tests/fixtures/flux_tiny

For each component it saves the randomly initialised model with `save_pretrained` (config.json +
safetensors, the published layout), the inputs it was called with and the reference outputs in
float32 and bfloat16 as safetensors. The pipeline part builds a CLIP tokenizer folder (vocab.json and
merges.txt of a small byte-level BPE trained in CLIP's configuration) and a T5 tokenizer folder (a
small SentencePiece Unigram model), saves the whole FluxPipeline with save_pretrained, writes the
token ids both tokenizers give for the pipeline's prompts, and its images for a fixed seed (CPU
generator, which the C++ pipeline's seed reproduces). The C++ side (tests/parity:flux_parity_test)
loads the same files and compares: relative error <= 1e-5 in float32, <= 1e-2 in bfloat16, identical
ids, images within one 8-bit level. Sizes are tiny so the fixtures can be committed.
"""

import json
import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))
from make_zimage_random_dir import byte_symbols  # noqa: E402  GPT-2's byte -> printable character table.

PROMPTS = ["a red lantern", "A Photo of TWO cats,  sitting on a mat!"]


def randomize(module, scale=0.05):
    """Default initialisation leaves some weights at zero (modulations, outputs): give all real data."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            is_norm_scale = ("norm" in name or "layer_norm" in name) and name.endswith("weight")
            p.copy_(torch.randn_like(p) * scale + (1.0 if is_norm_scale else 0.0))


def transformer_config(guidance_embeds):
    return dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
                num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=24,
                guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6))


def transformer_fixture(out, variant, guidance_embeds):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    model = FluxTransformer2DModel(**transformer_config(guidance_embeds)).eval()
    randomize(model)
    model.save_pretrained(os.path.join(out, f"transformer_{variant}"), safe_serialization=True)
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(1, 12, 16, generator=g)
    text = torch.randn(1, 7, 32, generator=g)
    pooled = torch.randn(1, 24, generator=g)
    timestep = torch.tensor([0.625])
    guidance = torch.tensor([3.5])
    img_ids = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(3.0), torch.arange(4.0), indexing="ij"), -1)
    img_ids = img_ids.reshape(-1, 3)
    txt_ids = torch.zeros(7, 3)
    outputs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        m = model.to(dtype)
        with torch.no_grad():
            y = m(hidden_states=hidden.to(dtype), encoder_hidden_states=text.to(dtype),
                  pooled_projections=pooled.to(dtype), timestep=timestep.to(dtype), img_ids=img_ids,
                  txt_ids=txt_ids, guidance=guidance if guidance_embeds else None, return_dict=False)[0]
        outputs[f"output_{name}"] = y.float().contiguous()
    save_file({"hidden": hidden, "text": text, "pooled": pooled, "timestep": timestep, "guidance": guidance,
               "img_ids": img_ids.contiguous(), "txt_ids": txt_ids, **outputs},
              os.path.join(out, f"transformer_{variant}_io.safetensors"))


def clip_model(vocab_size):
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(2)
    # eos_token_id 2: the legacy value of the published CLIP configs (pooled at the largest id).
    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                            num_attention_heads=2, max_position_embeddings=77, hidden_act="quick_gelu",
                            eos_token_id=2, bos_token_id=0, pad_token_id=1)
    model = CLIPTextModel(config).eval()
    randomize(model, 0.1)
    return model


def t5_model(vocab_size):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(3)
    config = T5Config(vocab_size=vocab_size, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      feed_forward_proj="gated-gelu", is_encoder_decoder=False, use_cache=False)
    model = T5EncoderModel(config).eval()
    randomize(model, 0.1)
    return model


def encoder_fixtures(out):
    clip = clip_model(100)
    clip.save_pretrained(os.path.join(out, "clip"), safe_serialization=True)
    ids = torch.tensor([[98] + list(range(3, 20)) + [99] + [99] * 58])  # bos, tokens, eos (the largest id), pad.
    with torch.no_grad():
        o = clip(input_ids=ids)
    save_file({"ids": ids[0], "last_hidden_state": o.last_hidden_state[0].contiguous(),
               "pooled": o.pooler_output[0].contiguous()}, os.path.join(out, "clip_io.safetensors"))
    t5 = t5_model(120)
    t5.save_pretrained(os.path.join(out, "t5"), safe_serialization=True)
    ids = torch.tensor([[5, 17, 42, 9, 100, 3, 77, 1] + [0] * 12])
    outputs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        with torch.no_grad():
            outputs[f"output_{name}"] = t5.to(dtype)(input_ids=ids).last_hidden_state[0].float().contiguous()
    save_file({"ids": ids[0], **outputs}, os.path.join(out, "t5_io.safetensors"))


def clip_tokenizer_dir(directory):
    """CLIP's layout: vocab.json (bytes, bytes + "</w>", a few merges' results, then the two special
    tokens last, as in openai/clip-vit-large-patch14) and merges.txt with its version header."""
    from transformers import CLIPTokenizer

    os.makedirs(directory, exist_ok=True)
    symbols = [byte_symbols()[b] for b in range(256)]
    vocab = symbols + [s + "</w>" for s in symbols]
    merges = [("r", "e"), ("e", "d</w>"), ("a", "t"), ("at", "s</w>"), ("t", "h"), ("th", "e</w>"), ("l", "a"),
              ("la", "n"), ("o", "n</w>"), ("c", "at"), ("cat", "s</w>")]
    for a, b in merges:
        vocab.append(a + b)
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    # model_max_length 77 as the published tokenizer_config.json says (FluxPipeline pads to it).
    tok = CLIPTokenizer(os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt"),
                        model_max_length=77)
    tok.save_pretrained(directory)
    return tok, len(vocab)


def t5_tokenizer_dir(directory, work):
    import sentencepiece as spm
    try:
        from transformers import T5TokenizerFast
    except ImportError:  # transformers 5 may name only one class.
        from transformers import T5Tokenizer as T5TokenizerFast

    os.makedirs(directory, exist_ok=True)
    corpus = os.path.join(work, "t5_corpus.txt")
    with open(corpus, "w", encoding="utf-8") as f:
        for _ in range(30):
            f.write("a red lantern on a photo of two cats sitting on a mat\nthe quick brown fox jumps over the "
                    "lazy dog\nA Photo of TWO cats, sitting on a mat!\n")
    prefix = os.path.join(work, "spiece")
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, vocab_size=48, model_type="unigram", hard_vocab_limit=False,
                                   pad_id=0, eos_id=1, unk_id=2, bos_id=-1, character_coverage=1.0)
    # transformers 5.17's T5TokenizerFast(vocab_file=...) ignores the file (a 4-piece vocabulary):
    # load the folder holding spiece.model instead, which converts it, and check the result against
    # SentencePiece's own ids before anything is written from it.
    import shutil
    shutil.copy(prefix + ".model", os.path.join(directory, "spiece.model"))
    tok = T5TokenizerFast.from_pretrained(directory, extra_ids=0)
    sp = spm.SentencePieceProcessor(model_file=prefix + ".model")
    for prompt in PROMPTS:
        want = sp.encode(prompt) + [1]
        if tok(prompt).input_ids != want:
            raise SystemExit(f"T5 tokenizer from {directory} disagrees with SentencePiece on {prompt!r}: "
                             f"{tok(prompt).input_ids} vs {want}")
    tok.save_pretrained(directory)  # tokenizer.json beside spiece.model, as the published folders have.
    return tok


def pipeline_fixture(out, work):
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    root = os.path.join(out, "pipeline")
    clip_tok, clip_vocab = clip_tokenizer_dir(os.path.join(root, "tokenizer"))
    t5_tok = t5_tokenizer_dir(os.path.join(root, "tokenizer_2"), work)
    ids = {"clip": {p: clip_tok(p, padding="max_length", max_length=77, truncation=True).input_ids for p in PROMPTS},
           "t5": {p: t5_tok(p, padding="max_length", max_length=32, truncation=True).input_ids for p in PROMPTS}}
    with open(os.path.join(out, "pipeline_token_ids.json"), "w", encoding="utf-8") as f:
        json.dump(ids, f, ensure_ascii=False, indent=1)
    clip = clip_model(clip_vocab)
    t5 = t5_model(len(t5_tok))
    torch.manual_seed(4)
    transformer = FluxTransformer2DModel(**dict(transformer_config(True), pooled_projection_dim=24)).eval()
    randomize(transformer)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * 4,
                        up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(8, 16, 16, 16),
                        layers_per_block=1, norm_num_groups=4, scaling_factor=0.3611, shift_factor=0.1159,
                        use_quant_conv=False, use_post_quant_conv=False).eval()
    randomize(vae)
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer)
    pipe.save_pretrained(root, safe_serialization=True)
    images = {}
    for k, prompt in enumerate(PROMPTS):
        image = pipe(prompt=prompt, height=64, width=48, num_inference_steps=3, guidance_scale=3.5,
                     max_sequence_length=32, generator=torch.Generator().manual_seed(11),
                     output_type="pt").images[0]
        images[f"image_{k}"] = image.float().contiguous()
    save_file(images, os.path.join(out, "pipeline_io.safetensors"))


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/flux_tiny"
    os.makedirs(out, exist_ok=True)
    work = os.path.join(out, ".work")
    os.makedirs(work, exist_ok=True)
    transformer_fixture(out, "dev", True)
    transformer_fixture(out, "schnell", False)
    encoder_fixtures(out)
    pipeline_fixture(out, work)
    import shutil
    shutil.rmtree(work)
    import diffusers
    import sentencepiece
    import tokenizers
    import transformers
    versions = {m.__name__: m.__version__ for m in (torch, diffusers, transformers, tokenizers, sentencepiece)}
    with open(os.path.join(out, "versions.json"), "w", encoding="utf-8") as f:
        json.dump(versions, f, indent=1)
    print("fixtures written to", out, "with", versions)


if __name__ == "__main__":
    main()
