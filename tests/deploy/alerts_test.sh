#!/usr/bin/env bash
# Bazel sh_test wrapper: promtool's checks and rule unit tests over deploy/prometheus.
set -euo pipefail
here=$(pwd)
export STOWAGE_PROMETHEUS_DIR="$here/deploy/prometheus"
export STOWAGE_MONITORING_MANIFEST="$here/deploy/kubernetes/monitoring.yaml"
export PYTHONDONTWRITEBYTECODE=1
exec /usr/bin/python3 "$here/tests/deploy/alerts_test.py" -v
