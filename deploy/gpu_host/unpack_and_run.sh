#!/usr/bin/env bash
# On the GPU host, from the carried working tree's root: unpacks .ref/head.tgz (made by
# deploy/gpu_host/prepare_carry.sh) into a fresh folder — reused while it holds the same commit, so
# a warm machine keeps its CMake build between calls — adds .deb and diffusers' slim source, and runs
# the command there with STOWAGE_COMMIT set. Never `git checkout` on the device: the carried tree
# may not be the commit, and a build folder from another tree keeps stale generated code.
#   deploy/gpu_host/unpack_and_run.sh COMMAND [ARGS...]
#   e.g. OUT=$OUT PARTS=two deploy/gpu_host/unpack_and_run.sh bash deploy/gpu_host/run_flux_suite.sh
set -euo pipefail
carried=$(pwd)
rev=$(cat .ref/head.rev)
dest=${STOWAGE_UNPACK_DIR:-/tmp/stowage-src}
if [ "$(cat "$dest/.stowage-rev" 2>/dev/null)" != "$rev" ] && [ -d "$dest/build" ] && [ "${STOWAGE_FRESH:-0}" != 1 ]; then
  # Another commit over a built tree (a warm machine): copy in only the files whose content changed
  # and delete the ones the commit lacks, so unchanged files keep their times and the CMake build
  # stays incremental (generated code is regenerated from its changed inputs). STOWAGE_FRESH=1 unpacks
  # into an empty folder instead.
  fresh=$(mktemp -d)
  tar xzf .ref/head.tgz -C "$fresh"
  (cd "$fresh" && find . -type f -print0) | while IFS= read -r -d '' f; do
    if ! cmp -s "$fresh/$f" "$dest/$f"; then mkdir -p "$(dirname "$dest/$f")" && cp "$fresh/$f" "$dest/$f"; fi
  done
  (cd "$dest" && find . -type f -not -path './build/*' -not -path './.deb/*' -not -path './.ref/*' \
    -not -name .stowage-rev -print0) | while IFS= read -r -d '' f; do [ -e "$fresh/$f" ] || rm -f "$dest/$f"; done
  rm -rf "$fresh"
  echo "$rev" >"$dest/.stowage-rev"
elif [ "$(cat "$dest/.stowage-rev" 2>/dev/null)" != "$rev" ]; then
  rm -rf "$dest" && mkdir -p "$dest"
  tar xzf .ref/head.tgz -C "$dest"
  [ -d .deb ] && cp -r .deb "$dest/"
  if [ -f .ref/diffusers_slim.tgz ]; then
    mkdir -p "$dest/.ref/diffusers" && tar xzf .ref/diffusers_slim.tgz -C "$dest/.ref/diffusers"
  elif [ -d .ref/diffusers_slim/src ]; then
    mkdir -p "$dest/.ref/diffusers" && ln -sfn "$carried/.ref/diffusers_slim/src" "$dest/.ref/diffusers/src"
  fi
  # Left out of the archive for size; the carried tree has them (tracked, rarely changed).
  for p in models/demo tests/fixtures/zimage_tiny; do
    if [ ! -e "$dest/$p" ] && [ -e "$carried/$p" ]; then
      mkdir -p "$(dirname "$dest/$p")" && ln -s "$carried/$p" "$dest/$p"
    fi
  done
  echo "$rev" >"$dest/.stowage-rev"
fi
cd "$dest"
STOWAGE_COMMIT=$rev exec "$@"
