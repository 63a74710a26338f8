#!/usr/bin/env bash
# The Python client as a package, from a fresh virtualenv: `pip install` of a copy of clients/python
# (pyproject.toml; its build generates the gRPC stubs from proto/stowage/v1 with protoc), offline
# (Debian's grpcio, protobuf and setuptools through --system-site-packages), then a script run by
# the virtualenv's Python (outside the source tree, so every import is the installed package's)
# against real servers on loopback: generation with scheduling fields, a stream with previews,
# every admin call (device-scoped calls on a server with two devices, drain and resume, moving a
# component, batching, loading and unloading pipelines and adapters, the placement log), and a
# TLS server reached with a CA of the test's own. Run by Bazel from the runfiles root.
set -euo pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/e2e_lib.sh"
here=$(pwd)
server_bin="$here/server/stowage_server"
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/python_package.XXXXXX")
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
for tool in protoc grpc_python_plugin openssl; do
  command -v "$tool" >/dev/null || { echo "FAILED: $tool not found (./stowage setup installs it)"; exit 1; }
done

# A copy of the sources (Bazel's runfiles are links into the tree; the build writes next to them).
mkdir -p "$work/src/clients" "$work/src/proto"
cp -rL "$here/clients/python" "$work/src/clients/python"
cp -rL "$here/proto/stowage" "$work/src/proto/stowage"
/usr/bin/python3 -m venv --system-site-packages "$work/venv"
if ! "$work/venv/bin/pip" install --no-build-isolation --no-index --quiet "$work/src/clients/python" \
    >"$work/pip.log" 2>&1; then
  cat "$work/pip.log"; echo "FAILED: pip install ./clients/python"; exit 1
fi
"$work/venv/bin/stowage-client" --help >/dev/null || { echo "FAILED: the stowage-client script"; exit 1; }

# start NAME CONFIG: a server in the background; its port file is $work/NAME.json.
start() {
  "$server_bin" --config="$2" --grpc_address=127.0.0.1:0 --metrics_address=none \
    --port_file="$work/$1.json" >"$work/$1.log" 2>&1 &
  pids+=($!)
  wait_for_port_file "${pids[-1]}" "$work/$1.json" "$work/$1.log"
}
cat >"$work/plain.textproto" <<'CONFIG'
auth { admin_token: "package-test-token" }
devices { kind: KIND_SIMULATED index: 0 }
devices { kind: KIND_SIMULATED index: 1 }
pipelines { name: "a" builtin: "zimage-tiny" devices: "sim:0" devices: "sim:1" default: true }
pipelines { name: "b" builtin: "tiny" devices: "sim:1" }
CONFIG
start plain "$work/plain.textproto"
make_test_certificates "$work" "DNS:stowage"
printf 'tls { cert_file: "%s" key_file: "%s" }\n' "$work/server.crt" "$work/server.key" >"$work/tls.textproto"
start tls "$work/tls.textproto"

cd "$work"
env -u PYTHONPATH PYTHONDONTWRITEBYTECODE=1 no_grpc_proxy=127.0.0.1,localhost "$work/venv/bin/python" - \
    "$work/plain.json" "$work/tls.json" "$work/ca.crt" "$work/venv" <<'PY'
import json, sys
import stowage_client
from stowage_client import AdminClient, PartialImage, ProgressEvent, GenerationResult, StowageClient, StowageError

plain = json.load(open(sys.argv[1]))["grpc_address"]
tls = json.load(open(sys.argv[2]))["grpc_address"]
ca = open(sys.argv[3], "rb").read()
failures = []
def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)

check(stowage_client.__file__.startswith(sys.argv[4]), f"imported from the virtualenv: {stowage_client.__file__}")
with StowageClient(plain, timeout=60) as client:
    r = client.generate("a small red square", width=64, height=64, steps=2, seed=5, priority=3, tenant="t1")
    check(r.image.startswith(b"\x89PNG") and r.seed == 5, "generate with priority and tenant")
    items = list(client.stream("a small red square", width=64, height=64, steps=6, seed=5, partial_images=2))
    previews = [i for i in items if isinstance(i, PartialImage)]
    check([p.step for p in previews] == [2, 4] and all(p.image.startswith(b"\x89PNG") for p in previews),
          f"stream previews at steps {[p.step for p in previews]}")
    check(isinstance(items[-1], GenerationResult) and any(isinstance(i, ProgressEvent) for i in items),
          "stream progress then the result")
    try:
        client.generate("x", width=64, height=64, steps=1, loras={"nope": 1.0})
        check(False, "an unknown adapter is refused")
    except StowageError as e:
        check(e.code.name == "INVALID_ARGUMENT" and "has no adapter" in e.message, f"unknown adapter: {e.message}")

with AdminClient(plain, token="package-test-token", timeout=60, device="sim:1") as admin:
    check(admin.get_placement().device == "sim:1", "device-scoped get_placement (sim:1)")
    statuses = admin.drain_device("sim:1")
    check({s.device: s.draining for s in statuses} == {"sim:0": False, "sim:1": True}, "drain_device")
    check(not any(s.draining for s in admin.resume_device("sim:1")), "resume_device")
    moved = admin.move_component("b", "vae", "sim:0")
    check({c.name: c.device for c in moved.components}.get("vae") == "sim:0", "move_component b/vae to sim:0")
    check(admin.set_batching("a", 4, 10).max_batch_size == 4, "set_batching")
    check(admin.load_pipeline("extra", builtin="tiny").name == "extra", "load_pipeline")
    admin.unload_pipeline("extra")
    try:
        admin.load_adapter("a", "style", "/nonexistent/style.safetensors")
        check(False, "a missing adapter file is refused")
    except StowageError as e:
        check(e.code.name == "NOT_FOUND" and "style.safetensors" in e.message, f"load_adapter: {e.message}")
    try:
        admin.unload_adapter("a", "style")
        check(False, "unloading an adapter that is not there is refused")
    except StowageError as e:
        check(e.code.name == "NOT_FOUND", f"unload_adapter: {e.code.name}")
    check(isinstance(admin.placement_log(limit=5), list), "placement_log")

with StowageClient(tls, timeout=60, tls=True, root_certificates=ca, server_name="stowage") as client:
    r = client.generate("over tls", width=64, height=64, steps=1, seed=1)
    check(r.image.startswith(b"\x89PNG"), "generate over TLS with the test's CA")
print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
PY
echo PASS
