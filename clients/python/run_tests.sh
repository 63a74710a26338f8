#!/usr/bin/env bash
# Runs the Python client's unit tests against generated gRPC stubs.
#
# Usage: run_tests.sh STUBS_DIR   (or STOWAGE_PY_STUBS=STUBS_DIR run_tests.sh)
# STUBS_DIR holds the stubs of stowage/v1/{generation,admin,config}.proto (generation_pb2.py,
# generation_pb2_grpc.py, admin_pb2.py, ...): Bazel's bazel-bin/proto (via an sh_test argument) or
# a protoc --python_out directory. Paths are resolved
# relative to this script so it works from any directory, including a Bazel runfiles tree.
set -euo pipefail

script_dir="$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"
stubs="${1:-${STOWAGE_PY_STUBS:-}}"
if [[ -z "${stubs}" ]]; then
  echo "usage: $0 STUBS_DIR (or set STOWAGE_PY_STUBS)" >&2
  exit 2
fi
stubs="$(readlink -f "${stubs}")"
for stub in generation_pb2 generation_pb2_grpc admin_pb2 admin_pb2_grpc config_pb2; do
  if [[ ! -f "${stubs}/stowage/v1/${stub}.py" ]]; then
    echo "$0: no stowage/v1/${stub}.py under ${stubs} (generate all of proto/stowage/v1/*.proto)" >&2
    exit 2
  fi
done

export PYTHONPATH="${stubs}:${script_dir}"
# Keep __pycache__ out of the source tree (and out of read-only Bazel sandboxes).
export PYTHONDONTWRITEBYTECODE=1
# The tests talk to 127.0.0.1; an inherited proxy setting must not reroute them.
export no_grpc_proxy="127.0.0.1,localhost"
exec /usr/bin/python3 -m unittest discover -s "${script_dir}/tests" -v
