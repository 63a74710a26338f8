#!/usr/bin/env bash
# Bazel sh_test wrapper: runs tls_e2e_test.py under Debian's Python with the generated stubs.
set -euo pipefail
here=$(pwd)
export STOWAGE_SERVER_BIN="$here/server/stowage_server"
export STOWCTL_BIN="$here/clients/stowctl/stowctl"
export STOWAGE_K8S_MANIFEST="$here/deploy/kubernetes/stowage.yaml"
export PYTHONPATH="$here/proto:$here/clients/python"
export PYTHONDONTWRITEBYTECODE=1 no_proxy=127.0.0.1,localhost no_grpc_proxy=127.0.0.1,localhost
exec /usr/bin/python3 "$here/tests/e2e/tls_e2e_test.py" -v
