#!/usr/bin/env bash
# ./stowage serve --cuda --dry-run: the route a user's NVIDIA machine takes, planned from what the
# machine has (a fake nvidia-smi and fake LibTorch folders here; nothing is installed or built).
set -uo pipefail
launcher="${STOWAGE_LAUNCHER:-$(pwd)/stowage}"  # Bazel: the runfiles root; CMake: set by the test.
tmp="$TEST_TMPDIR"
fail() { echo "FAIL: $*"; exit 1; }
mkdir -p "$tmp/bin" "$tmp/libtorch/share/cmake/Torch" "$tmp/libtorch/lib" "$tmp/not_libtorch"
touch "$tmp/libtorch/share/cmake/Torch/TorchConfig.cmake"
printf '#!/bin/sh\necho "NVIDIA H200, 580.1"\n' >"$tmp/bin/nvidia-smi"
chmod +x "$tmp/bin/nvidia-smi"

# No driver: refused, saying what to do (a PATH with only what the launcher needs before that check,
# so that a machine with a real nvidia-smi runs this case too).
mkdir -p "$tmp/nodriver"
ln -sf "$(command -v dirname)" "$tmp/nodriver/dirname"
out=$(PATH="$tmp/nodriver" "$(command -v bash)" "$launcher" serve --cuda --dry-run 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "no NVIDIA driver here (nvidia-smi not found)" <<<"$out" || fail "no driver: rc=$rc $out"

# A LibTorch archive: CMake against it, the server run with its libraries, flags passed through.
out=$(PATH="$tmp/bin:/usr/bin:/bin" bash "$launcher" serve --cuda --libtorch="$tmp/libtorch" --dry-run \
  --grpc_address=0.0.0.0:50051 2>&1); rc=$?
[ $rc -eq 0 ] || fail "archive route: rc=$rc $out"
grep -q "GPU: NVIDIA H200" <<<"$out" || fail "GPU line: $out"
grep -q -- "-DCMAKE_PREFIX_PATH=$tmp/libtorch/share/cmake -DSTOWAGE_CUDA=ON" <<<"$out" || fail "configure: $out"
grep -q "build: cmake --build .*/build/cuda --target stowage_server stowctl" <<<"$out" || fail "build: $out"
grep -q "serve: env LD_LIBRARY_PATH=$tmp/libtorch/lib.* .*/build/cuda/server/stowage_server --grpc_address=0.0.0.0:50051" \
  <<<"$out" || fail "serve: $out"
grep -q "install: " <<<"$out" || fail "install line: $out"

# A folder that is not LibTorch: refused, naming what is missing.
out=$(PATH="$tmp/bin:/usr/bin:/bin" bash "$launcher" serve --cuda --libtorch="$tmp/not_libtorch" --dry-run 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "no share/cmake/Torch/TorchConfig.cmake there" <<<"$out" || fail "bad libtorch: $out"

# No --libtorch: the pip torch of PYTHON; one without CUDA is refused.
cat >"$tmp/bin/fakepy" <<PY
#!/bin/sh
printf '%s\n%s\n%s\n' "$tmp/pip/torch/share/cmake" "$tmp/pip/torch/lib" ""
PY
chmod +x "$tmp/bin/fakepy"
out=$(PATH="$tmp/bin:/usr/bin:/bin" PYTHON="$tmp/bin/fakepy" bash "$launcher" serve --cuda --dry-run 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q "torch has no CUDA" <<<"$out" || fail "CPU pip torch: $out"
sed -i 's/"" *$/"13.0"/' "$tmp/bin/fakepy"
out=$(PATH="$tmp/bin:/usr/bin:/bin" PYTHON="$tmp/bin/fakepy" bash "$launcher" serve --cuda --dry-run 2>&1); rc=$?
[ $rc -eq 0 ] && grep -q -- "-DCMAKE_PREFIX_PATH=$tmp/pip/torch/share/cmake" <<<"$out" || fail "pip route: $out"
echo ok
