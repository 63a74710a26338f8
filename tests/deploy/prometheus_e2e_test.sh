#!/usr/bin/env bash
# Bazel sh_test wrapper: runs prometheus_e2e_test.py under Debian's Python with the generated stubs.
set -euo pipefail
here=$(pwd)
export STOWAGE_SERVER_BIN="$here/server/stowage_server"
export STOWAGE_DASHBOARD="$here/deploy/grafana/stowage-dashboard.json"
export STOWAGE_ALERTS="$here/deploy/prometheus/alerts.yml"
export STOWAGE_ADAPTER_CONFIG="$here/deploy/kubernetes/prometheus-adapter.yaml"
export STOWAGE_HPA="$here/deploy/kubernetes/autoscaling.yaml"
export PYTHONPATH="$here/proto:$here/clients/python"
export PYTHONDONTWRITEBYTECODE=1 no_proxy=127.0.0.1,localhost no_grpc_proxy=127.0.0.1,localhost
exec /usr/bin/python3 "$here/tests/deploy/prometheus_e2e_test.py" -v
