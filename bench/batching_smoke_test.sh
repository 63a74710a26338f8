#!/usr/bin/env bash
# bench/batching.sh end to end on a tiny Z-Image (random weights) on the simulated device: every
# row is written with the fields the benchmark promises, no request fails, and with batching on and
# several clients the server really forms batches (mean batch size above 1); the int4-streamed mode
# labels its rows with its host copy's format.
set -euo pipefail
here=$(pwd)  # Holds server/ and bench/ (Bazel's runfiles root, or the CMake build folder).
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 "$scripts/make_zimage_random_dir.py" "$TEST_TMPDIR/zimage" --size tiny >/dev/null
out="$TEST_TMPDIR/batching.jsonl"
MODES="resident streamed streamed_int4" bash "$scripts/batching.sh" "$here/server/stowage_server" "$here/bench/load_bench" "$TEST_TMPDIR/zimage" "$out" \
  64 2 ci float32 1,4 1,4 2 4
/usr/bin/python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
keys = {(r["mode"], r["compress"], r["max_batch_size"], r["concurrency"]) for r in rows}
modes = (("resident", "none"), ("streamed", "none"), ("streamed", "int4"))
assert keys == {(m, c, b, n) for m, c in modes for b in (1, 4) for n in (1, 4)}, keys
for r in rows:
    assert r["compute"] == "bf16" and r["format"] == "png", r
    for field in ("bench", "mode", "compress", "concurrency", "images_per_s", "p50_s", "p99_s", "machine"):
        assert field in r, (field, r)
    assert r["bench"] == "batching" and r["failed"] == 0 and r["images_per_s"] > 0, r
    assert r["p50_s"] <= r["p99_s"], r
    if r["max_batch_size"] == 1:
        assert r["mean_batch_size"] == 1, r   # batching off: every request alone
    if r["max_batch_size"] == 4 and r["concurrency"] == 4:
        assert r["mean_batch_size"] > 1, r    # four clients, batching on: batches form
    # The server's own means from the replies' stats: its run, each stage, the run per image.
    m = r["server_mean_s"]
    # Batching off: no batch is held open for company. Four clients without batching: each request
    # waits in the queue behind the others' runs.
    if r["max_batch_size"] == 1:
        assert m["batch_wait"] == 0, r
        if r["concurrency"] == 4:
            assert m["queue_wait"] > 0, r
    stages = m["stages"]
    for stage in ("encode_prompt", "denoise", "decode"):
        assert stages[stage] > 0, (stage, r)
    # The stages run inside the run, the run inside the slowest request's latency.
    assert 0 < stages["denoise"] <= m["run_time"] < r["p99_s"], r
    # A batch's run shared by its members: per image at most the run, less once batches form.
    assert m["run_time_per_image"] <= m["run_time"] + 1e-9, r
    # The row's wall-clock span: 0 < start < end, a request's p50 inside it.
    assert 0 < r["started_unix_s"] < r["ended_unix_s"], r
    assert r["ended_unix_s"] - r["started_unix_s"] >= r["p50_s"], r
    if r["mean_batch_size"] > 1:
        assert m["run_time_per_image"] < m["run_time"], r
    else:
        assert abs(m["run_time_per_image"] - m["run_time"]) < 1e-5, r
print("ok", len(rows), "rows")
PY
# A mode or compute mode the script does not know is refused by name before any server starts.
if MODES="resident streamed_int3" bash "$scripts/batching.sh" x y z "$TEST_TMPDIR/none.jsonl" 2>"$TEST_TMPDIR/err.txt"; then
  echo "an unknown mode was accepted" >&2; exit 1
fi
grep -q "unknown mode 'streamed_int3'" "$TEST_TMPDIR/err.txt"
if COMPUTE=fp4 bash "$scripts/batching.sh" x y z "$TEST_TMPDIR/none.jsonl" 2>"$TEST_TMPDIR/err.txt"; then
  echo "an unknown compute mode was accepted" >&2; exit 1
fi
grep -q "COMPUTE must be bf16 or fp8, not 'fp4'" "$TEST_TMPDIR/err.txt"
if FORMAT=jpeg bash "$scripts/batching.sh" x y z "$TEST_TMPDIR/none.jsonl" 2>"$TEST_TMPDIR/err.txt"; then
  echo "an unknown format was accepted" >&2; exit 1
fi
grep -q "FORMAT must be png, png_fast or rgb, not 'jpeg'" "$TEST_TMPDIR/err.txt"
# Raw pixels: the rows say so, and every request succeeds.
FORMAT=rgb MODES="resident" bash "$scripts/batching.sh" "$here/server/stowage_server" "$here/bench/load_bench" \
  "$TEST_TMPDIR/zimage" "$TEST_TMPDIR/rgb.jsonl" 64 2 ci float32 2 1,4 2 4
/usr/bin/python3 - "$TEST_TMPDIR/rgb.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert len(rows) == 2 and all(r["format"] == "rgb" and r["failed"] == 0 and r["images_per_s"] > 0 for r in rows), rows
print("rgb ok")
PY
# A high-priority compute stream (a CUDA setting; the simulated device serves as before): the rows say so.
# With STOWCTL and PLACEMENT_DIR each mode's placement is saved as JSON, numbered in the order run.
HIGH_PRIORITY_COMPUTE=1 FORMAT=rgb MODES="resident streamed_int4" STOWCTL="$here/clients/stowctl/stowctl" \
  PLACEMENT_DIR="$TEST_TMPDIR/placement" bash "$scripts/batching.sh" "$here/server/stowage_server" \
  "$here/bench/load_bench" "$TEST_TMPDIR/zimage" "$TEST_TMPDIR/hiprio.jsonl" 64 2 ci float32 2 4 2 4
/usr/bin/python3 - "$TEST_TMPDIR/hiprio.jsonl" "$TEST_TMPDIR/placement" <<'PY'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [(r["mode"], r["compress"]) for r in rows] == [("resident_hiprio", "none"), ("streamed_hiprio", "int4")], rows
assert all(r["failed"] == 0 and r["images_per_s"] > 0 for r in rows), rows
assert sorted(os.listdir(sys.argv[2])) == ["1-resident-none.placement.json", "2-streamed-int4.placement.json"]
def transformer(name):
    placement = json.load(open(os.path.join(sys.argv[2], name)))
    return next(c for c in placement["components"] if c["id"] == "zimage/transformer")
assert int(transformer("1-resident-none.placement.json").get("groupOffload", {}).get("forwards", 0)) == 0
g = transformer("2-streamed-int4.placement.json")["groupOffload"]
# The requests' steps streamed (batched: a forward serves a batch): forwards counted, their groups
# prefetched, and each request's last step skipped the prefetches of a next step.
assert int(g["forwards"]) >= 2 and int(g["prefetches"]) > 0 and int(g["prefetchesSkippedAfterLast"]) > 0, g
print("hiprio and placement ok")
PY
echo "refusals ok"
