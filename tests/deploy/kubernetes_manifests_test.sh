#!/usr/bin/env bash
# Validates every document of deploy/kubernetes/*.yaml against the Kubernetes and Prometheus
# Operator schemas (npm's kubernetes-models packages) and against each other
# (tests/deploy/kubernetes/validate_manifests.js).
#
# The npm packages are fetched here, by the test, into its own temporary folder: `npm ci` from the
# committed package-lock.json (exact versions and integrity hashes), so a clean clone needs only
# Debian's nodejs and npm (./stowage setup) and the npm registry. npm's cache
# ($STOWAGE_NPM_CACHE, default /tmp/stowage-npm-cache; Bazel gives tests a HOME of their own) keeps
# later runs from downloading again. By hand: (cd tests/deploy/kubernetes && npm ci) makes a
# git-ignored node_modules there, then node validate_manifests.js ../../../deploy/kubernetes/*.yaml.
set -euo pipefail
here=$(pwd)
for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "FAIL: no $tool: run ./stowage setup (Debian's nodejs and npm)"; exit 1; }
done
work="${TEST_TMPDIR:-$(mktemp -d)}/npm"
mkdir -p "$work"
cp "$here/tests/deploy/kubernetes/package.json" "$here/tests/deploy/kubernetes/package-lock.json" \
   "$here/tests/deploy/kubernetes/validate_manifests.js" "$work/"
export npm_config_cache="${STOWAGE_NPM_CACHE:-/tmp/stowage-npm-cache}"
(cd "$work" && npm ci --prefer-offline --no-audit --no-fund --loglevel=error >npm.log 2>&1) || {
  echo "FAIL: npm ci in $work:"; cat "$work/npm.log"; exit 1; }
manifests=("$here"/deploy/kubernetes/*.yaml)
[ ${#manifests[@]} -ge 4 ] || { echo "FAIL: expected the manifests under deploy/kubernetes, found ${manifests[*]}"; exit 1; }
exec node "$work/validate_manifests.js" "${manifests[@]}"
