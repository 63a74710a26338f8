#!/usr/bin/env bash
# bench/batch_equivalence against a server on its default device (zimage-tiny, float32): a batch of
# three requests with different prompt lengths and seeds gives each the image it gets alone, and the
# row says so: byte for byte on the simulated device (the float32 promise); on CUDA, where cuBLAS
# picks GEMM kernels by batch shape, within 3 levels of 255 (tests/e2e/batching_e2e_test.cc's bound).
set -euo pipefail
here=$(pwd)
tmp="$TEST_TMPDIR"
cat >"$tmp/config.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
auth { admin_token: "t" }
pipelines { name: "zimage-tiny" builtin: "zimage-tiny" }
CFG
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/serve_lib.sh"
start_server "$here/server/stowage_server" "$tmp/config.textproto" "$tmp/server.log"
trap stop_server EXIT
"$here/bench/batch_equivalence" --target="$TARGET" --token=t --members=3 --size=64 --steps=3 --machine=ci \
  --out="$tmp/rows.jsonl"
device=$(sed -n 's/.*, device \([a-z]*:[0-9]*\)$/\1/p' "$tmp/server.log" | head -1)
/usr/bin/python3 - "$tmp/rows.jsonl" "$device" <<'PY'
import json, sys
(row,) = [json.loads(line) for line in open(sys.argv[1])]
device = sys.argv[2]
assert device.startswith(("sim:", "cuda:")), f"no device in the server's log: {device!r}"
assert row["bench"] == "batch_vs_alone" and row["batch_sizes"] == [3, 3, 3], row
if device.startswith("sim:"):
    assert row["max_abs_diff"] == 0 and row["values_over_1"] == 0 and row["identical_images"] == 3, row
else:
    assert row["max_abs_diff"] <= 3, row
assert row["values"] == 3 * 64 * 64 * 3, row
print("ok", row)
PY
