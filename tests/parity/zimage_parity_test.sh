#!/usr/bin/env bash
# CI side of the Z-Image parity check: the C++ components against the committed reference fixtures
# (tests/fixtures/zimage_tiny, written by diffusers/transformers/tokenizers on the GPU host; the LoRA
# adapter and its outputs by diffusers + PEFT, tests/parity/make_lora_fixtures.py), then the
# same check on copies with one weight changed, which must fail on exactly the affected check — proof
# that the comparison sees the weights it is given.
#
# bfloat16: Debian's LibTorch 1.13 rounds bfloat16 differently from the reference's torch 2.11, and the
# fixture's own bfloat16 output is 2% away from its float32 output, so two correct bfloat16
# implementations differ by about that much here. CI therefore allows 3e-2 against the reference's
# bfloat16 output, and separately requires our bfloat16 output to be no further from the float32
# reference than the reference's own (x1.25). On the GPU host the strict 1e-2 holds (errors are 0:
# deploy/gpu_host/results/zimage_parity.txt).
set -euo pipefail
check=tests/parity/zimage_parity_check
fixtures=${STOWAGE_FIXTURES:-tests/fixtures/zimage_tiny}
# The CMake build on the GPU host (torch 2.11, as the reference) sets the strict 1e-2.
bf16=${STOWAGE_PARITY_BF16_TOLERANCE:-3e-2}
[ -x "$check" ] || { echo "missing $check"; exit 1; }
[ -d "$fixtures" ] || { echo "missing $fixtures"; exit 1; }

echo "== committed fixtures"
"$check" "$fixtures" --bf16_tolerance="$bf16" | tee "$TEST_TMPDIR/ok.txt"
grep -q "parity: all checks passed" "$TEST_TMPDIR/ok.txt"
[ "$(grep -c ' ok$' "$TEST_TMPDIR/ok.txt")" -eq 18 ] || { echo "expected 18 passing checks"; exit 1; }

source "$(dirname "$0")/parity_lib.sh"

echo "== transformer weight changed"
cp -rL "$fixtures" "$TEST_TMPDIR/t" && chmod -R u+w "$TEST_TMPDIR/t"
perturb "$TEST_TMPDIR/t/transformer/diffusion_pytorch_model.safetensors"
expect_failure transformer "$TEST_TMPDIR/t" "transformer float32"
grep -Eq "^vae decoder float32 .* ok$" "$TEST_TMPDIR/transformer.txt"

echo "== VAE weight of the whole pipeline changed"
cp -rL "$fixtures" "$TEST_TMPDIR/p" && chmod -R u+w "$TEST_TMPDIR/p"
perturb "$TEST_TMPDIR/p/pipeline/vae/diffusion_pytorch_model.safetensors"
expect_failure pipeline "$TEST_TMPDIR/p" "pipeline image g0"
grep -Eq "^transformer float32 .* ok$" "$TEST_TMPDIR/pipeline.txt"
echo "== a LoRA matrix of the adapter changed"
cp -rL "$fixtures" "$TEST_TMPDIR/l" && chmod -R u+w "$TEST_TMPDIR/l"
perturb "$TEST_TMPDIR/l/lora/adapter.safetensors"
expect_failure lora "$TEST_TMPDIR/l" "lora scale1 float32"
grep -Eq "^lora off float32 .* ok$" "$TEST_TMPDIR/lora.txt"
grep -Eq "^transformer float32 .* ok$" "$TEST_TMPDIR/lora.txt"
echo "== a VAE encoder weight of the pipeline changed (image to image, inpainting)"
cp -rL "$fixtures" "$TEST_TMPDIR/e" && chmod -R u+w "$TEST_TMPDIR/e"
perturb "$TEST_TMPDIR/e/pipeline/vae/diffusion_pytorch_model.safetensors" encoder.conv_out.weight
expect_failure encoder "$TEST_TMPDIR/e" "vae encoder mean float32"
grep -Eq "^edit img2img_s06 .*FAIL$" "$TEST_TMPDIR/encoder.txt"
grep -Eq "^pipeline image g0 .* ok$" "$TEST_TMPDIR/encoder.txt"
echo "== the edit's input image changed"
cp -rL "$fixtures" "$TEST_TMPDIR/i" && chmod -R u+w "$TEST_TMPDIR/i"
cp "$fixtures/edit_mask.png" "$TEST_TMPDIR/i/edit_image.png"
expect_failure input "$TEST_TMPDIR/i" "edit img2img_s06"
echo "parity test: ok"
