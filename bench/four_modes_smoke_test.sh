#!/usr/bin/env bash
# The four modes through the real server on a tiny Z-Image with random weights, on the simulated
# device (which counts the bytes placed on it: weights and offload buffers): the peaks must order as
# the modes intend.
set -euo pipefail
here=$(pwd)  # Holds server/ and clients/ (Bazel's runfiles root, or the CMake build folder).
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 "$scripts/make_zimage_random_dir.py" "$TEST_TMPDIR/zimage" --size tiny >/dev/null
out="$TEST_TMPDIR/four_modes.jsonl"
bash "$scripts/four_modes.sh" "$here/server/stowage_server" "$here/clients/stowctl/stowctl" \
  "$TEST_TMPDIR/zimage" "$out" 64 2 ci float32
/usr/bin/python3 - "$out" <<'PY'
import json, sys
# Placement rows; the device_memory rows (written where nvidia-smi exists) are checked below.
lines = list(map(json.loads, open(sys.argv[1])))
rows = {r["mode"]: r for r in lines if "bench" not in r}
for r in lines:
    if r.get("bench") == "device_memory":
        assert r["reported_peak_bytes"] > 0 and r["nvidia_smi_peak_bytes"], r
assert list(rows) == ["all_resident", "footprint_auto", "text_encoders", "text_encoders_go",
                      "text_encoders_go_all"], list(rows)
peak = {m: r["peak_device_memory_bytes"] for m, r in rows.items()}  # first request of a fresh server
assert peak["footprint_auto"] == peak["all_resident"], peak        # never fires when it all fits
assert peak["text_encoders"] < peak["all_resident"], peak          # the text encoder left first
assert peak["text_encoders_go"] < peak["text_encoders"], peak      # and the transformer streams
# The text encoder streaming too never costs more (at this tiny size it is not what sets the peak).
assert peak["text_encoders_go_all"] <= peak["text_encoders_go"], peak
warm = {m: r["warm_peak_device_memory_bytes"] for m, r in rows.items()}
assert warm["text_encoders_go"] < warm["all_resident"], warm       # group offloading holds between requests
print("ok", peak)
PY
