#!/usr/bin/env bash
# stowctl's admin commands against the real server over loopback: auth, placement, strategy,
# group offload, pipeline load/unload, decision log.
set -euo pipefail
here=$(pwd)
tmp="$TEST_TMPDIR"
cat >"$tmp/config.textproto" <<'CFG'
grpc_address: "127.0.0.1:0"
metrics_address: "none"
auth { admin_token_file: "TOKEN_FILE" }
CFG
echo "tok-$RANDOM" >"$tmp/token"
sed -i "s|TOKEN_FILE|$tmp/token|" "$tmp/config.textproto"
"$here/server/stowage_server" --config="$tmp/config.textproto" --port_file="$tmp/ports.json" >"$tmp/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true; wait $pid 2>/dev/null || true' EXIT
for _ in $(seq 600); do [ -s "$tmp/ports.json" ] && break; sleep 0.1; done
target=$(/usr/bin/python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['grpc_address'])" "$tmp/ports.json")
ctl() { "$here/clients/stowctl/stowctl" --target="$target" "$@"; }
fail() { echo "FAIL: $*"; cat "$tmp/server.log"; exit 1; }
# expect RC TEXT LABEL -- stowctl ARGS...: stowctl must exit RC and print TEXT (a grep pattern).
expect() {
  local want=$1 text=$2 label=$3 out rc
  shift 4
  set +e
  out=$(ctl "$@" 2>&1); rc=$?
  set -e
  [ "$rc" -eq "$want" ] && grep -q -- "$text" <<<"$out" || fail "$label: rc=$rc $out"
}

# Authentication.
expect 1 "UNAUTHENTICATED\|16" "no token" -- placement
expect 1 "wrong admin token" "wrong token" -- --token=wrong placement
export STOWAGE_TOKEN=$(cat "$tmp/token")

ctl generate --prompt=boat --width=64 --height=64 --steps=1 --seed=3 --out="$tmp/boat.png" >/dev/null
# Images in: the drawn boat as the input (image to image, then inpainting with the same image as its
# mask), and the usage errors stowctl catches itself (exit 2) or the server refuses (exit 1).
ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=0.5 --steps=2 --out="$tmp/edit.png" >/dev/null ||
  fail "generate --image"
cmp -s "$tmp/boat.png" "$tmp/edit.png" && fail "the edit returned its input unchanged"
ctl generate --prompt=lantern --image="$tmp/boat.png" --mask="$tmp/boat.png" --steps=2 >/dev/null ||
  fail "generate --image --mask"
expect 2 "need --image" "--mask without --image" -- generate --prompt=lantern --mask="$tmp/boat.png"
expect 2 "cannot read --image" "--image of a missing file" -- generate --prompt=lantern --image="$tmp/none.png"
expect 2 "is not a number" "--strength=lots" -- generate --prompt=lantern --image="$tmp/boat.png" --strength=lots
expect 1 "strength is 2" "--strength=2" -- generate --prompt=lantern --image="$tmp/boat.png" --strength=2
expect 1 "image: not a PNG file" "--image of a text file" -- generate --prompt=lantern --image="$tmp/token"
out=$(ctl placement)
grep -q "zimage-tiny/transformer *RESIDENT" <<<"$out" || fail "placement: $out"
out=$(ctl set-strategy --strategy='custom: "text-encoders-only"')
grep -q 'strategy: "text-encoders-only"' <<<"$out" || fail "set-strategy: $out"
expect 1 "unknown component 'unet'" "bad rules" -- set-strategy --strategy='workflow { rules { keep_resident: "unet" } }'
out=$(ctl enable-group-offload --component=zimage-tiny/transformer --options='use_stream: true')
grep -q "GROUP_OFFLOADED" <<<"$out" || fail "enable: $out"
ctl generate --prompt=boat --width=64 --height=64 --steps=1 >/dev/null
out=$(ctl placement)
grep -q "zimage-tiny/text_encoder *OFFLOADED" <<<"$out" || fail "text encoder should be offloaded: $out"
# The group-offloaded transformer's line says what streams and that it ran.
grep -Eq "^    groups [1-9][0-9]* streamed / 0 resident, [0-9.]+ [KM]iB per forward, working set .*; [1-9][0-9]* forwards$" \
  <<<"$out" || fail "group offload status: $out"
out=$(ctl disable-group-offload --component=zimage-tiny/transformer)
grep -q "OFFLOADED" <<<"$out" || fail "disable: $out"
ctl load-pipeline --name=extra --weight_seed=3 | grep -q 'name: "extra"' || fail "load"
out=$(ctl load-pipeline --name=old --builtin=tiny)
grep -q 'TinyDiT' <<<"$out" || fail "load --builtin=tiny: $out"
out=$(ctl load-pipeline --name=bad --builtin=sdxl 2>&1 || true)
grep -q "available: flux-tiny, tiny, zimage-tiny" <<<"$out" || fail "load --builtin=sdxl: $out"
ctl generate --pipeline=extra --prompt=kite --width=64 --height=64 --steps=1 >/dev/null
# LoRA adapters: a file that does not exist, an adapter the pipeline lacks, a malformed --lora.
expect 1 "none.safetensors" "load-adapter of a missing file" -- \
  load-adapter --pipeline=extra --name=style --path="$tmp/none.safetensors"
expect 1 "has no adapter" "generate --lora with no adapter" -- \
  generate --pipeline=extra --prompt=kite --width=64 --height=64 --steps=1 --lora=style:0.5
expect 2 "is not NAME or NAME:SCALE" "--lora=style:much" -- generate --pipeline=extra --prompt=kite --lora=style:much
expect 1 "NOT_FOUND\|has no adapter named" "unload-adapter of none" -- unload-adapter --pipeline=extra --name=style
ctl unload-pipeline --name=extra >/dev/null
expect 1 "not found" "unloaded pipeline still served" -- generate --pipeline=extra --prompt=kite
out=$(ctl placement-log --limit=50)
grep -q "onload" <<<"$out" && grep -q "unregister" <<<"$out" || fail "log: $out"
out=$(ctl set-batching --pipeline=zimage-tiny --max_batch_size=4 --max_queue_delay_ms=25)
grep -q "max_batch_size: 4" <<<"$out" && grep -q "max_queue_delay_ms: 25" <<<"$out" || fail "set-batching: $out"
"$here/clients/stowctl/stowctl" --target="$target" pipelines | grep -q "batching: up to 4 requests, waiting up to 25 ms" ||
  fail "pipelines does not show batching"
expect 1 "batching.max_batch_size: 99 is out of range" "set-batching range" -- \
  set-batching --pipeline=zimage-tiny --max_batch_size=99
# The server's one device: sim:0 here, cuda:0 on a GPU host.
dev=$(ctl placement | sed -n 's/^device \([a-z]*:[0-9]*\): .*/\1/p' | head -1)
[[ $dev == sim:0 || $dev == cuda:0 ]] || fail "placement names no device: $(ctl placement)"
out=$(ctl drain-device --device=$dev)
grep -q "draining: true" <<<"$out" || fail "drain-device: $out"
expect 1 "served only by draining devices ($dev)" "a drained only device still served" -- \
  generate --prompt=kite --width=64 --height=64 --steps=1
out=$(ctl resume-device --device=$dev)
grep -q "draining: true" <<<"$out" && fail "resume-device: $out"
ctl placement --device=$dev | grep -q "device $dev" || fail "placement --device"
expect 1 "device 'sim:4' is not one of this server's: $dev" "placement --device=sim:4" -- placement --device=sim:4
# move-component reaches MoveComponent (one device here: nothing to move to).
expect 1 "component 'vae' of pipeline 'zimage-tiny' is already on $dev; nothing to move" "move-component" -- \
  move-component --pipeline=zimage-tiny --component=vae --device=$dev
set +e
ctl enable-group-offload --options='use_stream: true' >/dev/null 2>&1; rc=$?
set -e
[ $rc -eq 2 ] || fail "usage error expected, rc=$rc"
echo "ok"
