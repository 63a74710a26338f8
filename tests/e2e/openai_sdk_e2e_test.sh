#!/usr/bin/env bash
# The official OpenAI SDK (npm's `openai`, installed into this test's own folder) against a real
# stowage_server over loopback: client.images.generate returns PNGs, client.models.list the
# pipelines, and refused requests surface as the SDK's BadRequestError, NotFoundError,
# AuthenticationError and RateLimitError (tests/e2e/openai_sdk_e2e_test.mjs); then the same over
# HTTPS (tls {} set, a CA made here with openssl; curl checks an untrusted CA is refused). Needs Node.js with
# npm (./stowage setup installs Debian's) and the npm registry. Run by Bazel from the runfiles root
# (server/stowage_server, tests/e2e/*.mjs) or from a CMake build directory with the same layout.
set -euo pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/e2e_lib.sh"
here=$(pwd)
server_bin="$here/server/stowage_server"
script="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/openai_sdk_e2e_test.mjs"
# The SDK version is pinned so that a new release cannot change what this test checks. 5.x needs no
# dependencies and runs on Debian 12's Node.js 18 as well as newer ones (6.x/7.x want Node >= 20/22).
sdk_version="${STOWAGE_OPENAI_SDK_VERSION:-5.23.2}"

work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/openai_sdk.XXXXXX")
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then
    kill "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

command -v node >/dev/null || { echo "FAILED: node not found (./stowage setup installs nodejs and npm)"; exit 1; }
command -v npm >/dev/null || { echo "FAILED: npm not found (./stowage setup installs nodejs and npm)"; exit 1; }

# Node.js trusts its own CA list; where the registry is reached through an interception proxy whose
# CA the system trusts, npm needs the system's bundle too (as Debian's own Node.js build uses it).
if [ -z "${NODE_EXTRA_CA_CERTS:-}" ] && [ -r /etc/ssl/certs/ca-certificates.crt ]; then
  export NODE_EXTRA_CA_CERTS=/etc/ssl/certs/ca-certificates.crt
fi
# The SDK goes into the test's own folder, with npm's cache and config there too: nothing outside
# $work is read or written.
mkdir -p "$work/sdk" "$work/home"
echo '{"name": "stowage-openai-sdk-e2e", "private": true}' >"$work/sdk/package.json"
if ! HOME="$work/home" npm_config_cache="$work/npm-cache" npm_config_userconfig="$work/npmrc" \
    timeout 120 npm install --prefix "$work/sdk" --no-audit --no-fund --no-package-lock --loglevel=error \
    "openai@${sdk_version}" >"$work/npm.log" 2>&1; then
  cat "$work/npm.log"
  echo "FAILED: npm install openai@${sdk_version}"
  exit 1
fi

# One server: the fast built-in pipeline for generation, and a "tiny" pipeline streamed on a slow
# simulated device with a queue of one for the 429 (tests/e2e/adversarial_e2e_test.cc LifecycleTest).
cat >"$work/config.textproto" <<'CONFIG'
queue_depth: 1
device { kind: KIND_SIMULATED simulated_bandwidth_bytes_per_second: 56000000 }
pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true }
pipelines {
  name: "tiny" builtin: "tiny"
  group_offload { enabled: true exclude: "text_encoder" exclude: "vae" defaults { use_stream: true } }
}
CONFIG
api_key="sk-stowage-e2e-$$"

# start_server CONFIG LOG: starts stowage_server in the background; sets server_pid, http_address.
start_server() {
  rm -f "$work/ports.json"
  STOWAGE_API_KEY="$api_key" "$server_bin" --config="$1" --grpc_address=127.0.0.1:0 \
    --metrics_address=none --http_address=127.0.0.1:0 --port_file="$work/ports.json" >"$2" 2>&1 &
  server_pid=$!
  wait_for_port_file "$server_pid" "$work/ports.json" "$2"
  http_address=$(json_field "$work/ports.json" http_address)
}
# stop_server LOG: SIGTERM; the server must exit 0.
stop_server() {
  kill -TERM "$server_pid"
  local server_rc=0
  wait "$server_pid" || server_rc=$?
  server_pid=""
  if [ "$server_rc" -ne 0 ]; then
    cat "$1"
    echo "FAILED: server exited with status $server_rc after SIGTERM"
    rc=1
  fi
}

rc=0
start_server "$work/config.textproto" "$work/server.log"
NODE_PATH="$work/sdk/node_modules" STOWAGE_BASE_URL="http://$http_address/v1" STOWAGE_API_KEY="$api_key" \
  no_proxy=127.0.0.1,localhost NO_PROXY=127.0.0.1,localhost \
  timeout 60 node "$script" "$work/sdk" || rc=$?
# The server survived all of it and stops cleanly.
stop_server "$work/server.log"

# HTTPS: the same server with tls {} set serves its HTTP API over TLS with the gRPC port's
# certificate, here from a CA made for this test (the SDK trusts it through NODE_EXTRA_CA_CERTS).
make_test_certificates "$work/tls" "DNS:localhost,IP:127.0.0.1"
{ cat "$work/config.textproto"; printf 'tls { cert_file: "%s" key_file: "%s" }\n' "$work/tls/server.crt" "$work/tls/server.key"; } \
  >"$work/tls.textproto"
start_server "$work/tls.textproto" "$work/server_tls.log"
# Without the CA a client refuses the server; with it, it is served; plain HTTP gets no answer.
if curl -sS --max-time 10 -o /dev/null "https://$http_address/health" 2>"$work/curl.log"; then
  echo "FAIL curl trusted a certificate of an unknown CA"; rc=1
else
  echo "ok   curl without the CA refuses the server's certificate ($(head -n 1 "$work/curl.log" | cut -c1-100))"
fi
health=$(curl -sS --max-time 10 --cacert "$work/tls/ca.crt" "https://$http_address/health" || true)
case "$health" in
  *serving*) echo "ok   curl with the CA: GET /health over HTTPS";;
  *) echo "FAIL GET /health over HTTPS: '$health'"; rc=1;;
esac
cat "$work/tls/ca.crt" >"$work/ca-bundle.crt"
if [ -r /etc/ssl/certs/ca-certificates.crt ]; then cat /etc/ssl/certs/ca-certificates.crt >>"$work/ca-bundle.crt"; fi
NODE_PATH="$work/sdk/node_modules" STOWAGE_BASE_URL="https://$http_address/v1" STOWAGE_API_KEY="$api_key" \
  STOWAGE_MODE=tls NODE_EXTRA_CA_CERTS="$work/ca-bundle.crt" no_proxy=127.0.0.1,localhost NO_PROXY=127.0.0.1,localhost \
  timeout 60 node "$script" "$work/sdk" || rc=$?
stop_server "$work/server_tls.log"
exit "$rc"
