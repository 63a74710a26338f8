#!/usr/bin/env bash
# bench/overlap.sh and bench/e2e_bench.sh (the Stowage side) end to end on tiny Z-Image pipelines on
# the simulated device: each writes its rows with the fields the benchmarks promise.
set -euo pipefail
here=$(pwd)  # Holds server/, clients/ and tests/ (Bazel's runfiles root).
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 "$scripts/make_zimage_random_dir.py" "$TEST_TMPDIR/zimage" --size tiny >/dev/null
bash "$scripts/overlap.sh" "$here/server/stowage_server" "$here/clients/stowctl/stowctl" "$TEST_TMPDIR/zimage" \
  "$TEST_TMPDIR/overlap.jsonl" ci 64 2
LOAD_BENCH="$here/bench/load_bench" bash "$scripts/e2e_bench.sh" "$here/server/stowage_server" "$here/clients/stowctl/stowctl" \
  "$here/tests/fixtures/zimage_tiny/pipeline" "$TEST_TMPDIR/e2e.jsonl" ci 64 2 stowage
# And with the VAE's convolutions on the worker's thread (DeviceConfig.convolution_lane false).
CONV_LANE=off bash "$scripts/e2e_bench.sh" "$here/server/stowage_server" "$here/clients/stowctl/stowctl" \
  "$here/tests/fixtures/zimage_tiny/pipeline" "$TEST_TMPDIR/e2e_no_lane.jsonl" ci 64 2 stowage
/usr/bin/python3 - "$TEST_TMPDIR/overlap.jsonl" "$TEST_TMPDIR/e2e.jsonl" "$TEST_TMPDIR/e2e_no_lane.jsonl" <<'PY'
import json, sys
overlap = [json.loads(line) for line in open(sys.argv[1])]
assert [r["prefetch_next_component"] for r in overlap] == [False, True], overlap
for r in overlap:
    assert r["bench"] == "overlap" and r["warm_s"] > 0 and "denoise" in r["stages_s"], r
(e2e,) = [json.loads(line) for line in open(sys.argv[2])]
assert e2e["bench"] == "e2e" and e2e["system"] == "stowage" and e2e["steps"] == 2 and e2e["size"] == 64, e2e
assert 0 < e2e["warm_s"] and 0 < e2e["first_s"] and e2e["server_denoise_s"] > 0, e2e
# What no stage holds is part of the run, never more than it.
assert 0 <= e2e["server_unstaged_s"] < e2e["server_run_s"], e2e
assert set(e2e["first_stages_s"]) >= {"encode_prompt", "denoise", "decode", "encode_image"}, e2e
assert 0 < e2e["warm_persistent_client_s"] <= e2e["warm_s"] * 3, e2e
assert e2e["convolution_lane"] is True, e2e
(no_lane,) = [json.loads(line) for line in open(sys.argv[3])]
assert no_lane["convolution_lane"] is False and no_lane["server_decode_s"] > 0, no_lane
print("ok")
PY
