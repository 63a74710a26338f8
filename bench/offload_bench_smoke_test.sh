#!/usr/bin/env bash
# The benchmark runs every row on the simulated device at a small size and writes one well-formed
# JSON line per row with the required fields (its numbers are not judged here).
set -euo pipefail
out="$TEST_TMPDIR/rows.jsonl"
bench/offload_bench --config=small --backend=sim --warmup=1 --iters=2 --out="$out" \
  --machine=ci --disk_dir="$TEST_TMPDIR/disk" --staging_mib=1
/usr/bin/python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
names = [r["row"] for r in rows]
expected = ["resident", "block_pinned", "leaf_pinned", "block_lowram", "leaf_lowram", "block_disk",
            "budget25", "budget50", "budget75"]
assert names == expected, names
for r in rows:
    for field in ["row", "step_s", "floor_s", "resident_step_s", "peak_device_bytes",
                  "peak_rss_bytes", "weight_bytes", "machine"]:
        assert field in r, (r["row"], field)
    assert r["compute_priority"] == "default", r
    assert r["page_cache_read_s"] == 0, r  # No --model_dir: nothing read.
    assert r["step_s"] > 0 and r["weight_bytes"] > 0 and r["peak_rss_bytes"] > 0, r
    # The base again after the row freed its weights: a process still running, above nothing.
    assert r["base_rss_bytes"] > 0 and r["base_rss_warm_bytes"] > 0 and r["base_rss_after_bytes"] > 0, r
resident = rows[0]
assert resident["peak_device_bytes"] >= resident["weight_bytes"], resident
for r in rows[1:]:
    # Every offloaded row keeps less than the whole model on the device.
    assert r["peak_device_bytes"] < resident["peak_device_bytes"], r
print("ok:", len(rows), "rows")
PY

# The compressed rows: about half (8-bit) or 0.29 (int4, 4.5 bits a value) of the bf16 bytes per forward, a small
# error against the resident output.
out8="$TEST_TMPDIR/rows8.jsonl"
bench/offload_bench --config=small --backend=sim --warmup=1 --iters=2 --out="$out8" \
  --machine=ci --rows=block_pinned,block_int8,block_fp8,block_int8grouped,block_int4,block_int4_wg,block_int4_b50
/usr/bin/python3 - "$out8" <<'PY'
import json, sys
rows = {r["row"]: r for r in (json.loads(line) for line in open(sys.argv[1]))}
assert list(rows) == ["block_pinned", "block_int8", "block_fp8", "block_int8grouped", "block_int4",
                      "block_int4_wg", "block_int4_b50"], list(rows)
# A device budget of half the weights: the planner keeps some groups resident in their own dtype, so
# fewer bytes cross per forward and fewer layers are rounded; nothing without "_b" keeps any.
kept = rows["block_int4_b50"]
assert 0 < kept["resident_bytes"] < kept["weight_bytes"] // 2, kept
assert kept["streamed_bytes"] < rows["block_int4"]["streamed_bytes"], (kept, rows["block_int4"])
assert kept["rel_l2"] < rows["block_int4"]["rel_l2"], (kept, rows["block_int4"])
assert kept["working_set_bytes"] <= kept["weight_bytes"] // 2, kept
assert all(r["resident_bytes"] == 0 for name, r in rows.items() if "_b" not in name), rows
# No --prefetch_depth: the engine chose each row's depth (as the server does), and the row says which ran.
assert all(r["prefetch_depth"] >= 1 for r in rows.values()), rows
# A group's weights widened in shared launches (the same code on the simulator): the same bytes and output.
assert rows["block_int4_wg"]["streamed_bytes"] == rows["block_int4"]["streamed_bytes"]
assert rows["block_int4_wg"]["rel_l2"] == rows["block_int4"]["rel_l2"], (rows["block_int4_wg"], rows["block_int4"])
assert rows["block_pinned"]["rel_l2"] == 0 and rows["block_pinned"]["compress"] == "none"
# 16 bf16 blocks deep.
for name, bound, fmt, lo, hi in [("block_int8", 0.06, "int8", 0.5, 0.6), ("block_fp8", 0.15, "fp8_e4m3", 0.5, 0.6),
                                 ("block_int8grouped", 0.06, "int8_grouped", 0.5, 0.6),
                                 ("block_int4", 0.4, "int4", 0.28, 0.31)]:  # Random weights amplify int4 (fidelity: shapes).
    r = rows[name]
    assert 0 < r["rel_l2"] < bound, r
    assert r["compress"] == fmt, r
    ratio = r["streamed_bytes"] / rows["block_pinned"]["streamed_bytes"]
    assert lo < ratio < hi, (name, ratio)
    assert r["floor_8bit_s"] > 0, r
    assert r["prepare_pin_alloc_s"] >= 0 and r["prepare_quantize_s"] >= 0 and r["prepare_fp8_s"] == 0, r
    print(name, "rel_l2", r["rel_l2"], "bytes ratio", round(ratio, 3))
print("ok: compressed rows")
PY

# The real Z-Image transformer from a diffusers-format folder (the tiny parity fixture, written by
# diffusers): its weights are mapped, the low-CPU-RAM rows pin that mapping in place.
fixtures=${STOWAGE_FIXTURES:-tests/fixtures/zimage_tiny}
out2="$TEST_TMPDIR/zimage.jsonl"
bench/offload_bench --model_dir="$fixtures" --backend=sim --warmup=1 --iters=2 --out="$out2" --machine=ci \
  --image_size=64 --caption_tokens=32 --rows=resident,block_pinned,block_lowram,leaf_lowram --prefetch_depth=1
/usr/bin/python3 - "$out2" "$fixtures/transformer/diffusion_pytorch_model.safetensors" <<'PY'
import json, struct, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["row"] for r in rows] == ["resident", "block_pinned", "block_lowram", "leaf_lowram"], rows
data = open(sys.argv[2], "rb").read()
header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
elements = 0
for name, info in header.items():
    if name != "__metadata__":
        n = 1
        for d in info["shape"]:
            n *= d
        elements += n
for r in rows:
    assert r["model"] == "ZImageTransformer2DModel", r
    assert r["weight_bytes"] == 2 * elements, (r["weight_bytes"], elements)  # bf16, every tensor.
    assert r["step_s"] > 0, r
    # The folder's files read from the page cache once per process: the same figure in every row.
    assert 0 < r["page_cache_read_s"] == rows[0]["page_cache_read_s"], r
lowram = [r for r in rows if "lowram" in r["row"]]
for r in lowram:
    # Every weight byte is pinned: the safetensors file's whole mapping is the region.
    assert r["pinned_in_place_bytes"] >= r["weight_bytes"] > 0 and r["streamed_bytes"] > 0, r
    assert r["pin_in_place_error"] == "", r
assert rows[1]["pinned_in_place_bytes"] == 0, rows[1]
assert all(r["peak_device_bytes"] < rows[0]["peak_device_bytes"] for r in rows[1:]), rows
print("ok: Z-Image rows", [r["row"] for r in rows])
PY

# --batch with a model folder: the input N times in one forward (Z-Image's ForwardBatch, Flux's batch
# dimension), sample 0's output the row's — the same as the batch of one's (the samples are identical,
# so this does not tell one sample from another: the batch's own tests do), and a compressed row's
# error is against a resident forward of its own batch. The resident row runs last, so its output is
# the one saved. Flux's tiny [dev] transformer goes under transformer/.
mkdir -p "$TEST_TMPDIR/flux"
ln -sfn "$PWD/tests/fixtures/flux_tiny/transformer_dev" "$TEST_TMPDIR/flux/transformer"
for model in zimage flux; do
  dir=$fixtures
  [ $model = flux ] && dir=$TEST_TMPDIR/flux
  for batch in 1 2; do
    bench/offload_bench --model_dir="$dir" --config=small --backend=sim --warmup=1 --iters=1 --machine=ci \
      --image_size=64 --caption_tokens=16 --prefetch_depth=1 --batch=$batch --rows=block_int8,resident \
      --out="$TEST_TMPDIR/${model}_b$batch.jsonl" --save_output="$TEST_TMPDIR/${model}_b$batch.safetensors" >/dev/null
  done
  /usr/bin/python3 - "$TEST_TMPDIR/${model}_b1" "$TEST_TMPDIR/${model}_b2" <<'PY'
import json, math, struct, sys
def output(path):
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    info = json.loads(data[8:8 + n])["output"]
    assert info["dtype"] == "F32", info
    start, end = info["data_offsets"]
    values = struct.unpack(f"<{(end - start) // 4}f", data[8 + n + start:8 + n + end])
    return info["shape"], values
for stem in sys.argv[1:]:
    rows = [json.loads(line) for line in open(stem + ".jsonl")]
    assert [r["row"] for r in rows] == ["block_int8", "resident"], rows
    batch = 2 if stem.endswith("_b2") else 1
    # "samples": what the forward itself returned — it did compute the whole batch.
    assert all(r["batch"] == batch and r["samples"] == batch and r["step_s"] > 0 for r in rows), rows
    assert 0 < rows[0]["rel_l2"] < 0.1, rows[0]  # int8 against the resident forward of the same batch.
(shape1, one), (shape2, two) = output(sys.argv[1] + ".safetensors"), output(sys.argv[2] + ".safetensors")
assert shape1 == shape2, (shape1, shape2)  # Sample 0 only.
diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(one, two)))
norm = math.sqrt(sum(a * a for a in one))
assert norm > 0 and diff / norm < 1e-2, (diff, norm)
print("ok: batch 2 sample 0 vs batch 1", sys.argv[1], "rel", diff / norm)
PY
  # --back_to_back: the timed forwards queue one after another (one synchronisation at the end); the
  # streamed row's last forward gives the same output as a synchronised one, and rows say so.
  for mode in sync btb; do
    bench/offload_bench --model_dir="$dir" --config=small --backend=sim --warmup=1 --iters=3 --machine=ci \
      --image_size=64 --caption_tokens=16 --prefetch_depth=1 --batch=2 --rows=block_int8 \
      $([ $mode = btb ] && echo --back_to_back) \
      --out="$TEST_TMPDIR/${model}_$mode.jsonl" --save_output="$TEST_TMPDIR/${model}_$mode.safetensors" >/dev/null
  done
  /usr/bin/python3 - "$TEST_TMPDIR/${model}_btb" "$TEST_TMPDIR/${model}_sync" <<'PY'
import json, struct, sys
def output(path):  # The tensor's bytes (the header's key order varies).
    data = open(path, "rb").read()
    n = struct.unpack("<Q", data[:8])[0]
    info = json.loads(data[8:8 + n])["output"]
    start, end = info["data_offsets"]
    return info["shape"], data[8 + n + start:8 + n + end]
assert output(sys.argv[1] + ".safetensors") == output(sys.argv[2] + ".safetensors")
btb = [json.loads(line) for line in open(sys.argv[1] + ".jsonl")]
synced = [json.loads(line) for line in open(sys.argv[2] + ".jsonl")]
assert len(btb) == 1 and btb[0]["back_to_back"] is True and btb[0]["step_s"] > 0, btb
assert all(r["back_to_back"] is False for r in synced), synced
PY
done
if bench/offload_bench --config=small --backend=sim --rows=resident --batch=0 --out="$TEST_TMPDIR/b0.jsonl" \
    2>"$TEST_TMPDIR/b0.err"; then
  echo "--batch=0 was accepted" >&2
  exit 1
fi
grep -q -- '--batch=0: 1..64' "$TEST_TMPDIR/b0.err"

# The compute stream's priority is default or high (high changes nothing off CUDA); anything else is
# refused before any work.
bench/offload_bench --config=small --backend=sim --warmup=1 --iters=1 --rows=resident --compute_priority=high \
  --out="$TEST_TMPDIR/high.jsonl" --machine=ci >/dev/null
grep -q '"compute_priority": "high"' "$TEST_TMPDIR/high.jsonl"
if bench/offload_bench --config=small --backend=sim --rows=resident --compute_priority=urgent \
    --out="$TEST_TMPDIR/bad.jsonl" 2>"$TEST_TMPDIR/bad.err"; then
  echo "--compute_priority=urgent was accepted" >&2
  exit 1
fi
grep -q 'compute_priority=urgent: default or high' "$TEST_TMPDIR/bad.err"
[ ! -s "$TEST_TMPDIR/bad.jsonl" ]
echo "ok: compute priority"

# The pinning probe: three ways of getting page-locked host memory, each timed.
bench/offload_bench --config=small --backend=sim --rows=pin_probe --out="$TEST_TMPDIR/pin.jsonl" --machine=ci >/dev/null
/usr/bin/python3 - "$TEST_TMPDIR/pin.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 1 and rows[0]["row"] == "pin_probe" and rows[0]["bytes"] == 64 << 20, rows
for key in ("pinned_alloc_bytes_per_s", "register_4k_bytes_per_s", "register_huge_bytes_per_s"):
    assert rows[0][key] > 0, (key, rows[0])
print("ok: pin probe")
PY

# The widening probe: each streamed format widened alone, one launch a weight and shared launches;
# the bytes a pass moves are the codes, scales and widened weights of 8 weights of [512, 384].
bench/offload_bench --config=small --backend=sim --rows=widen_probe --out="$TEST_TMPDIR/widen.jsonl" --machine=ci >/dev/null
/usr/bin/python3 - "$TEST_TMPDIR/widen.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
copies = [r for r in rows if r["format"] == "copy"]
assert len(copies) == 1 and copies[0]["out"] == "bf16" and copies[0]["bytes_per_s"] > 0, copies
rows = [r for r in rows if r["format"] != "copy"]
seen = {(r["format"], r["out"], r["shared_launches"], r["layout"]) for r in rows}
assert seen == {(f, "bf16", s, l) for f in ("int8_grouped", "int4") for s in (False, True)
                for l in ("coalesced", "strided")}, seen
assert len(rows) == len(seen), rows
values = 8 * 512 * 384
for r in rows:
    codes = values if r["format"] == "int8_grouped" else values // 2
    scales = values // 128 * 4 if r["format"] == "int8_grouped" else 8 * 512 * 4 + values // 16
    assert r["bytes_per_pass"] == codes + scales + 2 * values, r
    assert r["seconds_per_pass"] > 0 and r["bytes_per_s"] > 0, r
print("ok: widen probe")
PY
if bench/offload_bench --config=small --backend=sim --rows=block_int4 --widen_layout=diagonal >/dev/null 2>&1; then
  echo "FAIL: --widen_layout=diagonal was accepted"
  exit 1
fi
echo "ok: widen layout checked"

# --spill_dir: the synthetic stack's random weights move into a mapped file that is removed at once;
# the int4 row's output is the same as without (same bytes streamed), and RSS after preparing is lower.
mkdir -p "$TEST_TMPDIR/spill"
outs="$TEST_TMPDIR/rows_spill.jsonl"
bench/offload_bench --config=small --backend=sim --warmup=1 --iters=2 --out="$outs" --machine=ci \
  --rows=block_int4 --spill_dir="$TEST_TMPDIR/spill" --save_output="$TEST_TMPDIR/spill_out.safetensors"
bench/offload_bench --config=small --backend=sim --warmup=1 --iters=2 --out="$outs" --machine=ci \
  --rows=block_int4 --save_output="$TEST_TMPDIR/plain_out.safetensors"
/usr/bin/python3 - "$outs" <<'PY'
import json, sys
spilled, plain = [json.loads(line) for line in open(sys.argv[1])]
# Every tensor of 4 KiB or more (all but the small biases and norms).
assert spilled["weight_bytes"] >= spilled["spilled_bytes"] >= 0.99 * spilled["weight_bytes"] > 0, spilled
assert plain["spilled_bytes"] == 0, plain
assert 0 < spilled["rss_after_prepare_bytes"] < plain["rss_after_prepare_bytes"], (spilled, plain)
assert spilled["rel_l2"] == plain["rel_l2"], (spilled["rel_l2"], plain["rel_l2"])
print("ok: spilled", spilled["spilled_bytes"], "bytes; rss after prepare", spilled["rss_after_prepare_bytes"],
      "vs", plain["rss_after_prepare_bytes"])
PY
/usr/bin/python3 - "$TEST_TMPDIR/spill_out.safetensors" "$TEST_TMPDIR/plain_out.safetensors" <<'PY'
import struct, sys
def data(path):  # The tensor bytes (the header's key order may differ).
    b = open(path, "rb").read()
    return b[8 + struct.unpack("<Q", b[:8])[0]:]
assert data(sys.argv[1]) == data(sys.argv[2]), "the spilled row's output differs"
PY
[ -z "$(ls -A "$TEST_TMPDIR/spill")" ] || { echo "FAIL: the spill file was left behind"; exit 1; }
echo "ok: --spill_dir"
