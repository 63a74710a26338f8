#!/usr/bin/env bash
# One device call for the Z-Image work: build (CMake, no ctest), write the parity fixtures with
# diffusers/transformers/tokenizers, compare the C++ components with them, then the four placement
# modes through the server at full size with random weights. Results land in $OUT (at most 8 files):
# summary.txt, parity.txt, four_modes.jsonl, fixtures.tgz, logs.tgz.
#
# Carry .deb (deploy/gpu_host/fetch_debs.sh) and .ref/diffusers/src (diffusers' source, git-ignored):
#   OUT=... deploy/gpu_host/run_zimage_suite.sh
set -uo pipefail
repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
cd "$repo_root"
OUT="${OUT:-$repo_root/gpu_out}"
mkdir -p "$OUT"
logs="$(mktemp -d /tmp/stowage-zimage-logs.XXXXXX)"
fixtures="$repo_root/tests/fixtures/zimage_tiny"

STOWAGE_SKIP_TESTS=1 STOWAGE_THREAD_STACK_SHIM=never OUT="$logs" \
  timeout "${STOWAGE_SERVE_TIMEOUT:-240}" deploy/gpu_host/build_and_serve.sh >"$logs/build.txt" 2>&1
cp "$logs/summary.txt" "$OUT/summary.txt" 2>/dev/null || echo "build_and_serve.sh left no summary" >"$OUT/summary.txt"
build="$repo_root/build/gpu"
export LD_LIBRARY_PATH="/tmp/stowage-deps/usr/lib/x86_64-linux-gnu:$(python3 -c 'import torch,os;print(os.path.join(os.path.dirname(torch.__file__),"lib"))'):${LD_LIBRARY_PATH:-}"

echo "== fixtures" | tee -a "$OUT/summary.txt"
PYTHONPATH="$repo_root/.ref/diffusers/src" timeout 300 python3 tests/parity/make_zimage_fixtures.py "$fixtures" \
  >"$logs/fixtures.txt" 2>&1; echo "fixtures exit $?" | tee -a "$OUT/summary.txt"
tail -5 "$logs/fixtures.txt" >>"$OUT/summary.txt"
echo "== parity" | tee -a "$OUT/summary.txt"
timeout 300 "$build/tests/parity/zimage_parity_check" "$fixtures" >"$OUT/parity.txt" 2>&1
echo "parity exit $?" | tee -a "$OUT/summary.txt"
tar czf "$OUT/fixtures.tgz" -C "$repo_root/tests/fixtures" zimage_tiny 2>/dev/null

echo "== four modes" | tee -a "$OUT/summary.txt"
python3 bench/make_zimage_random_dir.py /tmp/zimage-full --size full >/dev/null
machine="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1), $(nproc) cores"
PATH="$PATH" timeout "${STOWAGE_MODES_TIMEOUT:-420}" bash bench/four_modes.sh "$build/server/stowage_server" \
  "$build/clients/stowctl/stowctl" /tmp/zimage-full "$OUT/four_modes.jsonl" 1024 4 "$machine" bfloat16 \
  >"$logs/four_modes.txt" 2>&1
echo "four modes exit $?" | tee -a "$OUT/summary.txt"
cat "$OUT/four_modes.jsonl" >>"$OUT/summary.txt" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$logs" . 2>/dev/null
cat "$OUT/summary.txt"
