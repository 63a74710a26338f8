#!/usr/bin/env bash
# bench/gpu_clocks.py join: nvidia-smi's samples (its own local timestamps) joined with rows by their
# Unix spans — means, minimum, maximum, the busy samples' SM clock, the power-capped share, throttle
# reasons OR'ed and named (GpuIdle left out, unknown bits in hex, "[N/A]" as unknown); a row without
# samples or without a span says so; a line that does not parse is skipped and counted; a file with no
# sample at all is refused.
set -euo pipefail
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
tool="$scripts/gpu_clocks.py"
# Local-time stamps of Unix times 1000000100..1000000102 and 1000000200, as nvidia-smi writes them.
stamp() { /usr/bin/python3 -c "import datetime,sys; print(datetime.datetime.fromtimestamp(float(sys.argv[1])).strftime('%Y/%m/%d %H:%M:%S.%f')[:-3])" "$1"; }
{
  echo "$(stamp 1000000100), 1980, 2619, 600.00, 60, 0x0000000000000001"
  echo "$(stamp 1000000101), 1800, 2619, 700.00, 65, 0x0000000000000004"
  echo "$(stamp 1000000102), 1700, 2619, [N/A], 70, 0x0000000000000200"
  echo "$(stamp 1000000102), 1700"
  echo "$(stamp 1000000200), 1980, 2619, 300.00, 40, [N/A]"
} >"$TEST_TMPDIR/samples.csv"
cat >"$TEST_TMPDIR/rows.jsonl" <<'JSON'
{"mode": "resident", "compress": "none", "max_batch_size": 8, "concurrency": 4, "started_unix_s": 1000000099.5, "ended_unix_s": 1000000102.5}
{"mode": "streamed", "compress": "int4", "max_batch_size": 8, "concurrency": 4, "started_unix_s": 1000000150.0, "ended_unix_s": 1000000160.0}
{"mode": "streamed", "compress": "int4", "max_batch_size": 8, "concurrency": 8, "started_unix_s": 1000000199.0, "ended_unix_s": 1000000201.0}
{"mode": "streamed", "compress": "int4", "max_batch_size": 1, "concurrency": 8}
JSON
out=$(/usr/bin/python3 "$tool" join "$TEST_TMPDIR/samples.csv" "$TEST_TMPDIR/rows.jsonl" 2>"$TEST_TMPDIR/warn.txt")
echo "$out"
cat "$TEST_TMPDIR/warn.txt"
echo "$out" | grep -qx "resident/none b=8 N=4: samples 3 sm_mhz_mean 1826.7 sm_mhz_min 1700.0 sm_mhz_busy_mean 1750.0 mem_mhz_mean 2619.0 power_w_mean 650.0 power_w_max 700.0 power_capped_share 0.33 temp_c_max 70.0 throttle SwPowerCap+0x200"
echo "$out" | grep -qx "streamed/int4 b=8 N=4: no GPU samples inside the row's span"
echo "$out" | grep -qx "streamed/int4 b=8 N=8: samples 1 sm_mhz_mean 1980.0 sm_mhz_min 1980.0 sm_mhz_busy_mean None mem_mhz_mean 2619.0 power_w_mean 300.0 power_w_max 300.0 power_capped_share None temp_c_max 40.0 throttle ?"
echo "$out" | grep -qx "streamed/int4 b=1 N=8: no started_unix_s / ended_unix_s in the row"
grep -q "samples.csv:4: 2 fields, not 6" "$TEST_TMPDIR/warn.txt"
# Idle only: no throttling named.
echo "$(stamp 1000000100), 1980, 2619, 100.00, 30, 0x0000000000000001" >"$TEST_TMPDIR/idle.csv"
/usr/bin/python3 "$tool" join "$TEST_TMPDIR/idle.csv" "$TEST_TMPDIR/rows.jsonl" | grep -q "resident/none b=8 N=4: .* throttle none$"
# Nothing parses: refused.
echo "garbage" >"$TEST_TMPDIR/bad.csv"
if /usr/bin/python3 "$tool" join "$TEST_TMPDIR/bad.csv" "$TEST_TMPDIR/rows.jsonl" 2>"$TEST_TMPDIR/err.txt"; then
  echo "a file without samples was accepted" >&2; exit 1
fi
grep -q "bad.csv: no sample parses (1 lines skipped)" "$TEST_TMPDIR/err.txt"
echo "ok"
