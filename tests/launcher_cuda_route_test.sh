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

# --debs=DIR (a machine without network): no apt; the folder unpacked into build/cuda-deps, CMake
# pointed at that prefix, the server run with its libraries before LibTorch's. A dry run unpacks
# nothing. (Fake .deb files: the dry run only counts them.)
mkdir -p "$tmp/debs" "$tmp/nodebs"
touch "$tmp/debs/libgrpc++-dev_1.51.1-3+b1_amd64.deb" "$tmp/debs/libabsl-dev_20220623.1-1+deb12u2_amd64.deb"
touch "$tmp/nodebs/README.txt"
root=$(cd "$(dirname "$launcher")" && pwd)
out=$(cd "$tmp" && env -u TORCH_CUDA_ARCH_LIST PATH="$tmp/bin:/usr/bin:/bin" bash "$launcher" serve --cuda --libtorch="$tmp/libtorch" --debs=debs \
  --dry-run --grpc_address=127.0.0.1:0 2>&1); rc=$?
[ $rc -eq 0 ] || fail "debs route: rc=$rc $out"
! grep -q "apt-get" <<<"$out" || fail "debs route mentions apt-get: $out"
grep -q "install: nothing with apt (--debs): unpack the 2 .deb files of $tmp/debs into $root/build/cuda-deps" <<<"$out" ||
  fail "debs install line (relative --debs resolved from the caller's folder): $out"
grep -q -- "configure: cmake .*-DCMAKE_PREFIX_PATH=$tmp/libtorch/share/cmake .*-DSTOWAGE_DEPS_PREFIX=$root/build/cuda-deps" \
  <<<"$out" || fail "debs configure: $out"
grep -q "build: cmake --build .*/build/cuda --target stowage_server stowctl (headers, libraries and protoc from $root/build/cuda-deps)" \
  <<<"$out" || fail "debs build: $out"
grep -q "serve: env LD_LIBRARY_PATH=$root/build/cuda-deps/usr/lib/[a-z0-9_-]*:$tmp/libtorch/lib[: ].*/build/cuda/server/stowage_server --grpc_address=127.0.0.1:0" \
  <<<"$out" || fail "debs serve: $out"
! grep -q -- "--debs\|--dry-run" <<<"$(grep "serve: " <<<"$out")" || fail "launcher flags passed to the server: $out"
[ ! -e "$root/build/cuda-deps/.stowage-partial" ] || fail "a dry run started unpacking"
# TORCH_CUDA_ARCH_LIST: passed on when set, never forced.
! grep -q "TORCH_CUDA_ARCH_LIST" <<<"$out" || fail "TORCH_CUDA_ARCH_LIST forced: $out"
out=$(TORCH_CUDA_ARCH_LIST=9.0 PATH="$tmp/bin:/usr/bin:/bin" bash "$launcher" serve --cuda --libtorch="$tmp/libtorch" \
  --debs="$tmp/debs" --dry-run 2>&1)
grep -q "configure: env TORCH_CUDA_ARCH_LIST=9.0 cmake " <<<"$out" || fail "TORCH_CUDA_ARCH_LIST not passed on: $out"

# A --debs folder without .deb files, or no folder: refused, saying so.
out=$(PATH="$tmp/bin:/usr/bin:/bin" bash "$launcher" serve --cuda --libtorch="$tmp/libtorch" --debs="$tmp/nodebs" --dry-run 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q -- "--debs=$tmp/nodebs: no .deb files there" <<<"$out" || fail "empty debs folder: rc=$rc $out"
out=$(PATH="$tmp/bin:/usr/bin:/bin" bash "$launcher" serve --cuda --libtorch="$tmp/libtorch" --debs="$tmp/absent" --dry-run 2>&1); rc=$?
[ $rc -ne 0 ] && grep -q -- "--debs=$tmp/absent: not a folder" <<<"$out" || fail "missing debs folder: rc=$rc $out"
echo ok
