"""Writes the LoRA parity fixture: a PEFT adapter on a committed tiny transformer — Z-Image's
(tests/fixtures/zimage_tiny/transformer) or, with --arch flux, Flux.1 [dev]'s
(tests/fixtures/flux_tiny/transformer_dev) — saved in the diffusers LoRA layout, and diffusers +
PEFT's outputs with it at scales 1 and 0.5 on the transformer fixture's own inputs.

Run on the GPU host (torch, peft, diffusers' `src/`), from the repository root:

    PYTHONPATH=.ref/diffusers_slim/src python3 tests/parity/make_lora_fixtures.py tests/fixtures/zimage_tiny OUT
    PYTHONPATH=.ref/diffusers_slim/src python3 tests/parity/make_lora_fixtures.py --arch flux tests/fixtures/flux_tiny OUT

Writes OUT/lora/adapter.safetensors ("transformer.<layer>.lora_A.weight" / ".lora_B.weight", as
diffusers' save_lora_weights names them; PEFT keeps alpha in its config, so it is in
OUT/lora/adapter_config.json) and OUT/lora_io.safetensors (output_scale1, output_scale05, output_off,
all float32). tests/parity/zimage_parity_check's "lora" check loads the adapter with that alpha and
compares.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file


def zimage(fixtures):
    from diffusers import ZImageTransformer2DModel

    model = ZImageTransformer2DModel.from_pretrained(os.path.join(fixtures, "transformer")).eval()
    io = load_file(os.path.join(fixtures, "transformer_io.safetensors"))
    latents, caption, t = io["latents"], io["caption"], io["t"]

    def run():
        with torch.no_grad():
            return model([latents], t, [caption], return_dict=False)[0][0].float().contiguous()

    return model, run, ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]


def flux(fixtures):
    from diffusers import FluxTransformer2DModel

    model = FluxTransformer2DModel.from_pretrained(os.path.join(fixtures, "transformer_dev")).eval()
    io = load_file(os.path.join(fixtures, "transformer_dev_io.safetensors"))

    def run():
        with torch.no_grad():
            return model(hidden_states=io["hidden"], encoder_hidden_states=io["text"],
                         pooled_projections=io["pooled"], timestep=io["timestep"], img_ids=io["img_ids"],
                         txt_ids=io["txt_ids"], guidance=io["guidance"], return_dict=False)[0].float().contiguous()

    # What Flux LoRAs adapt: every attention projection of both block kinds (image and text
    # streams), the feed-forwards, and the single blocks' MLP and output projections.
    return model, run, ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                        "to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2",
                        "proj_mlp", "proj_out"]


def main(arch, fixtures, out):
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model, run, targets = (flux if arch == "flux" else zimage)(fixtures)
    base = run()
    rank, alpha = 4, 8
    torch.manual_seed(5)
    model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False))
    # PEFT's non-default init still draws B small; make the adapter matter.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.3)
    scale1 = run()
    model.set_adapters(["default"], weights=[0.5])
    scale05 = run()
    state = get_peft_model_state_dict(model)
    os.makedirs(os.path.join(out, "lora"), exist_ok=True)
    save_file({f"transformer.{k}": v.contiguous() for k, v in state.items()},
              os.path.join(out, "lora", "adapter.safetensors"))
    with open(os.path.join(out, "lora", "adapter_config.json"), "w") as f:
        json.dump({"r": rank, "lora_alpha": alpha, "target_modules": targets}, f, indent=1)
    save_file({"output_off": base, "output_scale1": scale1, "output_scale05": scale05},
              os.path.join(out, "lora_io.safetensors"))
    print("lora fixture:", len(state), "tensors;",
          "relative change at scale 1:", float((scale1 - base).norm() / base.norm()))


if __name__ == "__main__":
    args = sys.argv[1:]
    arch = "zimage"
    if args[:1] == ["--arch"]:
        arch, args = args[1], args[2:]
    main(arch, args[0], args[1])
