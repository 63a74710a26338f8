#!/usr/bin/env bash
# Runs a test (the arguments) with the suppression files of tests/sanitizers/ added to the
# sanitizers' options as absolute paths, so that processes the test starts (a server binary) find
# them whatever their working directory. Used as --run_under by --config=asan and --config=tsan.
set -euo pipefail
runfiles="${TEST_SRCDIR:-${RUNFILES_DIR:-$0.runfiles}}"
dir="$(cd "$runfiles/stowage/tests/sanitizers" && pwd -P)"
add() {  # add VAR FILE: appends suppressions=FILE to $VAR (sanitizer options are ':'-separated).
  local current="${!1:-}"
  export "$1=${current:+$current:}suppressions=$dir/$2"
}
add ASAN_OPTIONS asan.supp
add LSAN_OPTIONS lsan.supp
add UBSAN_OPTIONS ubsan.supp
add TSAN_OPTIONS tsan.supp
exec "$@"
