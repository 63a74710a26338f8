#!/usr/bin/env bash
# The placement page (GET /placement) in a real browser: Debian's chromium, headless, against a real
# stowage_server on loopback whose device has a budget, a context and one component streamed by
# group offloading. After one generation, the page's DOM (chromium --dump-dom, after its script
# ran) must hold every device and component with exactly the numbers GET /v1/placement gives (the
# admin GetPlacement of each device: http_e2e_test checks that equality), the bar's segments and the
# budget line; and a screenshot (chromium --screenshot) must show the bar's colours: resident
# (blue), context (grey), the budget line (red), and streamed (orange stripes) while a
# group-offloaded component holds device bytes. Run by Bazel from
# the runfiles root (server/stowage_server, clients/stowctl/stowctl).
set -euo pipefail
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/e2e_lib.sh"
here=$(pwd)
server_bin="$here/server/stowage_server"
stowctl="$here/clients/stowctl/stowctl"
browser=$(command -v chromium || command -v chromium-browser || true)
[ -n "$browser" ] || { echo "FAILED: chromium not found (./stowage setup installs Debian's chromium)"; exit 1; }
work=$(mktemp -d "${TEST_TMPDIR:-/tmp}/placement_page.XXXXXX")
server_pid=""
cleanup() {
  [ -n "$server_pid" ] && { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }
  rm -rf "$work"
}
trap cleanup EXIT

cat >"$work/config.textproto" <<'CONFIG'
device { kind: KIND_SIMULATED memory_budget_bytes: 8000000 simulated_context_bytes: 600000 }
pipelines {
  name: "zimage-tiny" builtin: "zimage-tiny" default: true
  group_offload { enabled: true exclude: "text_encoder" exclude: "vae" defaults { use_stream: true } }
}
CONFIG
"$server_bin" --config="$work/config.textproto" --grpc_address=127.0.0.1:0 --metrics_address=none \
  --http_address=127.0.0.1:0 --port_file="$work/ports.json" >"$work/server.log" 2>&1 &
server_pid=$!
wait_for_port_file "$server_pid" "$work/ports.json" "$work/server.log"
http=$(json_field "$work/ports.json" http_address)
grpc=$(json_field "$work/ports.json" grpc_address)
"$stowctl" --target="$grpc" generate --prompt="a red square" --width=64 --height=64 --steps=2 \
  --out="$work/one.png" >/dev/null || { cat "$work/server.log"; echo "FAILED: generate"; exit 1; }

curl -sf "http://$http/v1/placement" >"$work/placement.json" || { echo "FAILED: GET /v1/placement"; exit 1; }
# A profile of its own; no sandbox (tests may run as root); virtual time lets the script fetch and
# draw before the DOM is taken.
chrome() {
  timeout 90 "$browser" --headless --no-sandbox --disable-gpu --no-first-run --user-data-dir="$work/profile" \
    --virtual-time-budget=4000 --window-size=1200,700 "$@" "http://$http/placement" 2>"$work/chromium.log"
}
chrome --dump-dom >"$work/dom.html" || { cat "$work/chromium.log"; echo "FAILED: chromium --dump-dom"; exit 1; }
chrome --screenshot="$work/page.png" >/dev/null || { cat "$work/chromium.log"; echo "FAILED: chromium --screenshot"; exit 1; }

/usr/bin/python3 - "$work/placement.json" "$work/dom.html" "$work/page.png" <<'PY'
import json, sys
from html.parser import HTMLParser
from PIL import Image

placement = json.load(open(sys.argv[1]))
failures = []
def check(ok, what):
    print(("ok   " if ok else "FAIL ") + what)
    if not ok:
        failures.append(what)

class Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.elements = []
    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, dict(attrs)))
dom = Dom()
dom.feed(open(sys.argv[2]).read())
by = lambda key: [a for _, a in dom.elements if key in a]

check(any(a.get("data-ready") == "1" for t, a in dom.elements if t == "body"), "the page drew (body data-ready)")
for device in placement["devices"]:
    name = device["device"]
    sections = [a for a in by("data-device") if a["data-device"] == name]
    check(len(sections) == 1, f"device {name} drawn once")
    if not sections:
        continue
    s = sections[0]
    for key in ("budget_bytes", "context_bytes", "allocated_bytes"):
        check(s.get("data-" + key.replace("_", "-")) == str(device.get(key, "0")),
              f"{name} {key} {s.get('data-' + key.replace('_', '-'))} == GetPlacement's {device.get(key, '0')}")
    check(any(a.get("data-budget-line") == str(device["budget_bytes"]) for a in by("data-budget-line")),
          f"{name} budget line at {device['budget_bytes']}")
    rows = {a["data-id"]: a for a in by("data-id")}
    segments = {a["data-component"]: a for a in by("data-component")}
    streamed = 0
    for c in device["components"]:
        row = rows.get(c["id"])
        check(row is not None, f"component {c['id']} in the table")
        if row is None:
            continue
        for key in ("weight_bytes", "device_bytes"):
            check(row.get("data-" + key.replace("_", "-")) == str(c.get(key, "0")), f"{c['id']} {key} == {c.get(key, '0')}")
        check(row.get("data-state") == c.get("state", ""), f"{c['id']} state {c.get('state')}")
        check(row.get("data-lifecycle") == c.get("lifecycle", ""), f"{c['id']} lifecycle {c.get('lifecycle')}")
        if int(c.get("device_bytes", "0")) > 0:
            seg = segments.get(c["id"])
            check(seg is not None and seg.get("data-bytes") == str(c["device_bytes"]), f"{c['id']} bar segment of {c['device_bytes']} bytes")
        streamed += c.get("state") in ("GROUP_OFFLOADED", "PARTIALLY_RESIDENT")
    check(streamed >= 1, f"{name}: a group-offloaded component is drawn")

image = Image.open(sys.argv[3]).convert("RGB")
check(image.size == (1200, 700), f"screenshot size {image.size}")
colours = set(image.getdata())
near = lambda rgb: any(all(abs(p[i] - rgb[i]) <= 8 for i in range(3)) for p in colours)
expected = [("resident blue", (0x2f, 0x6f, 0xd6)), ("context grey", (0x7a, 0x7a, 0x7a)),
            ("budget red", (0xc0, 0x39, 0x2b))]
# A group-offloaded component shows (striped orange) while it holds device bytes: its working set.
if any(c.get("state") in ("GROUP_OFFLOADED", "PARTIALLY_RESIDENT") and int(c.get("device_bytes", "0")) > 0
       for d in placement["devices"] for c in d["components"]):
    expected.append(("streamed orange", (0xe0, 0x8a, 0x1e)))
for name, rgb in expected:
    check(near(rgb), f"the screenshot shows the {name}")
print(f"{len(failures)} failed")
sys.exit(1 if failures else 0)
PY
echo "PASS"
