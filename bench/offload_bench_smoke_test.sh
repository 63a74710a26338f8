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
    assert r["step_s"] > 0 and r["weight_bytes"] > 0 and r["peak_rss_bytes"] > 0, r
resident = rows[0]
assert resident["peak_device_bytes"] >= resident["weight_bytes"], resident
for r in rows[1:]:
    # Every offloaded row keeps less than the whole model on the device.
    assert r["peak_device_bytes"] < resident["peak_device_bytes"], r
print("ok:", len(rows), "rows")
PY
