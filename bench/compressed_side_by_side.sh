#!/usr/bin/env bash
# 8-bit streaming side by side on the real ZImageTransformer2DModel (the throughput issue's
# "compressed" rows): Stowage's CompressedHostStore (int8 and fp8 e4m3 with per-channel scales,
# block level, streamed) beside diffusers' enable_layerwise_casting (fp8 storage) alone and with
# apply_group_offloading (block level, streams), on the same safetensors files, one process per row,
# the same forward as bench/side_by_side.sh (1024x1024, 512 caption tokens, 2 warm-up, median of 3).
# rel_l2: each row's output against its own system's bf16 output on the same inputs (Stowage: the
# resident row's output saved to a file, so the 8-bit rows' RSS never holds the bf16 weights;
# diffusers: a bf16 forward in the same process before casting).
#
#   bench/compressed_side_by_side.sh OFFLOAD_BENCH MODEL_DIR OUT_DIR MACHINE
# Needs torch and diffusers' source on PYTHONPATH (see bench/diffusers_offload_bench.py). Writes
# OUT_DIR/diffusers_8bit.jsonl, OUT_DIR/stowage_8bit.jsonl, OUT_DIR/compressed.jsonl (rows
# {"bench":"compressed","system":..,"row":..,"step_s":..,"resident_bf16_step_s":..,"rel_l2":..,
# "peak_rss_bytes":..,"bf16_weight_bytes":..,"machine":..}) and OUT_DIR/compressed.md.
set -uo pipefail
bench=$1 dir=$2 out=$3 machine=$4
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=${PYTHON:-python3}
mkdir -p "$out"
reference=$(mktemp --suffix=.safetensors)
trap 'rm -f "$reference"' EXIT
if [ ! -f "$dir/transformer/config.json" ]; then
  "$py" "$here/diffusers_offload_bench.py" export "$dir" || exit 1
fi
cat "$dir"/transformer/*.safetensors >/dev/null  # Both sides read the files from the page cache.
for row in resident block_level layerwise_fp8 layerwise_fp8_block_level; do
  echo "== diffusers $row"
  timeout "${ROW_TIMEOUT:-240}" "$py" "$here/diffusers_offload_bench.py" row "$row" "$dir" \
    --out "$out/diffusers_8bit.jsonl" --machine "$machine" || echo "diffusers $row failed ($?)"
done
echo "== stowage resident"
timeout "${ROW_TIMEOUT:-240}" "$bench" --model_dir="$dir" --rows=resident --warmup=2 --iters=3 \
  --save_output="$reference" --out="$out/stowage_8bit.jsonl" --machine="$machine" || echo "stowage resident failed ($?)"
for row in block_pinned block_int8 block_fp8; do
  echo "== stowage $row"
  timeout "${ROW_TIMEOUT:-240}" "$bench" --model_dir="$dir" --rows="$row" --warmup=2 --iters=3 \
    --reference="$reference" --out="$out/stowage_8bit.jsonl" --machine="$machine" || echo "stowage $row failed ($?)"
done
"$py" "$here/diffusers_offload_bench.py" compressed "$out/diffusers_8bit.jsonl" "$out/stowage_8bit.jsonl" \
  --out "$out/compressed.jsonl" --machine "$machine" | tee "$out/compressed.md"
