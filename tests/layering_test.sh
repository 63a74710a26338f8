#!/usr/bin/env bash
# Bazel wrapper: the layering check reads the real source tree, found through the CMakeLists.txt
# symlink in the runfiles.
set -euo pipefail
export STOWAGE_SRC_ROOT="$(dirname "$(readlink -f CMakeLists.txt)")"
exec /usr/bin/python3 "$STOWAGE_SRC_ROOT/tests/layering_test.py" -v
