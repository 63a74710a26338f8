#!/usr/bin/env bash
# deploy/gpu_host/prepare_carry.sh and unpack_and_run.sh on a scratch git repository: the archive
# holds the commit (not the working tree's edits) without the demo model; the slim diffusers archive
# keeps only the suites' pipelines and is unpacked beside the commit; on "the device" the command runs in the unpacked commit with
# STOWAGE_COMMIT set, the folder (and a build in it) is reused while the commit is the same; a new
# commit is synced into it by content (the build stays incremental), STOWAGE_FRESH=1 replaces it.
set -euo pipefail
# The caller's environment must not choose for the script: each case sets what it tests.
unset STOWAGE_FRESH STOWAGE_UNPACK_DIR
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")/../../deploy/gpu_host" && pwd)
repo=$TEST_TMPDIR/repo
rm -rf "$repo" "$TEST_TMPDIR/device-src"  # A re-run (CMake keeps its test folder) starts clean.
fail() { echo "FAIL: $*" >&2; exit 1; }
mkdir -p "$repo/deploy/gpu_host" "$repo/models/demo" "$repo/tests/fixtures/zimage_tiny" "$repo/server"
cp "$scripts/prepare_carry.sh" "$scripts/unpack_and_run.sh" "$repo/deploy/gpu_host/"
echo weights >"$repo/models/demo/big.bin"
echo fixture >"$repo/tests/fixtures/zimage_tiny/x.safetensors"
echo v1 >"$repo/server/main.cc"
echo same >"$repo/keep.txt"
echo old >"$repo/gone.txt"
printf '/.ref/\n/.deb/\n' >"$repo/.gitignore"
git() { command git -C "$repo" -c user.name=ci -c user.email=ci@localhost "$@"; }
git init -q && git add -A && git commit -qm one
mkdir -p "$repo/.ref/diffusers/src/diffusers/pipelines/"{flux,z_image,stable_diffusion,wan,sdxl} "$repo/.deb"
echo uncommitted >"$repo/server/main.cc"

out=$("$repo/deploy/gpu_host/prepare_carry.sh" 2>&1)
rev1=$(git rev-parse --short HEAD)
grep -q "commit $rev1" <<<"$out" || fail "prepare: $out"
grep -q 'carry: \[".ref/head.tgz", ".ref/head.rev", ".ref/diffusers_slim.tgz", ".deb"\]' <<<"$out" || fail "carry list: $out"
listing=$(tar tzf "$repo/.ref/head.tgz")
grep -q "^server/main.cc$" <<<"$listing" || fail "archive lacks server/main.cc: $listing"
! grep -q "models/demo\|zimage_tiny" <<<"$listing" || fail "archive holds the demo model or fixture: $listing"
[ "$(tar xzOf "$repo/.ref/head.tgz" server/main.cc)" = v1 ] || fail "archive is not the commit"
slim=$(tar tzf "$repo/.ref/diffusers_slim.tgz" | sed -n 's|^src/diffusers/pipelines/\([^/]*\)/$|\1|p' | sort | tr '\n' ' ')
[ "$slim" = "flux stable_diffusion z_image " ] || fail "slim pipelines: $slim"

dest=$TEST_TMPDIR/device-src
run() { (cd "$repo" && STOWAGE_UNPACK_DIR=$dest "$repo/deploy/gpu_host/unpack_and_run.sh" "$@"); }
[ "$(run bash -c 'echo "$STOWAGE_COMMIT $(pwd) $(cat server/main.cc)"')" = "$rev1 $dest v1" ] || fail "run in the commit"
[ -d "$dest/.ref/diffusers/src/diffusers/pipelines/z_image" ] && [ -d "$dest/.deb" ] || fail "diffusers source or .deb missing"
[ "$(cat "$dest/models/demo/big.bin" "$dest/tests/fixtures/zimage_tiny/x.safetensors")" = "weights
fixture" ] || fail "the paths left out of the archive are not linked from the carried tree"
run bash -c 'mkdir -p build/gpu && touch build/gpu/kept'
run test -f build/gpu/kept || fail "the same commit did not reuse the folder"

# A new commit over a built tree: changed files are copied in, files the commit lacks are removed,
# unchanged files keep their times (the build stays incremental), the build folder stays.
run bash -c 'touch -d "2001-01-01" keep.txt'
git add server/main.cc && git rm -q gone.txt && git commit -qm two
"$repo/deploy/gpu_host/prepare_carry.sh" >/dev/null 2>&1
[ "$(run bash -c 'echo "$STOWAGE_COMMIT $(cat server/main.cc)"')" = "$(git rev-parse --short HEAD) uncommitted" ] \
  || fail "a new commit did not unpack"
run test -f build/gpu/kept || fail "a new commit dropped the build folder"
[ "$(run stat -c %Y keep.txt)" = "$(date -d 2001-01-01 +%s)" ] || fail "an unchanged file was rewritten"
! run test -e gone.txt || fail "a file the new commit lacks is still there"
[ -d "$dest/.ref/diffusers/src/diffusers/pipelines/z_image" ] && [ -d "$dest/.deb" ] || fail "diffusers source or .deb lost on a new commit"
# STOWAGE_FRESH=1: a fresh folder.
echo three >"$repo/server/main.cc" && git add server/main.cc && git commit -qm three
"$repo/deploy/gpu_host/prepare_carry.sh" >/dev/null 2>&1
[ "$(cd "$repo" && STOWAGE_FRESH=1 STOWAGE_UNPACK_DIR=$dest "$repo/deploy/gpu_host/unpack_and_run.sh" cat server/main.cc)" = three ] \
  || fail "STOWAGE_FRESH=1 did not unpack"
! run test -e build/gpu/kept || fail "STOWAGE_FRESH=1 kept the old build folder"
echo ok
