#!/usr/bin/env bash
# Here, before a device call: what the GPU host needs beside the working tree, in git-ignored
# folders to name in the call's `carry` (the tree, the carried paths and shared/ travel together,
# 64 MiB at most):
#   .ref/head.tgz           `git archive` of a commit (default HEAD) without the bulky demo model
#                           and Z-Image fixture: the device builds exactly that commit, whatever a
#                           helper is editing in the working tree meanwhile
#   .ref/diffusers_slim.tgz diffusers' source (from .ref/diffusers/src, fetched separately) with
#                           only the pipelines the GPU suites run (flux, z_image, stable_diffusion)
#   .deb                    the Debian packages the CMake build links (deploy/gpu_host/fetch_debs.sh)
# Prints the commit and the carry list. On the device: deploy/gpu_host/unpack_and_run.sh.
#   deploy/gpu_host/prepare_carry.sh [REV]
set -euo pipefail
cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.."
rev=$(git rev-parse --short "${1:-HEAD}")
mkdir -p .ref
git archive "$rev" -- . ':!models/demo' ':!tests/fixtures/zimage_tiny' | gzip >.ref/head.tgz
echo "$rev" >.ref/head.rev
carry='".ref/head.tgz", ".ref/head.rev"'
if [ -d .ref/diffusers/src/diffusers ]; then
  rm -rf .ref/diffusers_slim && mkdir -p .ref/diffusers_slim
  cp -r .ref/diffusers/src .ref/diffusers_slim/
  # Nothing here uses the modular pipelines (2.9 MB): without them the carry stays under 64 MiB.
  rm -rf .ref/diffusers_slim/src/diffusers/modular_pipelines
  for p in .ref/diffusers_slim/src/diffusers/pipelines/*/; do
    case $(basename "$p") in flux | z_image | stable_diffusion) ;; *) rm -rf "$p" ;; esac
  done
  # Carried as one gzip archive (a third of its size: tree, archive and .deb stay under 64 MiB).
  tar czf .ref/diffusers_slim.tgz -C .ref/diffusers_slim src
  carry="$carry, \".ref/diffusers_slim.tgz\""
else
  echo "note: no .ref/diffusers/src (fetch github:huggingface/diffusers and copy its src/ there): suites that run diffusers will fail" >&2
fi
if [ -d .deb ]; then carry="$carry, \".deb\""; else echo "note: no .deb: run deploy/gpu_host/fetch_debs.sh" >&2; fi
echo "commit $rev; head.tgz $(du -h .ref/head.tgz | cut -f1)"
echo "carry: [$carry]"
