#!/usr/bin/env bash
# Bazel wrapper: the parity check reads the real source tree (every BUILD file and CMakeLists.txt),
# found through the CMakeLists.txt symlink in the runfiles.
set -euo pipefail
export STOWAGE_SRC_ROOT="$(dirname "$(readlink -f CMakeLists.txt)")"
exec /usr/bin/python3 "$STOWAGE_SRC_ROOT/tests/build_parity_test.py" -v
