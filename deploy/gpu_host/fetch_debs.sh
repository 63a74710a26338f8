#!/usr/bin/env bash
# Downloads (does not install) the Debian 12 packages the GPU host needs to build and run Stowage
# with CMake: gRPC, protobuf (+ protoc and the gRPC plugins), abseil, prometheus-cpp, civetweb, libmicrohttpd,
# gtest/gmock, libpng, PCRE2, utf8proc, SentencePiece. Run HERE, on the Debian 12 build machine; the GPU host (Ubuntu 24.04, no network) gets the
# folder with the working tree and unpacks it with `dpkg -x` (deploy/unpack_debs.sh, which
# deploy/gpu_host/build_and_serve.sh and `./stowage serve --cuda --debs=.deb` call).
#
# Usage: deploy/gpu_host/fetch_debs.sh [DEST]        (default DEST: <repo>/.deb, git-ignored)
#
# Only what Ubuntu 24.04 lacks is fetched: its own glibc, libstdc++, libssl3 (libssl.so.3) and zlib
# (libz.so.1) serve the Debian libraries at run time. zlib1g-dev is fetched for zlib.h and the
# libz.so link name (unpack_debs.sh re-points its absolute symlink at the host's libz.so.1).
set -euo pipefail

repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
dest="${1:-${repo_root}/.deb}"
max_bytes=$((40 * 1000 * 1000))

packages=(
  # gRPC C++ (headers, link names, runtime) and its runtime dependencies missing on Ubuntu 24.04.
  libgrpc++-dev libgrpc++1.51 libgrpc-dev libgrpc29 libre2-9 libc-ares2
  # Abseil 20220623 (Debian's inline namespace absl::debian3).
  libabsl-dev libabsl20220623
  # Protobuf 3.21.12: headers, runtime, protoc and libprotoc (protoc and the plugins need it).
  libprotobuf-dev libprotobuf32 libprotoc32 protobuf-compiler
  # grpc_cpp_plugin and grpc_python_plugin.
  protobuf-compiler-grpc
  # prometheus-cpp (core + pull exposer) and civetweb, the embedded HTTP server it links.
  prometheus-cpp-dev libprometheus-cpp-core1.0 libprometheus-cpp-pull1.0 libcivetweb1 libcivetweb-dev
  # libmicrohttpd: the OpenAI-compatible HTTP front's server (server/http_front.cc); its GnuTLS
  # (libgnutls.so.30) is the host's own.
  libmicrohttpd12 libmicrohttpd-dev
  # xxHash (header, link name, runtime): the disk offload store's fingerprints.
  libxxhash-dev libxxhash0
  # spdlog and fmt (headers, link names, runtime): the server's log lines.
  libspdlog-dev libspdlog1.10 libfmt-dev libfmt9
  # GoogleTest / GoogleMock: headers and static libgtest.a, libgmock.a, libgmock_main.a.
  libgtest-dev libgmock-dev
  # nlohmann-json (header-only): the HTTP front's strict JSON check (server/openai_images.cc).
  nlohmann-json3-dev
  # PNG encoding (models/core/image.cc) and zlib's header / link name.
  libpng-dev libpng16-16 zlib1g-dev
  # The BPE tokenizer: PCRE2 (Unicode regex with lookahead) and utf8proc (NFC).
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libutf8proc-dev libutf8proc2
  # SentencePiece (header, link names, runtime): the reference tests/models:t5_tokenizer_test
  # compares the T5 tokenizer with (the server itself does not link it).
  libsentencepiece-dev libsentencepiece0
)

if ! command -v apt-get >/dev/null 2>&1; then
  echo "fetch_debs.sh: apt-get not found; run this on the Debian 12 build machine" >&2
  exit 2
fi

mkdir -p "${dest}"
cd "${dest}"
# Start from a clean set so that stale versions of a package never travel with the new ones.
shopt -s nullglob
old=(./*.deb)
if ((${#old[@]})); then rm -f -- "${old[@]}"; fi

echo "fetch_debs.sh: downloading ${#packages[@]} packages into ${dest}"
if ! apt-get download "${packages[@]}"; then
  echo "fetch_debs.sh: apt-get download failed (is the package index current? try 'apt-get update')" >&2
  exit 1
fi

# Check every package arrived and write a manifest: package, version, bytes.
manifest="${dest}/MANIFEST.txt"
: >"${manifest}"
missing=()
total=0
for pkg in "${packages[@]}"; do
  files=("${pkg}"_*.deb)
  if ((${#files[@]} != 1)); then
    missing+=("${pkg}")
    continue
  fi
  version="$(dpkg-deb -f "${files[0]}" Version)"
  bytes="$(stat -c %s "${files[0]}")"
  total=$((total + bytes))
  printf '%-28s %-24s %9d\n' "${pkg}" "${version}" "${bytes}" >>"${manifest}"
done
if ((${#missing[@]})); then
  echo "fetch_debs.sh: no .deb (or more than one) for: ${missing[*]}" >&2
  exit 1
fi

cat "${manifest}"
printf 'fetch_debs.sh: %d packages, %d bytes (%.1f MB) in %s\n' "${#packages[@]}" "${total}" \
  "$(awk -v b="${total}" 'BEGIN { print b / 1e6 }')" "${dest}"
if ((total > max_bytes)); then
  echo "fetch_debs.sh: total exceeds the $((max_bytes / 1000000)) MB budget for what travels to the GPU host" >&2
  exit 1
fi
