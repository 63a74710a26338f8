#!/usr/bin/env bash
# deploy/gpu_host/detached.sh: a job outlives the shell that started it, `wait` reports it running
# (exit 3) and then its own exit status, and copies what it wrote into $OUT each time.
set -euo pipefail
script=$(readlink -f "${TEST_SRCDIR:-.}/${TEST_WORKSPACE:-_main}/deploy/gpu_host/detached.sh" 2>/dev/null || true)
[ -f "$script" ] || script=$(readlink -f "$(dirname "$0")/../../deploy/gpu_host/detached.sh")
tmp=${TEST_TMPDIR:-$(mktemp -d)}
export STOWAGE_DETACHED_ROOT=$tmp/root
fail() { echo "FAIL: $*" >&2; exit 1; }

# The job writes a first result, waits for a go file, writes a second and exits 7.
go=$tmp/go
bash -c "\"$script\" start job1 bash -c 'echo first >\"\$OUT/a.txt\"; while [ ! -f $go ]; do sleep 0.2; done; echo second >\"\$OUT/b.txt\"; echo done; exit 7'" \
  || fail "start failed"
# The starting shell has returned; the job runs on.
set +e
OUT=$tmp/out1 "$script" wait job1 1; rc=$?
set -e
[ "$rc" -eq 3 ] || fail "wait on a running job: exit $rc, want 3"
for _ in $(seq 50); do [ -f "$tmp/out1/a.txt" ] && break; OUT=$tmp/out1 "$script" wait job1 0 >/dev/null || true; done
[ "$(cat "$tmp/out1/a.txt")" = first ] || fail "the running job's first result was not copied"
[ ! -f "$tmp/out1/b.txt" ] || fail "b.txt before the go"

# A second job of the same name is refused while the first runs.
if "$script" start job1 true 2>"$tmp/err"; then fail "a second start of a running job succeeded"; fi
grep -q "still running" "$tmp/err" || fail "refusal does not say why: $(cat "$tmp/err")"

# A call's deadline ends a longer wait early (still running: 3); a malformed one is refused.
start=$(date +%s)
set +e
STOWAGE_CALL_DEADLINE=$((start + 1)) OUT=$tmp/out1 "$script" wait job1 60 >/dev/null; rc=$?
set -e
[ "$rc" -eq 3 ] || fail "wait past the call's deadline: exit $rc, want 3"
[ $(($(date +%s) - start)) -lt 20 ] || fail "the wait ran past the call's deadline"
set +e
STOWAGE_CALL_DEADLINE=soon "$script" wait job1 1 2>"$tmp/err"; rc=$?
set -e
[ "$rc" -eq 2 ] || fail "a malformed deadline: exit $rc, want 2"
grep -q "STOWAGE_CALL_DEADLINE" "$tmp/err" || fail "the refusal does not name the variable: $(cat "$tmp/err")"

touch "$go"
set +e
OUT=$tmp/out2 "$script" wait job1 30; rc=$?
set -e
[ "$rc" -eq 7 ] || fail "wait on the ended job: exit $rc, want the job's 7"
[ "$(cat "$tmp/out2/b.txt")" = second ] || fail "the ended job's result was not copied"
grep -qx done "$tmp/out2/detached_job1.log" || fail "the job's log was not copied"

# Once ended, the name can start again; unknown names and bad arguments are refused.
"$script" start job1 true >/dev/null || fail "restart after the end was refused"
OUT=$tmp/out3 "$script" wait job1 30 || fail "a job that exits 0 did not give 0"
set +e
"$script" wait nosuch 1 2>/dev/null; rc=$?
[ "$rc" -eq 2 ] || fail "wait on an unknown job: exit $rc, want 2"
"$script" start 'bad/name' true 2>/dev/null; rc=$?
[ "$rc" -eq 2 ] || fail "a name with a slash: exit $rc, want 2"
"$script" wait job1 soon 2>/dev/null; rc=$?
[ "$rc" -eq 2 ] || fail "a non-numeric wait: exit $rc, want 2"
set -e
echo PASS
