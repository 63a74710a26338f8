#!/usr/bin/env bash
# The stowage_server process: ports already in use, --config that is not a file, an out-of-range
# option, and SIGTERM ending the process within its bound during a start-up load that never
# finishes and during a long request.
set -uo pipefail
here=$(pwd)
server="$here/server/stowage_server"
stowctl="$here/clients/stowctl/stowctl"
# A folder of its own, emptied first: a re-run (ctest --rerun-failed) would find the last run's
# files, and a stale port file would let wait_ports return before the new server is up.
tmp="$TEST_TMPDIR/server_process"
rm -rf "$tmp" && mkdir -p "$tmp"
fail() { echo "FAIL: $*"; for f in "$tmp"/*.log; do echo "== $f"; cat "$f"; done; exit 1; }
now_ms() { echo $(( $(date +%s%N) / 1000000 )); }
wait_ports() {  # $1: port file, $2: pid
  for _ in $(seq 600); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
field() { /usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])" "$1" "$2"; }

# 00. Usage: --help lists the server's own flags and exits 0 (absl's filter printed "No flags
#     matched."); a malformed or unknown flag and a config naming a missing model_dir are bad usage
#     (status 2, as the README says), and so is a malformed stowctl flag.
"$server" --help >"$tmp/help.log" 2>&1
rc=$?
[ $rc -eq 0 ] || fail "--help: rc=$rc"
grep -q -- "--config" "$tmp/help.log" && grep -q -- "--grpc_address" "$tmp/help.log" || fail "--help does not list the flags"
! grep -q "No flags matched" "$tmp/help.log" || fail "--help matched no flags"
"$server" --grpc_address=127.0.0.1:0 --no_such_flag=1 >"$tmp/bad_flag.log" 2>&1
rc=$?; [ $rc -eq 2 ] || fail "unknown flag: rc=$rc"
printf 'pipelines { name: "a" model_dir: "/nonexistent/model" }\n' >"$tmp/missing_dir.textproto"
"$server" --config="$tmp/missing_dir.textproto" --grpc_address=127.0.0.1:0 --metrics_address=none \
  >"$tmp/missing_dir.log" 2>&1
rc=$?; [ $rc -eq 2 ] || fail "missing model_dir: rc=$rc"
grep -q "pipelines\[0\].model_dir: '/nonexistent/model' does not exist" "$tmp/missing_dir.log" || fail "missing model_dir message"
"$stowctl" generate --prompt=x --steps=abc >"$tmp/stowctl_bad.log" 2>&1
rc=$?; [ $rc -eq 2 ] || fail "stowctl --steps=abc: rc=$rc"
"$stowctl" generate --prompt=x --format=jpeg >"$tmp/stowctl_format.log" 2>&1
rc=$?; [ $rc -eq 2 ] && grep -q "not one of png, png_fast, rgb" "$tmp/stowctl_format.log" || fail "stowctl --format=jpeg: rc=$rc"
"$stowctl" --help >"$tmp/stowctl_help.log" 2>&1
rc=$?; [ $rc -eq 0 ] && grep -q -- "--prompt" "$tmp/stowctl_help.log" || fail "stowctl --help: rc=$rc"

# A first server, on ports chosen by the kernel.
"$server" --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 --port_file="$tmp/first.json" \
  >"$tmp/first.log" 2>&1 &
first=$!
trap 'kill -9 $first 2>/dev/null || true' EXIT
wait_ports "$tmp/first.json" $first || fail "first server did not start"
grpc=$(field "$tmp/first.json" grpc_address)
metrics=$(field "$tmp/first.json" metrics_address)

# 0. Started without CUDA_MODULE_LOADING, the server runs itself again with EAGER (same process id),
#    so a CUDA device loads every kernel module at start instead of during the first request.
tr '\0' '\n' </proc/$first/environ | grep -qx "CUDA_MODULE_LOADING=EAGER" ||
  fail "the server's environment lacks CUDA_MODULE_LOADING=EAGER"

# 0b. The operator's log: a line as each start-up load begins and ends, and one per request (with
#     its id, pipeline, outcome, queue wait, run time and peaks), each with a timestamp and a level.
"$stowctl" --target="$grpc" generate --prompt="log line" --width=64 --height=64 --steps=2 \
  --out="$tmp/logged.png" >"$tmp/logged.log" 2>&1 || fail "generate for the log: $(cat "$tmp/logged.log")"
stamp='^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}\.[0-9]{3}[+-][0-9]{2}:[0-9]{2} [IWE] '
for pattern in "load pipeline=zimage-tiny device=[a-z]+:0 builtin=zimage-tiny .* phase=begin" \
    "load pipeline=zimage-tiny device=[a-z]+:0 phase=ready seconds=[0-9.]+ components=4 weight_bytes=[0-9]+" \
    "request id=[^ ]+ pipeline=shapes tenant=default priority=0 status=OK seconds=[0-9.]+ device=[a-z]+:0 size=64x64 steps=2 .*queue_wait_s=[0-9.]+ run_s=[0-9.]+ peak_device_bytes=[0-9]+ .*h2d_bytes=[0-9]+ batch_size=1 allocator_retries=[0-9]+ allocator_ooms=[0-9]+ stages=[a-z_:0-9.,]*denoise:[0-9.]+[a-z_:0-9.,]*$"; do
  grep -Eq "${stamp}${pattern}" "$tmp/first.log" || fail "no log line matching: $pattern ($(grep -E 'load|request' "$tmp/first.log" | head -5))"
done

# 1. A second server on the same gRPC port must not start (gRPC's SO_REUSEPORT would let it share).
timeout 120 "$server" --grpc_address="$grpc" --metrics_address=none >"$tmp/second_grpc.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "second server on $grpc: rc=$rc"
grep -q "grpc_address: cannot listen on $grpc" "$tmp/second_grpc.log" || fail "no message naming $grpc"

# 1b. ... and says so before loading anything: a pipeline whose load takes seconds (random weights for
#     a ~600 M-parameter transformer; step 5 uses it too) must not delay the refusal.
mkdir -p "$tmp/slow_model/text_encoder" "$tmp/slow_model/transformer" "$tmp/slow_model/vae"
cat >"$tmp/slow_model/model_index.json" <<'JSON'
{"_class_name": "StowageTinyPipeline", "text_encoder": ["stowage", "TinyTextEncoder"],
 "transformer": ["stowage", "TinyDiT"], "vae": ["stowage", "TinyVaeDecoder"]}
JSON
cat >"$tmp/slow_model/text_encoder/config.json" <<'JSON'
{"_class_name": "TinyTextEncoder", "vocab_size": 259, "max_tokens": 64, "dim": 64, "heads": 4, "layers": 1}
JSON
cat >"$tmp/slow_model/transformer/config.json" <<'JSON'
{"_class_name": "TinyDiT", "in_channels": 4, "patch_size": 2, "dim": 2048, "heads": 16, "layers": 8,
 "text_dim": 64, "mlp_ratio": 4, "timestep_dim": 64}
JSON
cat >"$tmp/slow_model/vae/config.json" <<'JSON'
{"_class_name": "TinyVaeDecoder", "latent_channels": 4, "groups": 8, "block_out_channels": [32, 32],
 "scaling_factor": 1.0, "shift_factor": 0.0}
JSON
cat >"$tmp/slow_taken.textproto" <<CFG
grpc_address: "$grpc"
metrics_address: "none"
pipelines { name: "slow" model_dir: "$tmp/slow_model" random_weights: true }
CFG
timeout 120 "$server" --config="$tmp/slow_taken.textproto" >"$tmp/slow_taken.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "second server on $grpc with a slow pipeline: rc=$rc"
grep -q "grpc_address: cannot listen on $grpc" "$tmp/slow_taken.log" || fail "no early message naming $grpc"
# The refusal came from the probe before the load, not from gRPC after it: gRPC's own bind error
# ("No address added") is not in the log.
! grep -q "No address added" "$tmp/slow_taken.log" || fail "the port was found taken only after the load"

# 2. ... nor on the same metrics port.
timeout 120 "$server" --grpc_address=127.0.0.1:0 --metrics_address="$metrics" >"$tmp/second_metrics.log" 2>&1
rc=$?
[ $rc -ne 0 ] && [ $rc -ne 124 ] || fail "second server on metrics $metrics: rc=$rc"
grep -q "metrics_address: cannot listen on $metrics" "$tmp/second_metrics.log" || fail "no message naming $metrics"

# 3. --config that is a directory, or missing: refused naming the flag and the path.
"$server" --config="$tmp" >"$tmp/config_dir.log" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "--config=<directory>: rc=$rc"
grep -q -- "--config: cannot read '$tmp': it is a directory" "$tmp/config_dir.log" || fail "--config=<directory> message"
"$server" --config="$tmp/missing.textproto" >"$tmp/config_missing.log" 2>&1
[ $? -eq 2 ] || fail "--config=<missing>: rc"
grep -q -- "--config: cannot read '$tmp/missing.textproto': no such file" "$tmp/config_missing.log" || fail "missing message"

# 4. A prefetch depth of a million is refused at the door, naming the field path and the range.
cat >"$tmp/huge.textproto" <<'CFG'
grpc_address: "127.0.0.1:0"
metrics_address: "none"
pipelines { name: "p" builtin: "tiny" group_offload { enabled: true defaults { use_stream: true prefetch_depth: 1000000 } } }
CFG
"$server" --config="$tmp/huge.textproto" >"$tmp/huge.log" 2>&1
rc=$?
[ $rc -eq 2 ] || fail "prefetch_depth 1000000: rc=$rc"
grep -q "pipelines\[0\].group_offload.defaults.prefetch_depth: 1000000 is out of range; allowed: 0 (the engine's choice) or 1..64" \
  "$tmp/huge.log" || fail "prefetch_depth message"

# 5. SIGTERM during a start-up load: a legitimately slow one (random weights for a ~600 M-parameter
#    transformer: seconds of work on the CPU). The signal comes once the server says it is loading,
#    before the load could finish (the port file would say it had); the process ends at once. The
#    model directory is step 1b's.
cat >"$tmp/slow.textproto" <<CFG
grpc_address: "127.0.0.1:0"
metrics_address: "none"
pipelines { name: "slow" model_dir: "$tmp/slow_model" random_weights: true }
CFG
"$server" --config="$tmp/slow.textproto" --port_file="$tmp/slow.ports" >"$tmp/slow.log" 2>&1 &
slow=$!
for _ in $(seq 100); do grep -q "starting: loading" "$tmp/slow.log" && break; sleep 0.1; done
kill -0 $slow 2>/dev/null || fail "the slow load ended by itself: $(cat "$tmp/slow.log")"
[ ! -e "$tmp/slow.ports" ] || fail "the slow load finished before the signal; make it slower"
start=$(now_ms)
kill -TERM $slow
wait $slow
rc=$?
elapsed=$(( $(now_ms) - start ))
[ $rc -eq 143 ] || fail "SIGTERM during start-up: rc=$rc ($(cat "$tmp/slow.log"))"
[ $elapsed -lt 3000 ] || fail "SIGTERM during start-up took ${elapsed} ms"
grep -q "SIGTERM during start-up; exiting without serving" "$tmp/slow.log" || fail "start-up signal message"

# 6. SIGTERM while requests run (long ones on the CPU; a fast device may have finished them):
#    stopped within the 10 s bound, cleanly or by the watchdog. A request is running at the signal
#    when the server has not logged it yet (the log line is written before the reply is sent); one
#    logged between that look and the signal may still succeed, and only one logged before it.
clients=()
for i in 1 2 3 4; do
  "$stowctl" --target="$grpc" generate --prompt="slow $i" --width=1024 --height=1024 --steps=100 \
    --request_id="slow-$i" --out="$tmp/never_$i.png" >"$tmp/client_$i.log" 2>&1 &
  clients+=($!)
done
sleep 3
running=()
for i in 1 2 3 4; do grep -q " request id=slow-$i " "$tmp/first.log" || running+=("$i"); done
start=$(now_ms)
kill -TERM $first
wait $first
rc=$?
elapsed=$(( $(now_ms) - start ))
[ $rc -eq 0 ] || [ $rc -eq 3 ] || fail "SIGTERM while serving: rc=$rc"
[ $elapsed -lt 12000 ] || fail "SIGTERM while serving took ${elapsed} ms"
grep -q "SIGTERM: shutting down" "$tmp/first.log" || fail "shutdown message"
[ $rc -eq 0 ] || grep -q "did not finish stopping within 10s; exiting" "$tmp/first.log" || fail "watchdog message"
logged_ms() {  # $1: request id; the time its OK line was logged, in ms (empty: none)
  local line
  line=$(grep -m1 " request id=$1 .*status=OK" "$tmp/first.log") || return 0
  date -d "${line%% *}" +%s%3N
}
for i in "${running[@]}"; do
  if wait "${clients[$((i - 1))]}"; then
    at=$(logged_ms "slow-$i")
    [ -n "$at" ] && [ "$at" -le "$start" ] || fail "request slow-$i was running at the signal and succeeded (logged at ${at:-never}, signal at $start)"
  fi
done
for c in "${clients[@]}"; do wait "$c" 2>/dev/null; done
trap - EXIT
echo "PASS (stopped in ${elapsed} ms with ${#running[@]} requests running, rc=$rc)"
