#!/usr/bin/env bash
# Device calls for the Flux.1 work (issue 11). Builds with CMake (deploy/gpu_host/build_and_serve.sh,
# tests skipped), then runs the parts named in PARTS (default "fixtures offload"):
#   fixtures  tests/parity/make_flux_fixtures.py and make_flux_tokenizer_fixtures.py with
#             diffusers/transformers/tokenizers/sentencepiece, then the C++ check on them
#             (flux_parity_check, strict bf16 tolerance) -> $OUT/fixtures.tgz (flux_tiny and
#             flux_tokenizers, for tests/fixtures/), $OUT/parity.txt
#   offload   bench/side_by_side.sh with ARCH=flux: diffusers exports Flux.1 [dev]'s transformer
#             (11.9 B parameters, random bf16) to /tmp/flux-weights, then diffusers'
#             apply_group_offloading and bench/offload_bench run the same forward on those files, one
#             process per row -> $OUT/flux_offload.jsonl (+ both sides' raw rows in $OUT/offload.tgz)
#             DIFFUSERS_FROM=ROWS.jsonl: take the diffusers rows from an earlier run instead;
#             STOWAGE_ROWS replaces Stowage's rows
#   two       bench/two_pipelines.py (Z-Image-Turbo and Flux.1 [dev] at full shapes, random weights,
#             one server, a 24 GiB device budget; TWO_ARGS adds options, e.g. --phases)
#             -> $OUT/two_pipelines.jsonl, placement logs in $OUT/two_logs.tgz
#   two_diffusers  bench/diffusers_two_pipelines.py (the diffusers baseline, both pipelines with
#             enable_model_cpu_offload in one process) -> $OUT/two_pipelines.jsonl
# Device calls: deploy/gpu_host/prepare_carry.sh here (prints the carry list: .ref/head.tgz, .ref/head.rev,
# .ref/diffusers_slim.tgz, .deb), then on the device deploy/gpu_host/unpack_and_run.sh runs this suite in
# the unpacked commit (reusing its build on a warm machine):
#   OUT=$OUT PARTS="fixtures offload" deploy/gpu_host/unpack_and_run.sh bash deploy/gpu_host/run_flux_suite.sh
source "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/suite_lib.sh"

suite_build flux

for part in ${PARTS:-fixtures offload}; do
  case $part in
    fixtures)
      stamp "fixtures"
      rm -rf "$logs/fixtures" && mkdir -p "$logs/fixtures"
      timeout 300 python3 tests/parity/make_flux_fixtures.py "$logs/fixtures/flux_tiny" >"$logs/make_flux_fixtures.txt" 2>&1
      stamp "flux fixtures exit $?"
      tail -3 "$logs/make_flux_fixtures.txt" >>"$OUT/summary.txt"
      timeout 300 python3 tests/parity/make_flux_tokenizer_fixtures.py "$logs/fixtures/flux_tokenizers" \
        >"$logs/make_flux_tokenizer_fixtures.txt" 2>&1
      stamp "tokenizer fixtures exit $?"
      tail -3 "$logs/make_flux_tokenizer_fixtures.txt" >>"$OUT/summary.txt"
      rm -rf "$logs/fixtures/flux_tiny/.work"
      timeout 300 "$build/tests/parity/flux_parity_check" "$logs/fixtures/flux_tiny" --bf16_tolerance=1e-2 \
        >"$OUT/parity.txt" 2>&1
      stamp "parity exit $?"
      tail -3 "$OUT/parity.txt" >>"$OUT/summary.txt"
      tar czf "$OUT/fixtures.tgz" -C "$logs/fixtures" . 2>/dev/null
      ;;
    offload)
      stamp "flux offload side by side"
      mkdir -p "$logs/offload"
      diffusers_rows="resident block_level leaf_level block_level_lowmem"
      if [ -n "${DIFFUSERS_FROM:-}" ]; then  # The diffusers rows of an earlier run on this machine kind.
        cp "$DIFFUSERS_FROM" "$logs/offload/diffusers.jsonl" && diffusers_rows=""
      fi
      DIFFUSERS_ROWS="$diffusers_rows" \
        STOWAGE_ROWS="${STOWAGE_ROWS:-resident block_pinned leaf_pinned_d4 block_lowram leaf_lowram_d4}" ROW_TIMEOUT=200 \
        timeout "${OFFLOAD_TIMEOUT:-500}" bash bench/side_by_side.sh "$build/bench/offload_bench" /tmp/flux-weights \
        "$logs/offload" "$machine" flux >"$logs/offload.txt" 2>&1
      stamp "offload exit $?"
      cp "$logs/offload/flux_offload.jsonl" "$OUT/" 2>/dev/null
      cat "$logs/offload/flux_offload.md" >>"$OUT/summary.txt" 2>/dev/null
      tar czf "$OUT/offload.tgz" -C "$logs" offload offload.txt 2>/dev/null
      ;;
    two)
      stamp "two pipelines"
      python3 bench/make_zimage_random_dir.py /tmp/zimage-full --size full >/dev/null
      python3 bench/make_flux_random_dir.py /tmp/flux-full --size full >/dev/null
      mkdir -p "$logs/two"
      timeout "${TWO_TIMEOUT:-420}" python3 bench/two_pipelines.py stowage --server "$build/server/stowage_server" \
        --stowctl "$build/clients/stowctl/stowctl" --zimage /tmp/zimage-full --flux /tmp/flux-full \
        --out "$OUT/two_pipelines.jsonl" --logs "$logs/two" --machine "$machine" ${TWO_ARGS:-} \
        >"$logs/two/stowage.txt" 2>&1
      stamp "stowage side exit $?"
      tail -40 "$logs/two/stowage.txt" >>"$OUT/summary.txt"
      tar czf "$OUT/two_logs.tgz" -C "$logs" two 2>/dev/null
      ;;
    two_diffusers)
      stamp "two pipelines, diffusers baseline"
      mkdir -p "$logs/two"
      timeout "${DIFFUSERS_TIMEOUT:-240}" python3 bench/diffusers_two_pipelines.py --out "$OUT/two_pipelines.jsonl" \
        --machine "$machine" >"$logs/two/diffusers.txt" 2>&1
      stamp "diffusers side exit $?"
      tail -5 "$logs/two/diffusers.txt" >>"$OUT/summary.txt"
      tar czf "$OUT/two_logs.tgz" -C "$logs" two 2>/dev/null
      ;;
    *) stamp "unknown part $part" ;;
  esac
done
tar czf "$OUT/logs.tgz" -C "$logs" --exclude=fixtures --exclude=offload --exclude=two . 2>/dev/null
stamp "done"
