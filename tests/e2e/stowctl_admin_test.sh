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

# Authentication.
set +e
out=$(ctl placement 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "UNAUTHENTICATED\|16" <<<"$out" || fail "no token: rc=$rc $out"
set +e
out=$(ctl --token=wrong placement 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "wrong admin token" <<<"$out" || fail "wrong token: $out"
export STOWAGE_TOKEN=$(cat "$tmp/token")

ctl generate --prompt=boat --width=64 --height=64 --steps=1 --seed=3 --out="$tmp/boat.png" >/dev/null
# Images in: the drawn boat as the input (image to image, then inpainting with the same image as its
# mask), and the usage errors stowctl catches itself (exit 2) or the server refuses (exit 1).
ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=0.5 --steps=2 --out="$tmp/edit.png" >/dev/null ||
  fail "generate --image"
cmp -s "$tmp/boat.png" "$tmp/edit.png" && fail "the edit returned its input unchanged"
ctl generate --prompt=lantern --image="$tmp/boat.png" --mask="$tmp/boat.png" --steps=2 >/dev/null ||
  fail "generate --image --mask"
set +e
out=$(ctl generate --prompt=lantern --mask="$tmp/boat.png" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "need --image" <<<"$out" || { set -e; fail "--mask without --image: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/none.png" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "cannot read --image" <<<"$out" || { set -e; fail "--image of a missing file: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=lots 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "is not a number" <<<"$out" || { set -e; fail "--strength=lots: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=2 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "strength is 2" <<<"$out" || { set -e; fail "--strength=2: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/token" 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "image: not a PNG file" <<<"$out" || { set -e; fail "--image of a text file: rc=$rc $out"; }
set -e
out=$(ctl placement)
grep -q "zimage-tiny/transformer *RESIDENT" <<<"$out" || fail "placement: $out"
out=$(ctl set-strategy --strategy='custom: "text-encoders-only"')
grep -q 'strategy: "text-encoders-only"' <<<"$out" || fail "set-strategy: $out"
set +e
out=$(ctl set-strategy --strategy='workflow { rules { keep_resident: "unet" } }' 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "unknown component 'unet'" <<<"$out" || fail "bad rules: $out"
out=$(ctl enable-group-offload --component=zimage-tiny/transformer --options='use_stream: true')
grep -q "GROUP_OFFLOADED" <<<"$out" || fail "enable: $out"
ctl generate --prompt=boat --width=64 --height=64 --steps=1 --seed=3 --out="$tmp/boat.png" >/dev/null
# Images in: the drawn boat as the input (image to image, then inpainting with the same image as its
# mask), and the usage errors stowctl catches itself (exit 2) or the server refuses (exit 1).
ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=0.5 --steps=2 --out="$tmp/edit.png" >/dev/null ||
  fail "generate --image"
cmp -s "$tmp/boat.png" "$tmp/edit.png" && fail "the edit returned its input unchanged"
ctl generate --prompt=lantern --image="$tmp/boat.png" --mask="$tmp/boat.png" --steps=2 >/dev/null ||
  fail "generate --image --mask"
set +e
out=$(ctl generate --prompt=lantern --mask="$tmp/boat.png" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "need --image" <<<"$out" || { set -e; fail "--mask without --image: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/none.png" 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "cannot read --image" <<<"$out" || { set -e; fail "--image of a missing file: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=lots 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "is not a number" <<<"$out" || { set -e; fail "--strength=lots: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/boat.png" --strength=2 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "strength is 2" <<<"$out" || { set -e; fail "--strength=2: rc=$rc $out"; }
out=$(ctl generate --prompt=lantern --image="$tmp/token" 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "image: not a PNG file" <<<"$out" || { set -e; fail "--image of a text file: rc=$rc $out"; }
set -e
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
set +e
out=$(ctl load-adapter --pipeline=extra --name=style --path="$tmp/none.safetensors" 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "none.safetensors" <<<"$out" || { set -e; fail "load-adapter of a missing file: rc=$rc $out"; }
out=$(ctl generate --pipeline=extra --prompt=kite --width=64 --height=64 --steps=1 --lora=style:0.5 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "has no adapter" <<<"$out" || { set -e; fail "generate --lora with no adapter: rc=$rc $out"; }
out=$(ctl generate --pipeline=extra --prompt=kite --lora=style:much 2>&1); rc=$?
[ $rc -eq 2 ] && grep -q "is not NAME or NAME:SCALE" <<<"$out" || { set -e; fail "--lora=style:much: rc=$rc $out"; }
out=$(ctl unload-adapter --pipeline=extra --name=style 2>&1); rc=$?
[ $rc -eq 1 ] && grep -q "NOT_FOUND\|has no adapter named" <<<"$out" || { set -e; fail "unload-adapter of none: rc=$rc $out"; }
set -e
ctl unload-pipeline --name=extra >/dev/null
set +e
out=$(ctl generate --pipeline=extra --prompt=kite 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "not found" <<<"$out" || fail "unloaded pipeline still served: $out"
out=$(ctl placement-log --limit=50)
grep -q "onload" <<<"$out" && grep -q "unregister" <<<"$out" || fail "log: $out"
out=$(ctl set-batching --pipeline=zimage-tiny --max_batch_size=4 --max_queue_delay_ms=25)
grep -q "max_batch_size: 4" <<<"$out" && grep -q "max_queue_delay_ms: 25" <<<"$out" || fail "set-batching: $out"
"$here/clients/stowctl/stowctl" --target="$target" pipelines | grep -q "batching: up to 4 requests, waiting up to 25 ms" ||
  fail "pipelines does not show batching"
set +e
out=$(ctl set-batching --pipeline=zimage-tiny --max_batch_size=99 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "batching.max_batch_size: 99 is out of range" <<<"$out" || fail "set-batching range: $out"
# The server's one device: sim:0 here, cuda:0 on a GPU host.
dev=$(ctl placement | sed -n 's/^device \([a-z]*:[0-9]*\): .*/\1/p' | head -1)
[[ $dev == sim:0 || $dev == cuda:0 ]] || fail "placement names no device: $(ctl placement)"
out=$(ctl drain-device --device=$dev)
grep -q "draining: true" <<<"$out" || fail "drain-device: $out"
set +e
out=$("$here/clients/stowctl/stowctl" --target="$target" generate --prompt=kite --width=64 --height=64 --steps=1 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "served only by draining devices ($dev)" <<<"$out" || fail "a drained only device still served: $out"
out=$(ctl resume-device --device=$dev)
grep -q "draining: true" <<<"$out" && fail "resume-device: $out"
ctl placement --device=$dev | grep -q "device $dev" || fail "placement --device"
set +e
out=$(ctl placement --device=sim:4 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "device 'sim:4' is not one of this server's: $dev" <<<"$out" || fail "placement --device=sim:4: $out"
# move-component reaches MoveComponent (one device here: nothing to move to).
set +e
out=$(ctl move-component --pipeline=zimage-tiny --component=vae --device=$dev 2>&1); rc=$?
set -e
[ $rc -eq 1 ] && grep -q "component 'vae' of pipeline 'zimage-tiny' is already on $dev; nothing to move" <<<"$out" ||
  fail "move-component: $out"
set +e
ctl enable-group-offload --options='use_stream: true' >/dev/null 2>&1; rc=$?
set -e
[ $rc -eq 2 ] || fail "usage error expected, rc=$rc"
echo "ok"
