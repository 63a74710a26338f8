#!/usr/bin/env bash
# CI side of the Z-Image parity check: the C++ components against the committed reference fixtures
# (tests/fixtures/zimage_tiny, written by diffusers/transformers/tokenizers on the GPU host), then the
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
[ "$(grep -c ' ok$' "$TEST_TMPDIR/ok.txt")" -eq 8 ] || { echo "expected 8 passing checks"; exit 1; }

# Adds 0.5 to every element of the first 2-D float32 weight (by name) of safetensors file $1.
perturb() {
  /usr/bin/python3 - "$1" <<'PY'
import json, struct, sys
path = sys.argv[1]
data = bytearray(open(path, "rb").read())
header_len = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + header_len])
name, info = next((k, v) for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32"
                  and "weight" in k and len(v["shape"]) == 2)
begin, end = (8 + header_len + o for o in info["data_offsets"])
values = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
data[begin:end] = struct.pack(f"<{len(values)}f", *(v + 0.5 for v in values))
open(path, "wb").write(bytes(data))
print("perturbed", name, "in", path)
PY
}

expect_failure() {  # $1: label, $2: fixture copy, $3: regex of the check that must fail
  set +e
  "$check" "$2" --bf16_tolerance="$bf16" >"$TEST_TMPDIR/$1.txt" 2>&1
  local rc=$?
  set -e
  cat "$TEST_TMPDIR/$1.txt"
  [ "$rc" -eq 1 ] || { echo "$1: expected exit 1, got $rc"; exit 1; }
  grep -Eq "^$3 .*FAIL" "$TEST_TMPDIR/$1.txt" || { echo "$1: '$3' did not fail"; exit 1; }
}

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
echo "parity test: ok"
