#!/usr/bin/env bash
# bench/gpu_clocks.py: stamping nvidia-smi's lines with the time, and joining samples with rows by
# their spans (means, minimum, maximum, throttle reasons OR'ed; a row without samples or without a
# span says so; a malformed sample line is refused naming its line).
set -euo pipefail
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tool="$scripts/gpu_clocks.py"
printf '1980, 2619, 650.5, 61, 0x0000000000000000\n\n1755, 2619, 700.0, 70, 0x0000000000000004\n' |
  /usr/bin/python3 "$tool" stamp >"$TEST_TMPDIR/stamped.csv"
[ "$(wc -l <"$TEST_TMPDIR/stamped.csv")" -eq 2 ] || { echo "stamp kept the blank line or lost one"; exit 1; }
grep -Eq '^[0-9]{10}\.[0-9]{3},1980, 2619' "$TEST_TMPDIR/stamped.csv"
cat >"$TEST_TMPDIR/samples.csv" <<'CSV'
100.0,1980,2619,600,60,0x0000000000000000
101.0,1800,2619,700,65,0x0000000000000004
102.0,1700,2619,[N/A],70,0x0000000000000001
200.0,1980,2619,300,40,0x0000000000000000
CSV
cat >"$TEST_TMPDIR/rows.jsonl" <<'JSON'
{"mode": "resident", "compress": "none", "concurrency": 4, "started_unix_s": 99.5, "ended_unix_s": 102.5}
{"mode": "streamed", "compress": "int4", "concurrency": 4, "started_unix_s": 150.0, "ended_unix_s": 160.0}
{"mode": "streamed", "compress": "int4", "concurrency": 8}
JSON
out=$(/usr/bin/python3 "$tool" join "$TEST_TMPDIR/samples.csv" "$TEST_TMPDIR/rows.jsonl")
echo "$out"
echo "$out" | grep -q "resident/none N=4: samples 3 sm_mhz_mean 1826.7 sm_mhz_min 1700.0 mem_mhz_mean 2619.0 power_w_mean 650.0 power_w_max 700.0 temp_c_max 70.0 throttle_reasons 0x5"
echo "$out" | grep -q "streamed/int4 N=4: no GPU samples inside the row's span"
echo "$out" | grep -q "streamed/int4 N=8: no started_unix_s / ended_unix_s in the row"
echo "100.0,1980,2619" >"$TEST_TMPDIR/bad.csv"
if /usr/bin/python3 "$tool" join "$TEST_TMPDIR/bad.csv" "$TEST_TMPDIR/rows.jsonl" 2>"$TEST_TMPDIR/err.txt"; then
  echo "a short sample line was accepted" >&2; exit 1
fi
grep -q "bad.csv:1: expected 6 fields" "$TEST_TMPDIR/err.txt"
echo "ok"
