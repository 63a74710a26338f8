"""Writes the LoRA parity fixture: a PEFT adapter on the committed tiny Z-Image transformer
(tests/fixtures/zimage_tiny/transformer), saved in the diffusers LoRA layout, and diffusers + PEFT's
outputs with it at scales 1 and 0.5 on the transformer fixture's own inputs.

Run on the GPU host (torch, peft, diffusers' `src/`), from the repository root:

    PYTHONPATH=.ref/diffusers_slim/src python3 tests/parity/make_lora_fixtures.py tests/fixtures/zimage_tiny OUT

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


def main(fixtures, out):
    from diffusers import ZImageTransformer2DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    model = ZImageTransformer2DModel.from_pretrained(os.path.join(fixtures, "transformer")).eval()
    io = load_file(os.path.join(fixtures, "transformer_io.safetensors"))
    latents, caption, t = io["latents"], io["caption"], io["t"]

    def run():
        with torch.no_grad():
            return model([latents], t, [caption], return_dict=False)[0][0].float().contiguous()

    base = run()
    rank, alpha = 4, 8
    targets = ["to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3"]
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
    main(sys.argv[1], sys.argv[2])
