#!/usr/bin/env bash
# Side by side on a real transformer (ZImageTransformer2DModel, or Flux.1 [dev]'s
# FluxTransformer2DModel with ARCH=flux): diffusers' apply_group_offloading and Stowage's offload
# engine on the same safetensors files (written by diffusers), in one run, one process per row, the
# same forward (1024x1024, 512 caption tokens), 2 warm-up forwards and the median of 3.
#
#   bench/side_by_side.sh OFFLOAD_BENCH MODEL_DIR OUT_DIR MACHINE [ARCH]
# Needs torch and diffusers' source on PYTHONPATH (see bench/diffusers_offload_bench.py). Writes
# OUT_DIR/diffusers.jsonl, OUT_DIR/stowage.jsonl and OUT_DIR/side_by_side.md; with ARCH=flux also
# OUT_DIR/flux_offload.jsonl (the {"bench":"flux_offload",...} rows). DIFFUSERS_ROWS and
# STOWAGE_ROWS (space-separated) replace the default rows; set empty, that side runs none (rows
# already in OUT_DIR/diffusers.jsonl or OUT_DIR/stowage.jsonl, say from an earlier run, are used).
set -uo pipefail
bench=$1 dir=$2 out=$3 machine=$4 arch=${5:-zimage}
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py=${PYTHON:-python3}
mkdir -p "$out"
want_class=$([ "$arch" = flux ] && echo FluxTransformer2DModel || echo ZImageTransformer2DModel)
if [ -f "$dir/transformer/config.json" ] && ! grep -q "\"$want_class\"" "$dir/transformer/config.json"; then
  echo "$dir/transformer is not a $want_class: exporting again"
  rm -rf "$dir/transformer"
fi
if [ ! -f "$dir/transformer/config.json" ]; then
  "$py" "$here/diffusers_offload_bench.py" export "$dir" --arch "$arch" || exit 1
fi
# Both sides read the files from the page cache: read them once first.
cat "$dir"/transformer/*.safetensors >/dev/null
for row in ${DIFFUSERS_ROWS-resident block_level leaf_level block_level_lowmem leaf_level_lowmem}; do
  echo "== diffusers $row"
  timeout "${ROW_TIMEOUT:-240}" "$py" "$here/diffusers_offload_bench.py" row "$row" "$dir" \
    --out "$out/diffusers.jsonl" --machine "$machine" || echo "diffusers $row failed ($?)"
done
resident_step=0
for row in ${STOWAGE_ROWS-resident block_pinned leaf_pinned leaf_pinned_d4 block_lowram leaf_lowram leaf_lowram_d4}; do
  echo "== stowage $row"
  timeout "${ROW_TIMEOUT:-240}" "$bench" --model_dir="$dir" --rows="$row" --warmup=2 --iters=3 \
    --out="$out/stowage.jsonl" --machine="$machine" --resident_step_s="$resident_step" \
    || echo "stowage $row failed ($?)"
  if [ "$row" = resident ] && [ -s "$out/stowage.jsonl" ]; then
    resident_step=$("$py" -c 'import json,sys; print(json.loads(open(sys.argv[1]).readline())["step_s"])' "$out/stowage.jsonl")
  fi
done
"$py" "$here/diffusers_offload_bench.py" table "$out/diffusers.jsonl" "$out/stowage.jsonl" | tee "$out/side_by_side.md"
if [ "$arch" = flux ]; then
  "$py" "$here/diffusers_offload_bench.py" flux_rows "$out/diffusers.jsonl" "$out/stowage.jsonl" \
    --out "$out/flux_offload.jsonl" --machine "$machine" | tee "$out/flux_offload.md"
fi
