#!/usr/bin/env bash
# Runs the Python client's unit tests against generated gRPC stubs.
#
# Usage: run_tests.sh STUBS_DIR   (or STOWAGE_PY_STUBS=STUBS_DIR run_tests.sh)
# STUBS_DIR holds stowage/v1/generation_pb2.py and generation_pb2_grpc.py: Bazel's
# bazel-bin/proto (via an sh_test argument) or a protoc --python_out directory. Paths are resolved
# relative to this script so it works from any directory, including a Bazel runfiles tree.
set -euo pipefail

script_dir="$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")"
stubs="${1:-${STOWAGE_PY_STUBS:-}}"
if [[ -z "${stubs}" ]]; then
  echo "usage: $0 STUBS_DIR (or set STOWAGE_PY_STUBS)" >&2
  exit 2
fi
stubs="$(readlink -f "${stubs}")"
if [[ ! -f "${stubs}/stowage/v1/generation_pb2.py" || ! -f "${stubs}/stowage/v1/generation_pb2_grpc.py" ]]; then
  echo "$0: no stowage/v1/generation_pb2{,_grpc}.py under ${stubs}" >&2
  exit 2
fi

export PYTHONPATH="${stubs}:${script_dir}"
# Keep __pycache__ out of the source tree (and out of read-only Bazel sandboxes).
export PYTHONDONTWRITEBYTECODE=1
# The tests talk to 127.0.0.1; an inherited proxy setting must not reroute them.
export no_grpc_proxy="127.0.0.1,localhost"
exec /usr/bin/python3 -m unittest discover -s "${script_dir}/tests" -v
