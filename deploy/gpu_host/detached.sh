#!/usr/bin/env bash
# A job longer than one device call (10 minutes at most), in one process on one warm machine: the
# job runs in its own process session, which the device keeps running after the call that started
# it returns (until the machine goes back: make the next call at once, the machine is released
# after ~30 s idle), and the next calls wait on it.
#   deploy/gpu_host/detached.sh start NAME COMMAND [ARGS...]
#       runs COMMAND in a new session with OUT=$root/NAME/out (its results), its output in
#       $root/NAME/log; refuses when a job NAME is still running
#   deploy/gpu_host/detached.sh wait NAME SECONDS
#       waits until job NAME ends or SECONDS pass, then copies its out/ and log into $OUT (what the job
#       wrote so far, every time); exit status: the job's own when it ended, 3 while it still runs,
#       2 when there is no job NAME. With STOWAGE_CALL_DEADLINE (seconds since the epoch) it stops
#       waiting by then at the latest: a call that begins with
#       `export STOWAGE_CALL_DEADLINE=$(( $(date +%s) + 570 ))` gets its results back before the
#       device's 600 s limit whatever ran before the wait (multi-tenant run 14's first call counted its
#       wait from after the build and lost its tail to the limit).
# $root: $STOWAGE_DETACHED_ROOT, default /tmp/stowage-detached.
# A device call that runs a multi-tenant trace of ~900 s:
#   call 1: deploy/gpu_host/unpack_and_run.sh bash -c 'deploy/gpu_host/detached.sh start multi env PARTS=multi
#           MULTI_TIMEOUT=1100 MULTI_ARGS="..." bash deploy/gpu_host/run_compute_suite.sh;
#           deploy/gpu_host/detached.sh wait multi 550'
#   call 2: deploy/gpu_host/unpack_and_run.sh deploy/gpu_host/detached.sh wait multi 550
set -uo pipefail
root=${STOWAGE_DETACHED_ROOT:-/tmp/stowage-detached}

usage() {
  echo "usage: $0 start NAME COMMAND [ARGS...] | wait NAME SECONDS" >&2
  exit 2
}
valid_name() { [[ $1 =~ ^[A-Za-z0-9_.-]+$ ]] || { echo "$0: job name '$1' must be letters, digits, _ . -" >&2; exit 2; }; }
running() { [ -f "$root/$1/pid" ] && [ ! -f "$root/$1/rc" ]; }

[ $# -ge 2 ] || usage
cmd=$1 name=$2
valid_name "$name"
dir=$root/$name
case $cmd in
  start)
    [ $# -ge 3 ] || usage
    shift 2
    if running "$name"; then
      echo "$0: job '$name' is still running (pid $(cat "$dir/pid")); wait for it first" >&2
      exit 1
    fi
    rm -rf "$dir" && mkdir -p "$dir/out"
    # setsid: a new session, so the call's end does not end the job; the job records its own exit status.
    OUT="$dir/out" setsid bash -c '"$@" >"$0/log" 2>&1; echo $? >"$0/rc.tmp"; mv "$0/rc.tmp" "$0/rc"' \
      "$dir" "$@" </dev/null >/dev/null 2>&1 &
    echo $! >"$dir/pid"
    echo "job '$name' started (pid $!): $*"
    ;;
  wait)
    [ $# -eq 3 ] && [[ $3 =~ ^[0-9]+$ ]] || usage
    [ -f "$dir/pid" ] || { echo "$0: no job '$name' under $root" >&2; exit 2; }
    deadline=$(($(date +%s) + $3))
    if [ -n "${STOWAGE_CALL_DEADLINE:-}" ]; then
      [[ $STOWAGE_CALL_DEADLINE =~ ^[0-9]+$ ]] || {
        echo "$0: STOWAGE_CALL_DEADLINE must be seconds since the epoch, not '$STOWAGE_CALL_DEADLINE'" >&2; exit 2; }
      [ "$STOWAGE_CALL_DEADLINE" -lt "$deadline" ] && deadline=$STOWAGE_CALL_DEADLINE
    fi
    while running "$name" && [ "$(date +%s)" -lt "$deadline" ]; do sleep 2; done
    if [ -n "${OUT:-}" ]; then
      mkdir -p "$OUT"
      cp -r "$dir/out/." "$OUT/" 2>/dev/null
      cp "$dir/log" "$OUT/detached_$name.log" 2>/dev/null
    fi
    if running "$name"; then
      echo "job '$name' still running; wait again"
      exit 3
    fi
    rc=$(cat "$dir/rc")
    echo "job '$name' ended with exit status $rc"
    exit "$rc"
    ;;
  *) usage ;;
esac
