#!/usr/bin/env bash
# bench/multi_gpu.sh end to end on the built-in tiny pipeline on two simulated devices: every row
# has the fields the benchmark promises, no request fails, two replicas both serve, and the split
# layout puts the text encoder's bytes on the second device, lowering the larger device's peak below
# the one-device peak (the simulated devices count placed bytes exactly).
set -euo pipefail
here=$(pwd)  # Holds server/ and bench/ (Bazel's runfiles root, or the CMake build folder).
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
out="$TEST_TMPDIR/multi_gpu.jsonl"
bash "$scripts/multi_gpu.sh" "$here/server/stowage_server" "$here/bench/multi_gpu_bench" builtin:tiny "$out" \
  64 2 ci float32 4,1 8 sim
/usr/bin/python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = {(r["gpus"], r["layout"], r["concurrency"]) for r in rows}
assert keys == {(g, l, n) for (g, l) in ((1, "replicas"), (2, "replicas"), (2, "split")) for n in (1, 4)}, keys
for r in rows:
    for field in ("bench", "gpus", "layout", "images_per_s", "p50_s", "p99_s", "peak_device_bytes", "machine"):
        assert field in r, (field, r)
    assert r["bench"] == "multi_gpu" and r["failed"] == 0 and r["images_per_s"] > 0, r
    assert len(r["peak_device_bytes"]) == r["gpus"], r
    assert r["p50_s"] <= r["p99_s"], r
by = {(r["gpus"], r["layout"], r["concurrency"]): r for r in rows}
single = by[(1, "replicas", 4)]["peak_device_bytes"][0]
assert single > 0, by[(1, "replicas", 4)]
# Four clients on two replicas: both devices ran requests, each holding the whole pipeline. (The
# four-client row runs first: one client's requests all go to the replica with the shorter expected
# wait, which on the simulated devices stays the one that served the lone client.)
assert by[(2, "replicas", 4)]["peak_device_bytes"] == [single, single], (by[(2, "replicas", 4)], single)
split = by[(2, "split", 4)]["peak_device_bytes"]
assert all(p > 0 for p in split) and sum(split) == single, (split, single)
assert max(split) < single, (split, single)
print("ok", len(rows), "rows; one device", single, "bytes; split", split)
PY
