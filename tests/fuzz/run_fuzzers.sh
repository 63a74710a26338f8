#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz with clang, ASan and UBSan (bazel --config=fuzz) and
# runs each for a bounded time, starting from its committed seed corpus (tests/fuzz/corpus/<name>,
# read only; new inputs go to a scratch copy). Exits non-zero when a build fails or a target crashes,
# aborts, leaks, reports undefined behaviour or spends more than 10 s on one input; the offending
# input is kept under the work directory (printed) for replay:
#   bazel-fuzz-bin/tests/fuzz/<target> <input>
#
# Usage: tests/fuzz/run_fuzzers.sh [SECONDS_PER_TARGET (default 30)] [TARGET ...]
#   TARGET: safetensors_fuzzer, model_config_fuzzer, tokenizer_fuzzer, clip_tokenizer_fuzzer,
#   t5_tokenizer_fuzzer (default: all five)
# Environment: FUZZ_WORK_DIR (default: a new directory under /tmp), BAZEL (default: bazel),
#   FUZZ_JOBS (bazel --jobs, default 2).
set -euo pipefail

cd "$(dirname "$0")/../.."
seconds="${1:-30}"
shift || true
targets=("$@")
if [[ ${#targets[@]} -eq 0 ]]; then
  targets=(safetensors_fuzzer model_config_fuzzer tokenizer_fuzzer clip_tokenizer_fuzzer t5_tokenizer_fuzzer)
fi
bazel="${BAZEL:-bazel}"
work="${FUZZ_WORK_DIR:-$(mktemp -d /tmp/stowage-fuzz.XXXXXX)}"
mkdir -p "$work"

labels=()
for t in "${targets[@]}"; do labels+=("//tests/fuzz:$t"); done
echo "building ${targets[*]} (clang, ASan, UBSan, libFuzzer); log: $work/build.log"
start=$(date +%s)
if ! "$bazel" build --jobs="${FUZZ_JOBS:-2}" --config=fuzz "${labels[@]}" >"$work/build.log" 2>&1; then
  grep -v 'ld.gold: warning' "$work/build.log" | tail -40
  echo "FAILED: the fuzz targets did not build"
  exit 1
fi
echo "built in $(( $(date +%s) - start )) s"

failed=0
for t in "${targets[@]}"; do
  corpus="tests/fuzz/corpus/${t%_fuzzer}"
  mkdir -p "$work/$t/corpus" "$work/$t/artifacts"
  echo "running $t for ${seconds} s over $corpus"
  if ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
      "bazel-fuzz-bin/tests/fuzz/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 \
      -artifact_prefix="$work/$t/artifacts/" -print_final_stats=1 \
      "$work/$t/corpus" "$corpus" >"$work/$t/log" 2>&1; then
    echo "  ok: $(grep -E '^stat::number_of_executed_units' "$work/$t/log" | awk '{print $2}') inputs"
  else
    failed=1
    tail -40 "$work/$t/log"
    echo "  FAILED: $t; input(s): $(ls "$work/$t/artifacts" | tr '\n' ' ')"
  fi
done
if [[ $failed -ne 0 ]]; then
  echo "FAILED: a fuzz target found a problem (work directory $work)"
  exit 1
fi
echo "all fuzz targets ran ${seconds} s each without a finding (work directory $work)"
