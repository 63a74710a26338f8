#!/usr/bin/env bash
# The commands that turn GPU-host output into the issues' rows, on made-up inputs (no torch):
#   diffusers_two_pipelines.py summarize — per-call lines of runs cut short → two_pipelines rows;
#   diffusers_offload_bench.py flux_rows — each row's floor from its own process's bandwidth, the
#     diffusers rows' from --diffusers_bandwidth, each row keeping the commit it was measured at.
set -euo pipefail
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
t=$TEST_TMPDIR
call() {  # pipeline latency error peak commit
  printf '{"bench": "two_pipelines_call", "strategy": "diffusers_model_cpu_offload", "pipeline": "%s", "latency_s": %s, "error": %s, "peak_device_bytes_so_far": %s, "size": 1024, "steps": 8, "machine": "H200, commit %s"}\n' "$@"
}
{ call zimage 20.0 null 1000 aaa; call flux 30.0 null 3000 aaa; } >"$t/run_a.jsonl"
{ call zimage 22.0 null 2000 bbb; call flux 31.0 '"OutOfMemoryError: x"' 5000 bbb; } >"$t/run_b.jsonl"
echo '{"bench": "two_pipelines", "strategy": "resident", "pipeline": "zimage", "arrival": "alternating", "latency_s": 2.0}' >"$t/resident.jsonl"
echo '{"bench": "two_pipelines", "strategy": "resident", "pipeline": "zimage", "arrival": "concurrent", "latency_s": 9.0}' >>"$t/resident.jsonl"
/usr/bin/python3 "$scripts/diffusers_two_pipelines.py" summarize "$t/run_a.jsonl" "$t/run_b.jsonl" \
  --out "$t/rows.jsonl" --resident_from "$t/resident.jsonl" --budget_gib 0.000004 >/dev/null
/usr/bin/python3 - "$t/rows.jsonl" <<'PY'
import json, sys
rows = {r["pipeline"]: r for r in map(json.loads, open(sys.argv[1]))}
z, f = rows["zimage"], rows["flux"]
assert z["bench"] == "two_pipelines" and z["strategy"] == "diffusers_model_cpu_offload", z
assert z["latencies_s"] == [20.0, 22.0] and z["latency_s"] == 21.0 and z["resident_latency_s"] == 2.0, z
assert z["peak_device_bytes"] == 2000 and z["budget_bytes"] == 4294 and z["ok"] and z["errors"] == [], z
assert z["machine"] == ["H200, commit aaa", "H200, commit bbb"], z
assert f["resident_latency_s"] is None and not f["ok"] and f["errors"] == ["OutOfMemoryError: x"], f
assert f["peak_device_bytes"] == 5000, f
print("summarize ok")
PY
set +e
out=$(/usr/bin/python3 "$scripts/diffusers_two_pipelines.py" summarize "$t/resident.jsonl" --out "$t/none.jsonl" 2>&1); rc=$?
set -e
[ $rc -ne 0 ] && grep -q "no two_pipelines_call lines" <<<"$out" || { echo "summarize of no calls: $rc $out"; exit 1; }

row() {  # row step rss bandwidth commit
  printf '{"row": "%s", "step_s": %s, "peak_rss_bytes": %s, "peak_device_bytes": 7, "weight_bytes": 100, "h2d_bandwidth_bytes_per_s": %s, "model": "FluxTransformer2DModel", "machine": "H200, commit %s"}\n' "$@"
}
{ row resident 0.5 10 50 ccc; row block_pinned 2.2 104 40 ccc; } >"$t/stowage.jsonl"
echo '{"row": "block_level", "step_s": 3.0, "peak_rss_bytes": 259, "peak_device_bytes": 9, "weight_bytes": 100, "machine": "H200, commit ddd"}' >"$t/diffusers.jsonl"
/usr/bin/python3 "$scripts/diffusers_offload_bench.py" flux_rows "$t/diffusers.jsonl" "$t/stowage.jsonl" \
  --out "$t/flux.jsonl" --diffusers_bandwidth 25 --machine fallback >/dev/null
/usr/bin/python3 - "$t/flux.jsonl" <<'PY'
import json, sys
rows = {(r["system"], r["row"]): r for r in map(json.loads, open(sys.argv[1]))}
assert all(r["bench"] == "flux_offload" for r in rows.values()), rows
d, s = rows[("diffusers", "block_level")], rows[("stowage", "block_pinned")]
assert d["floor_s"] == 4.0 and d["x_floor"] == 0.75 and d["machine"] == "H200, commit ddd", d
assert s["floor_s"] == 2.5 and abs(s["x_floor"] - 0.88) < 1e-12 and s["rss_x_weights"] == 1.04, s
assert s["machine"] == "H200, commit ccc" and rows[("stowage", "resident")]["floor_s"] == 2.0, rows
print("flux_rows ok")
PY
