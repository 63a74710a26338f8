#!/usr/bin/env bash
# The commands that turn GPU-host output into the issues' rows, on made-up inputs (no torch):
#   diffusers_two_pipelines.py summarize — per-call lines of runs cut short → two_pipelines rows;
#   diffusers_offload_bench.py flux_rows — each row's floor from its own process's bandwidth, the
#     diffusers rows' from --diffusers_bandwidth, each row keeping the commit it was measured at;
#   multi_tenant_diffusers.py summarize — the multi-tenant baseline's rows from a cut run's call rows.
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
# multi_tenant_diffusers.py summarize — a multi-tenant baseline cut short by its call's limit: rows
# rebuilt from the call rows it appended; a file that already has its rows, or has no calls, is refused.
mcall() {  # pipeline arrival latency run bytes error peak
  printf '{"bench": "multi_tenant_call", "strategy": "diffusers_model_cpu_offload", "pipeline": "%s", "tenant": "alice", "priority": 0, "seed": 1, "arrival_s": %s, "latency_s": %s, "run_s": %s, "bytes_moved": %s, "error": %s, "peak_device_bytes_so_far": %s, "peak_nvidia_smi_bytes_so_far": %s, "machine": "H200, commit eee", "commit": "eee"}\n' "$@"
}
{ mcall zimage 0.0 10.0 10.0 100 null 1000 1100; mcall flux-dev 1.0 29.0 20.0 300 null 3000 3100;
  mcall zimage 2.0 38.0 10.0 100 '"OutOfMemoryError: y"' 3000 5000; } >"$t/multi_calls.jsonl"
/usr/bin/python3 "$scripts/multi_tenant_diffusers.py" summarize "$t/multi_calls.jsonl" 0.000004 >"$t/multi_rows.jsonl"
/usr/bin/python3 - "$t/multi_rows.jsonl" <<'PY'
import json, sys
rows = {r["pipeline"]: r for r in map(json.loads, open(sys.argv[1]))}
assert sorted(rows) == ["all", "flux-dev", "zimage"], rows
a, z, f = rows["all"], rows["zimage"], rows["flux-dev"]
assert a["strategy"] == "diffusers_model_cpu_offload" and a["requests"] == 3 and a["p50_s"] == 19.5, a
assert a["images_per_s"] == 2 / 40.0 and a["bytes_moved_per_request"] == 500 / 3, a  # Served 0..40 s; 2 ok.
assert a["peak_device_bytes"] == 3000 and a["peak_nvidia_smi_bytes"] == 5000 and a["budget_bytes"] == 4294, a
assert not a["ok"] and a["errors"] == ["OutOfMemoryError: y"] and a["commit"] == "eee", a
assert z["requests"] == 2 and z["p50_s"] == 10.0 and z["run_s"] == 10.0 and z["images_per_s"] is None, z
assert f["p50_s"] == 29.0 and f["bytes_moved_per_request"] == 300, f
print("multi summarize ok")
PY
cat "$t/multi_calls.jsonl" "$t/multi_rows.jsonl" >"$t/multi_done.jsonl"
if /usr/bin/python3 "$scripts/multi_tenant_diffusers.py" summarize "$t/multi_done.jsonl" 2>"$t/err.txt"; then
  echo "a file with its rows was summarized again"; exit 1
fi
grep -q "already has its rows" "$t/err.txt"
: >"$t/empty.jsonl"
if /usr/bin/python3 "$scripts/multi_tenant_diffusers.py" summarize "$t/empty.jsonl" 2>"$t/err.txt"; then
  echo "a file without calls was summarized"; exit 1
fi
grep -q "has no multi_tenant_call rows" "$t/err.txt"
