#!/usr/bin/env bash
# Builds Stowage with CMake on the GPU host, runs the unit tests, starts stowage_server, sends one
# Generate request and scrapes /metrics. Everything it learns goes under $OUT.
#
# Run ON the GPU host (Ubuntu 24.04: g++, CMake, ninja, nvcc, Python with a CUDA torch; no Bazel, no
# gRPC, no network), from anywhere, with the .deb/ folder from deploy/gpu_host/fetch_debs.sh carried
# along in the repository root:
#
#   OUT=/some/dir deploy/gpu_host/build_and_serve.sh
#
# Environment (all optional):
#   OUT                      output folder (default ./gpu_out)
#   STOWAGE_DEB_DIR          the .deb files (default <repo>/.deb)
#   STOWAGE_DEPS_PREFIX      where deploy/unpack_debs.sh unpacks them (default /tmp/stowage-deps)
#   STOWAGE_BUILD_DIR        CMake build folder (default <repo>/build/gpu; kept between runs)
#   PYTHON                   the Python that has torch (default python3)
#   STOWAGE_CUDA             AUTO (default), ON (fail unless torch has CUDA) or OFF
#   STOWAGE_CLIENT           auto (default: stowctl if built, else the Python client), cpp, python, both
#   STOWAGE_PROMPT           prompt of the Generate request
#   STOWAGE_SERVER_ARGS      extra stowage_server flags, e.g. --config=FILE (split on spaces; the
#                            address and port-file flags are always the script's own)
#   STOWAGE_SKIP_TESTS=1     do not run ctest
#   STOWAGE_BUILD_TARGETS    build only these CMake targets (space-separated), then stop: no serving
#   STOWAGE_THREAD_STACK_SHIM  auto (default): when civetweb cannot start its threads next to the
#                            CUDA LibTorch (see thread_stack_shim.c), report that and retry with the
#                            shim preloaded; always: preload it from the start; never
#   JOBS / CTEST_JOBS        build / test parallelism (default nproc / 4)
#   STOWAGE_STARTUP_TIMEOUT  seconds to wait for the server's port file (default 180)
#   STOWAGE_REQUEST_TIMEOUT  deadline of the Generate call in seconds (default 600)
#
# Exit status: 0 when every step passed; 1 when a step failed (the summary names it); 2 for a
# missing prerequisite. The summary is printed last and written to $OUT/summary.txt.
set -euo pipefail

repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
cd "${repo_root}"

OUT="${OUT:-${repo_root}/gpu_out}"
mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"
deb_dir="${STOWAGE_DEB_DIR:-${repo_root}/.deb}"
deps="${STOWAGE_DEPS_PREFIX:-/tmp/stowage-deps}"
build_dir="${STOWAGE_BUILD_DIR:-${repo_root}/build/gpu}"
python="${PYTHON:-python3}"
client_mode="${STOWAGE_CLIENT:-auto}"
prompt="${STOWAGE_PROMPT:-a lighthouse on a cliff at dusk}"
jobs="${JOBS:-$(nproc)}"
ctest_jobs="${CTEST_JOBS:-4}"
startup_timeout="${STOWAGE_STARTUP_TIMEOUT:-180}"
request_timeout="${STOWAGE_REQUEST_TIMEOUT:-600}"
work="$(mktemp -d /tmp/stowage-run.XXXXXX)"

# ---------------------------------------------------------------------------------------------
# Bookkeeping: every step records ok / FAILED / skipped with a note; the summary lists them.
# ---------------------------------------------------------------------------------------------
steps=()
declare -A result=() note=()
server_pid=""
summary_written=0

log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*" | tee -a "${OUT}/run.log" >&2; }
record() {  # record STEP STATUS NOTE...
  local step="$1" status="$2"
  shift 2
  [[ -n "${result[${step}]+x}" ]] || steps+=("${step}")
  result[${step}]="${status}"
  note[${step}]="$*"
  log "${step}: ${status}${*:+ - $*}"
}
die() {  # die STEP MESSAGE: a step that later steps cannot do without failed.
  record "$1" FAILED "$2"
  exit 1
}

write_summary() {
  ((summary_written)) && return 0
  summary_written=1
  local failed=0 step
  {
    echo "== Stowage GPU host run: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname)"
    echo "repo:   ${repo_root} ($(git -C "${repo_root}" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
    echo "build:  ${build_dir}"
    echo "deps:   ${deps}"
    echo "output: ${OUT}"
    for step in "${steps[@]}"; do
      printf '  %-14s %-8s %s\n' "${step}" "${result[${step}]}" "${note[${step}]}"
      [[ "${result[${step}]}" == FAILED ]] && failed=$((failed + 1))
    done
    if ((failed)); then echo "RESULT: ${failed} step(s) FAILED"; else echo "RESULT: all steps passed"; fi
  } >"${OUT}/summary.txt"
  echo >&2
  cat "${OUT}/summary.txt" >&2
}

stop_server() {
  [[ -n "${server_pid}" ]] || return 0
  if kill -0 "${server_pid}" 2>/dev/null; then
    kill -TERM "${server_pid}" 2>/dev/null || true
    for _ in $(seq 1 30); do
      kill -0 "${server_pid}" 2>/dev/null || break
      sleep 0.5
    done
    if kill -0 "${server_pid}" 2>/dev/null; then
      log "server did not stop within 15 s of SIGTERM; sending SIGKILL"
      kill -KILL "${server_pid}" 2>/dev/null || true
    fi
  fi
  local rc=0
  wait "${server_pid}" 2>/dev/null || rc=$?
  server_pid=""
  return "${rc}"
}

on_exit() {
  local rc=$?
  stop_server || true
  rm -rf "${work}"
  write_summary
  local failed=0 step
  for step in "${steps[@]}"; do [[ "${result[${step}]}" == FAILED ]] && failed=1; done
  if ((rc == 0 && failed)); then rc=1; fi
  exit "${rc}"
}
trap on_exit EXIT
trap 'log "interrupted"; exit 130' INT TERM

: >"${OUT}/run.log"
log "Stowage build-and-serve: repo ${repo_root}, output ${OUT}"

# ---------------------------------------------------------------------------------------------
# 1. Prerequisites and the host's description.
# ---------------------------------------------------------------------------------------------
missing=()
for tool in cmake "${python}" g++; do command -v "${tool}" >/dev/null 2>&1 || missing+=("${tool}"); done
if ((${#missing[@]})); then
  record prerequisites FAILED "not found: ${missing[*]}"
  exit 2
fi
if [[ -x /usr/local/cuda/bin/nvcc ]] && ! command -v nvcc >/dev/null 2>&1; then
  export PATH="/usr/local/cuda/bin:${PATH}"
fi
generator=(-G Ninja)
command -v ninja >/dev/null 2>&1 || generator=(-G "Unix Makefiles")

if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L >"${OUT}/nvidia-smi.txt" 2>&1 || true
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"${OUT}/nvidia-smi.txt" 2>&1 || true
else
  echo "nvidia-smi not found" >"${OUT}/nvidia-smi.txt"
fi

if ! torch_info="$("${python}" - <<'PY' 2>"${OUT}/torch_probe.err"
import os, torch
print(torch.utils.cmake_prefix_path)
print(os.path.join(os.path.dirname(torch.__file__), "lib"))
print(torch.__version__)
print(torch.version.cuda or "none")
print(torch.cuda.is_available())
PY
)"; then
  record prerequisites FAILED "'${python} -c import torch' failed; see torch_probe.err"
  exit 2
fi
mapfile -t torch_lines <<<"${torch_info}"
torch_cmake_prefix="${torch_lines[0]}"
torch_lib_dir="${torch_lines[1]}"
torch_desc="torch ${torch_lines[2]}, CUDA ${torch_lines[3]}, cuda.is_available=${torch_lines[4]}"
{
  echo "uname: $(uname -a)"
  grep -E '^(PRETTY_NAME)=' /etc/os-release 2>/dev/null || true
  echo "g++: $(g++ --version | head -1)"
  echo "cmake: $(cmake --version | head -1)"
  echo "generator: ${generator[*]}"
  echo "nvcc: $(nvcc --version 2>/dev/null | tail -1 || echo 'not found')"
  echo "python: $(command -v "${python}") $("${python}" --version 2>&1)"
  echo "${torch_desc}"
  echo "torch cmake prefix: ${torch_cmake_prefix}"
  echo "cpus: $(nproc)"
  cat "${OUT}/nvidia-smi.txt"
} >"${OUT}/environment.txt" 2>&1
record prerequisites ok "${torch_desc}; $(head -1 "${OUT}/nvidia-smi.txt")"

# ---------------------------------------------------------------------------------------------
# 2. Unpack the Debian packages into the deps prefix (skipped when the same set is there already).
# ---------------------------------------------------------------------------------------------
# deploy/unpack_debs.sh does it: one line on stdout (the note), warnings and errors on stderr; exit 2
# when there are no .deb files (or the prefix is not one it may empty), 1 when unpacking failed.
multiarch="$(gcc -print-multiarch 2>/dev/null || true)"
multiarch="${multiarch:-x86_64-linux-gnu}"
deps_lib="${deps}/usr/lib/${multiarch}"
unpack_rc=0
unpack_note="$(bash "${repo_root}/deploy/unpack_debs.sh" "${deb_dir}" "${deps}" 2>"${work}/unpack.err")" || unpack_rc=$?
while IFS= read -r line; do  # Warnings (and dpkg's messages); the error goes into the record below.
  [[ "${line}" == "unpack_debs.sh: error: "* ]] || log "${line}"
done <"${work}/unpack.err"
unpack_error="$(sed -n 's/^unpack_debs\.sh: error: //p' "${work}/unpack.err" | tail -n 1)"
if ((unpack_rc == 2)); then
  record unpack FAILED "${unpack_error:-deploy/unpack_debs.sh exited with status 2}"
  exit 2
elif ((unpack_rc != 0)); then
  die unpack "${unpack_error:-deploy/unpack_debs.sh exited with status ${unpack_rc}}"
fi
record unpack ok "${unpack_note}"

# Run-time library path of everything built here (the tests, the server, stowctl): the prefix's
# libraries, then torch's. Python is run without it (grpcio and protobuf bring their own).
run_ld_path="${deps_lib}:${torch_lib_dir}${LD_LIBRARY_PATH:+:${LD_LIBRARY_PATH}}"
echo "LD_LIBRARY_PATH=${run_ld_path}" >>"${OUT}/environment.txt"

# ---------------------------------------------------------------------------------------------
# 3. Configure and build.
# ---------------------------------------------------------------------------------------------
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"  # H200; avoids torch's GPU probing.
configure_args=(
  -S "${repo_root}" -B "${build_dir}" "${generator[@]}"
  -DCMAKE_BUILD_TYPE=Release
  "-DCMAKE_PREFIX_PATH=${torch_cmake_prefix}"
  "-DSTOWAGE_DEPS_PREFIX=${deps}"
  "-DSTOWAGE_CUDA=${STOWAGE_CUDA:-AUTO}"
  "-DPython3_EXECUTABLE=$(command -v "${python}")"
)
log "configuring: cmake ${configure_args[*]}"
if ! cmake "${configure_args[@]}" >"${OUT}/cmake_configure.log" 2>&1; then
  tail -n 40 "${OUT}/cmake_configure.log" >&2
  die configure "cmake configure failed; see cmake_configure.log"
fi
with_cuda="$(sed -n 's/^STOWAGE_WITH_CUDA:INTERNAL=//p' "${build_dir}/CMakeCache.txt")"
record configure ok "STOWAGE_WITH_CUDA=${with_cuda:-?}; $(grep -m1 'Stowage: LibTorch' "${OUT}/cmake_configure.log" | sed 's/^-- //')"

log "building with ${jobs} jobs (log: build.log)"
keep_going=(-- -k 0)
[[ "${generator[*]}" == *Ninja* ]] || keep_going=(-- -k)
build_start=${SECONDS}
# STOWAGE_BUILD_TARGETS (space-separated CMake targets): build only those, then stop (no serving).
targets=()
read -ra named_targets <<<"${STOWAGE_BUILD_TARGETS:-}"
for t in ${named_targets[@]+"${named_targets[@]}"}; do targets+=(--target "$t"); done
if cmake --build "${build_dir}" -j "${jobs}" ${targets[@]+"${targets[@]}"} "${keep_going[@]}" >"${OUT}/build.log" 2>&1; then
  build_status=ok
else
  build_status=FAILED
fi
tail -n 60 "${OUT}/build.log" >"${OUT}/build_tail.log"
grep -E 'error:|undefined reference|FAILED:' "${OUT}/build.log" | head -n 80 >"${OUT}/build_errors.log" || true
server_bin="${build_dir}/server/stowage_server"
stowctl_bin="${build_dir}/clients/stowctl/stowctl"
if [[ "${build_status}" == ok ]]; then
  record build ok "$((SECONDS - build_start)) s"
else
  record build FAILED "$((SECONDS - build_start)) s; first errors in build_errors.log"
  head -n 20 "${OUT}/build_errors.log" >&2 || true
fi
if ((${#targets[@]})); then
  record serve skipped "STOWAGE_BUILD_TARGETS: only ${STOWAGE_BUILD_TARGETS} built"
  record ctest skipped "STOWAGE_BUILD_TARGETS"
  [[ "${build_status}" == ok ]] && exit 0 || exit 1
fi
[[ -x "${server_bin}" ]] || die server "stowage_server was not built; nothing to serve"

# ---------------------------------------------------------------------------------------------
# The thread-stack shim (thread_stack_shim.c explains): built on first use.
# ---------------------------------------------------------------------------------------------
shim_mode="${STOWAGE_THREAD_STACK_SHIM:-auto}"
case "${shim_mode}" in auto | always | never) ;; *)
  record prerequisites FAILED "STOWAGE_THREAD_STACK_SHIM must be auto, always or never (got '${shim_mode}')"
  exit 2 ;;
esac
shim_so=""
civet_error='null context when constructing CivetServer'
civet_explained="civetweb's fixed 100 KiB thread stacks cannot hold the CUDA LibTorch's static TLS"
build_shim() {
  [[ -z "${shim_so}" ]] || return 0
  local so="${build_dir}/thread_stack_shim.so"
  if "${CC:-gcc}" -shared -fPIC -O2 -o "${so}" "${repo_root}/deploy/gpu_host/thread_stack_shim.c" -ldl \
      >"${OUT}/shim_build.log" 2>&1; then
    shim_so="${so}"
  else
    log "cannot build thread_stack_shim.so; see shim_build.log"
    return 1
  fi
}
preload=""
if [[ "${shim_mode}" == always ]] && build_shim; then preload="${shim_so}"; fi

# ---------------------------------------------------------------------------------------------
# 4. Unit tests.
# ---------------------------------------------------------------------------------------------
run_ctest() {  # run_ctest LOG PRELOAD [ctest args]
  local ctest_log="$1" ctest_preload="$2"
  shift 2
  (cd "${build_dir}" && LD_PRELOAD="${ctest_preload}" LD_LIBRARY_PATH="${run_ld_path}" \
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}" ctest --output-on-failure -j "${ctest_jobs}" "$@") >"${ctest_log}" 2>&1
}
ctest_line() { grep -E 'tests passed|tests failed' "$1" | tail -n 1; }
if [[ "${STOWAGE_SKIP_TESTS:-0}" == 1 ]]; then
  record ctest skipped "STOWAGE_SKIP_TESTS=1"
else
  log "running ctest (-j ${ctest_jobs}; log: ctest.log)"
  if run_ctest "${OUT}/ctest.log" "${preload}" --output-junit "${OUT}/ctest_junit.xml"; then
    record ctest ok "$(ctest_line "${OUT}/ctest.log")${preload:+ (thread-stack shim preloaded)}"
  else
    record ctest FAILED "$(ctest_line "${OUT}/ctest.log"); see ctest.log"
    sed -n '/The following tests FAILED/,$p' "${OUT}/ctest.log" >&2 || true
    if [[ "${shim_mode}" == auto ]] && grep -q "${civet_error}" "${OUT}/ctest.log" && build_shim; then
      log "some tests hit '${civet_error}' (${civet_explained}); re-running the failed tests with the shim"
      if run_ctest "${OUT}/ctest_shim.log" "${shim_so}" --rerun-failed; then
        record ctest_shim ok "failed tests re-run with thread_stack_shim.so: $(ctest_line "${OUT}/ctest_shim.log")"
      else
        record ctest_shim FAILED "failed tests re-run with thread_stack_shim.so: $(ctest_line "${OUT}/ctest_shim.log"); see ctest_shim.log"
      fi
    fi
  fi
fi

# ---------------------------------------------------------------------------------------------
# 5. Start the server on free ports and wait for its port file.
# ---------------------------------------------------------------------------------------------
port_file="${work}/ports.json"
waited=0
server_rc=0
start_server() {  # start_server PRELOAD: 0 serving, 1 exited before serving, 2 timed out
  rm -f "${port_file}"
  log "starting ${server_bin}${1:+ with LD_PRELOAD=$1}"
  LD_PRELOAD="$1" LD_LIBRARY_PATH="${run_ld_path}" "${server_bin}" "${server_args[@]}" \
    --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 --port_file="${port_file}" \
    >"${OUT}/server.log" 2>&1 &
  server_pid=$!
  waited=0
  while [[ ! -s "${port_file}" ]]; do
    if ! kill -0 "${server_pid}" 2>/dev/null; then
      server_rc=0
      wait "${server_pid}" || server_rc=$?
      server_pid=""
      return 1
    fi
    ((waited < startup_timeout * 2)) || return 2
    sleep 0.5
    waited=$((waited + 1))
  done
}
read -r -a server_args <<<"${STOWAGE_SERVER_ARGS:-}"
server_status=0
shim_note="${preload:+; thread-stack shim preloaded}"
start_server "${preload}" || server_status=$?
if ((server_status == 1)) && [[ "${shim_mode}" == auto ]] && grep -q "${civet_error}" "${OUT}/server.log" &&
    build_shim; then
  mv "${OUT}/server.log" "${OUT}/server_noshim.log"
  record server_noshim FAILED "metrics exporter did not start (${civet_explained}); see server_noshim.log; retrying with LD_PRELOAD=thread_stack_shim.so"
  shim_note="; only with thread_stack_shim.so preloaded"
  server_status=0
  start_server "${shim_so}" || server_status=$?
fi
if ((server_status == 1)); then
  tail -n 30 "${OUT}/server.log" >&2
  die server "stowage_server exited with status ${server_rc} before serving: $(tail -n 1 "${OUT}/server.log")"
elif ((server_status == 2)); then
  die server "no port file after ${startup_timeout} s; see server.log"
fi
cp "${port_file}" "${OUT}/ports.json"
mapfile -t addresses < <("${python}" -c '
import json, sys
d = json.load(open(sys.argv[1]))
print(d["grpc_address"]); print(d.get("metrics_address", ""))' "${port_file}")
grpc_address="${addresses[0]:-}"
metrics_address="${addresses[1]:-}"
[[ -n "${grpc_address}" ]] || die server "cannot read grpc_address from the port file: $(cat "${port_file}")"
device="$(grep -o 'device [^ ,]*' "${OUT}/server.log" | head -1 | cut -d' ' -f2 || true)"
server_note="gRPC ${grpc_address}, metrics ${metrics_address:-none}, device ${device:-?} after $((waited / 2)) s${shim_note}"
if ((${#server_args[@]})); then
  record server ok "${server_note}; extra flags: ${server_args[*]}"
elif [[ "${with_cuda}" == ON && "${device}" != cuda* ]]; then
  record server FAILED "${server_note}: built with CUDA but not serving on a CUDA device"
else
  record server ok "${server_note}"
fi

# ---------------------------------------------------------------------------------------------
# 6. One Generate request through the C++ client, or the Python one.
# ---------------------------------------------------------------------------------------------
server_gone() {  # Succeeds (printing why) when the server has exited since it started serving.
  sleep 1  # A server that is crashing may take a moment to go.
  if [[ -n "${server_pid}" ]] && kill -0 "${server_pid}" 2>/dev/null; then return 1; fi
  echo "; the server has exited: $(grep -m 2 -E 'terminate|what\(\)|Segmentation|Abort|F[0-9]{4}|rror' \
    "${OUT}/server.log" | tr '\n' ' ' | head -c 300)"
}

png_info() {  # png_info FILE: "WxH, N bytes" for a PNG; fails otherwise.
  "${python}" - "$1" <<'PY'
import struct, sys
data = open(sys.argv[1], "rb").read()
if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
    sys.exit(f"{sys.argv[1]} is not a PNG ({len(data)} bytes)")
w, h = struct.unpack(">II", data[16:24])
print(f"{w}x{h} PNG, {len(data)} bytes")
PY
}

generate_cpp() {
  local info=""
  log "Generate via stowctl"
  LD_LIBRARY_PATH="${run_ld_path}" "${stowctl_bin}" --target="${grpc_address}" pipelines \
    >"${OUT}/pipelines.txt" 2>&1 || true
  if LD_LIBRARY_PATH="${run_ld_path}" "${stowctl_bin}" --target="${grpc_address}" \
      --timeout="${request_timeout}" generate --prompt="${prompt}" --out="${OUT}/generate_cpp.png" \
      >"${OUT}/generate_cpp.txt" 2>&1 && info="$(png_info "${OUT}/generate_cpp.png" 2>&1)"; then
    record generate_cpp ok "${info}; stats in generate_cpp.txt"
  else
    record generate_cpp FAILED "$(tail -n 1 "${OUT}/generate_cpp.txt")${info:+; ${info}}$(server_gone || true)"
  fi
}

python_stubs() {  # Generates Python stubs into $work/pystubs; prints how.
  local stubs="${work}/pystubs"
  mkdir -p "${stubs}"
  local protos=(proto/stowage/v1/generation.proto proto/stowage/v1/config.proto)
  if "${python}" -c 'import grpc_tools.protoc' 2>/dev/null; then
    "${python}" -m grpc_tools.protoc -Iproto --python_out="${stubs}" --grpc_python_out="${stubs}" \
      "${protos[@]}" && echo "stubs from grpc_tools.protoc"
  elif [[ -x "${deps}/usr/bin/protoc" && -x "${deps}/usr/bin/grpc_python_plugin" ]]; then
    LD_LIBRARY_PATH="${deps_lib}" "${deps}/usr/bin/protoc" -Iproto -I"${deps}/usr/include" \
      --python_out="${stubs}" --grpc_python_out="${stubs}" \
      --plugin=protoc-gen-grpc_python="${deps}/usr/bin/grpc_python_plugin" "${protos[@]}" &&
      echo "stubs from protoc 3.21 + grpc_python_plugin"
  else
    echo "neither grpc_tools nor ${deps}/usr/bin/grpc_python_plugin is available" >&2
    return 1
  fi
}

generate_python() {
  log "Generate via the Python client"
  local how info=""
  if ! "${python}" -c 'import grpc, google.protobuf' 2>"${OUT}/generate_python.txt"; then
    record generate_py FAILED "${python} lacks grpcio/protobuf"
    return
  fi
  if ! how="$(python_stubs 2>>"${OUT}/generate_python.txt")"; then
    record generate_py FAILED "cannot generate stubs; see generate_python.txt"
    return
  fi
  if PYTHONPATH="${work}/pystubs:${repo_root}/clients/python" PYTHONDONTWRITEBYTECODE=1 \
      no_grpc_proxy=127.0.0.1,localhost "${python}" -m stowage_client --target "${grpc_address}" \
      --timeout "${request_timeout}" generate --prompt "${prompt}" --out "${OUT}/generate_py.png" \
      --json >"${OUT}/generate_py.json" 2>>"${OUT}/generate_python.txt" &&
      info="$(png_info "${OUT}/generate_py.png" 2>&1)"; then
    record generate_py ok "${info}; ${how}; stats in generate_py.json"
  else
    record generate_py FAILED "$(tail -n 1 "${OUT}/generate_python.txt")${info:+; ${info}}$(server_gone || true)"
  fi
}

case "${client_mode}" in
  auto) if [[ -x "${stowctl_bin}" ]]; then generate_cpp; else generate_python; fi ;;
  cpp)
    if [[ -x "${stowctl_bin}" ]]; then generate_cpp; else record generate_cpp FAILED "stowctl was not built"; fi ;;
  python) generate_python ;;
  both)
    if [[ -x "${stowctl_bin}" ]]; then generate_cpp; else record generate_cpp FAILED "stowctl was not built"; fi
    generate_python ;;
  *) record generate FAILED "STOWAGE_CLIENT must be auto, cpp, python or both (got '${client_mode}')" ;;
esac

# ---------------------------------------------------------------------------------------------
# 7. The metrics page.
# ---------------------------------------------------------------------------------------------
if [[ -z "${metrics_address}" ]]; then
  record metrics FAILED "the server reported no metrics address"
else
  url="http://${metrics_address}/metrics"
  if command -v curl >/dev/null 2>&1; then
    fetch=(curl -fsS --max-time 20 --noproxy '*' "${url}")
  else
    fetch=("${python}" -c 'import sys, urllib.request
h = urllib.request.ProxyHandler({})
sys.stdout.write(urllib.request.build_opener(h).open(sys.argv[1], timeout=20).read().decode())' "${url}")
  fi
  if "${fetch[@]}" >"${OUT}/metrics_full.txt" 2>"${OUT}/metrics_error.txt"; then
    grep -E '^(# (HELP|TYPE) )?stowage_' "${OUT}/metrics_full.txt" |
      grep -vE '_bucket\{' >"${OUT}/metrics.txt" || true
    ok_count="$(grep -E '^stowage_requests_total\{.*code="ok"' "${OUT}/metrics_full.txt" |
      awk '{ s += $NF } END { print s + 0 }')"
    if grep -q '^stowage_requests_total' "${OUT}/metrics_full.txt" && [[ "${ok_count%.*}" -ge 1 ]]; then
      record metrics ok "stowage_requests_total{code=\"ok\"} = ${ok_count}; excerpt in metrics.txt"
    else
      record metrics FAILED "no stowage_requests_total with code=\"ok\" on ${url}; see metrics_full.txt"
    fi
  else
    record metrics FAILED "cannot fetch ${url}: $(head -c 200 "${OUT}/metrics_error.txt")$(server_gone || true)"
  fi
fi

# ---------------------------------------------------------------------------------------------
# 8. Shut down cleanly.
# ---------------------------------------------------------------------------------------------
shutdown_rc=0
gone_before="$(server_gone || true)"
stop_server || shutdown_rc=$?
if [[ -n "${gone_before}" ]]; then
  record shutdown FAILED "exited with status ${shutdown_rc} before it was asked to stop${gone_before}"
elif ((shutdown_rc == 0)); then
  record shutdown ok "exit status 0 after SIGTERM"
else
  record shutdown FAILED "exit status ${shutdown_rc} after SIGTERM; see server.log"
fi
tail -n 40 "${OUT}/server.log" >"${OUT}/server_tail.log"
