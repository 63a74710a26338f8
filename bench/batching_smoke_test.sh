#!/usr/bin/env bash
# bench/batching.sh end to end on a tiny Z-Image (random weights) on the simulated device: every
# row is written with the fields the benchmark promises, no request fails, and with batching on and
# several clients the server really forms batches (mean batch size above 1).
set -euo pipefail
here=$(pwd)  # Holds server/ and bench/ (Bazel's runfiles root, or the CMake build folder).
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 "$scripts/make_zimage_random_dir.py" "$TEST_TMPDIR/zimage" --size tiny >/dev/null
out="$TEST_TMPDIR/batching.jsonl"
MODES="resident streamed" bash "$scripts/batching.sh" "$here/server/stowage_server" "$here/bench/load_bench" "$TEST_TMPDIR/zimage" "$out" \
  64 2 ci float32 1,4 1,4 2 4
/usr/bin/python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = {(r["mode"], r["max_batch_size"], r["concurrency"]) for r in rows}
assert keys == {(m, b, n) for m in ("resident", "streamed") for b in (1, 4) for n in (1, 4)}, keys
for r in rows:
    for field in ("bench", "mode", "concurrency", "images_per_s", "p50_s", "p99_s", "machine"):
        assert field in r, (field, r)
    assert r["bench"] == "batching" and r["failed"] == 0 and r["images_per_s"] > 0, r
    assert r["p50_s"] <= r["p99_s"], r
    if r["max_batch_size"] == 1:
        assert r["mean_batch_size"] == 1, r   # batching off: every request alone
    if r["max_batch_size"] == 4 and r["concurrency"] == 4:
        assert r["mean_batch_size"] > 1, r    # four clients, batching on: batches form
print("ok", len(rows), "rows")
PY
