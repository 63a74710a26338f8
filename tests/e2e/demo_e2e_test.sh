#!/usr/bin/env bash
# Bazel sh_test wrapper: runs demo_e2e_test.py under Debian's Python with the generated stubs.
set -euo pipefail
here=$(pwd)
export STOWAGE_SERVER_BIN="$here/server/stowage_server"
export STOWAGE_DEMO_PY="$here/models/demo"
export PYTHONPATH="$here/proto:$here/clients/python"
export PYTHONDONTWRITEBYTECODE=1 no_proxy=127.0.0.1,localhost no_grpc_proxy=127.0.0.1,localhost
exec /usr/bin/python3 "$here/tests/e2e/demo_e2e_test.py" -v
