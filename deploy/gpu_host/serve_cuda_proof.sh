#!/usr/bin/env bash
# Proof of the user's GPU route on the GPU host: runs exactly
#
#   ./stowage serve --cuda --debs=.deb --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
#     --port_file=<tmp>/ports.json
#
# (the launcher unpacks the carried .deb files into build/cuda-deps instead of using apt, builds
# build/cuda with CMake against python3's pip torch, and execs the server), waits for the server's
# port file, then through build/cuda/clients/stowctl/stowctl: health, pipelines, one Generate
# (--seed=1), and the metrics page's stowage_requests_total lines; then stops the server.
#
# Run ON the GPU host from the repository root, with .deb/ (deploy/gpu_host/fetch_debs.sh) carried:
#
#   OUT=/some/dir STOWAGE_COMMIT=<sha> bash deploy/gpu_host/serve_cuda_proof.sh
#
# Environment: OUT (default ./gpu_out), STOWAGE_COMMIT (recorded in the summary; the host's tree may
# not be a git checkout), STOWAGE_STARTUP_TIMEOUT (seconds for build + start-up, default 300),
# STOWAGE_REQUEST_TIMEOUT (Generate deadline, default 300), STOWAGE_PROMPT.
# Writes under $OUT: serve_cuda.log (the launcher's and the server's output), serve_cuda_health.txt,
# serve_cuda_pipelines.txt, serve_cuda_generate.txt, serve_cuda.png, serve_cuda_metrics.txt,
# serve_cuda_ports.json, and serve_cuda_summary.txt (each step ok/FAILED). Exit status 0 only when
# every step passed.
set -uo pipefail

repo_root="$(cd "$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")/../.." && pwd)"
cd "${repo_root}" || exit 2
OUT="${OUT:-${repo_root}/gpu_out}"
mkdir -p "${OUT}"
OUT="$(cd "${OUT}" && pwd)"
startup_timeout="${STOWAGE_STARTUP_TIMEOUT:-300}"
request_timeout="${STOWAGE_REQUEST_TIMEOUT:-300}"
prompt="${STOWAGE_PROMPT:-a lighthouse on a cliff at dusk}"
commit="${STOWAGE_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
tmp="$(mktemp -d /tmp/stowage-serve-cuda.XXXXXX)"
ports="${tmp}/ports.json"
log_file="${OUT}/serve_cuda.log"
summary="${OUT}/serve_cuda_summary.txt"
stowctl="${repo_root}/build/cuda/clients/stowctl/stowctl"
start=${SECONDS}

steps=()
declare -A result=() note=()
record() {  # record STEP ok|FAILED NOTE...
  local step="$1" status="$2"
  shift 2
  [[ -n "${result[${step}]+x}" ]] || steps+=("${step}")
  result[${step}]="${status}"
  note[${step}]="$*"
  printf '[%4d s] %-10s %-6s %s\n' "$((SECONDS - start))" "${step}" "${status}" "$*" >&2
}

server_pid=""
# SIGTERM to the process group (setsid below made it the launcher's own: while it builds, the
# launcher and its compilers; once it has exec'd the server, the server alone), 20 s, then SIGKILL.
stop_server() {
  [[ -n "${server_pid}" ]] || return 0
  local rc=0
  if kill -0 -- "-${server_pid}" 2>/dev/null; then
    kill -TERM -- "-${server_pid}" 2>/dev/null
    for _ in $(seq 40); do kill -0 -- "-${server_pid}" 2>/dev/null || break; sleep 0.5; done
    if kill -0 -- "-${server_pid}" 2>/dev/null; then
      echo "process group ${server_pid} did not stop within 20 s of SIGTERM; SIGKILL" >&2
      kill -KILL -- "-${server_pid}" 2>/dev/null
    fi
  fi
  wait "${server_pid}" 2>/dev/null || rc=$?
  server_pid=""
  return "${rc}"
}

write_summary() {
  local failed=0 step
  {
    echo "== ./stowage serve --cuda --debs=.deb on the GPU host: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit:  ${commit}"
    echo "gpu:     ${gpu_name:-?}"
    echo "command: ./stowage serve --cuda --debs=.deb --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 --port_file=${ports}"
    echo "device:  server ${server_device:-?}, Generate ${generate_device:-?}"
    echo "plan (the launcher's lines):"
    sed 's/\x1b\[[0-9;]*m//g' "${log_file}" 2>/dev/null | grep -E '^\[stowage\] (GPU|install|configure|build|serve): ' |
      sed 's/^/  /'
    echo "steps:"
    for step in "${steps[@]}"; do
      printf '  %-10s %-6s %s\n' "${step}" "${result[${step}]}" "${note[${step}]}"
      [[ "${result[${step}]}" == ok ]] || failed=$((failed + 1))
    done
    if ((failed)); then echo "RESULT: ${failed} step(s) FAILED"; else echo "RESULT: all steps passed"; fi
  } >"${summary}"
  echo >&2
  cat "${summary}" >&2
  return $((failed > 0))
}

on_exit() {
  local rc=$?
  stop_server >/dev/null 2>&1
  rm -rf "${tmp}"
  write_summary || rc=1
  exit "${rc}"
}
trap on_exit EXIT
trap 'echo interrupted >&2; exit 130' INT TERM

# 1. The GPU.
gpu_name="$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
if [[ -n "${gpu_name}" ]]; then
  record gpu ok "${gpu_name} ($(nvidia-smi --query-gpu=driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1))"
else
  record gpu FAILED "nvidia-smi found no GPU"
fi
shopt -s nullglob
debs=(.deb/*.deb)
shopt -u nullglob
((${#debs[@]})) || { record serve FAILED "no .deb files in ${repo_root}/.deb; carry the folder from deploy/gpu_host/fetch_debs.sh"; exit 1; }

# 2. The route: build (unpack, configure, compile) and start; ready when the port file is written.
# setsid: the launcher and what it runs get their own process group (the launcher execs the
# server, so the pid stays the server's; a build that hangs can be stopped as a group).
setsid ./stowage serve --cuda --debs=.deb --grpc_address=127.0.0.1:0 --metrics_address=127.0.0.1:0 \
  --port_file="${ports}" >"${log_file}" 2>&1 </dev/null &
server_pid=$!
while [[ ! -s "${ports}" ]]; do
  if ! kill -0 "${server_pid}" 2>/dev/null; then
    rc=0
    wait "${server_pid}" || rc=$?
    server_pid=""
    tail -n 30 "${log_file}" >&2
    record serve FAILED "./stowage exited with status ${rc} after $((SECONDS - start)) s, before serving: $(sed 's/\x1b\[[0-9;]*m//g' "${log_file}" | grep -m1 -E 'error|FAILED' | head -c 300)"
    exit 1
  fi
  if ((SECONDS - start > startup_timeout)); then
    tail -n 30 "${log_file}" >&2
    record serve FAILED "no port file after ${startup_timeout} s (build + start-up); see serve_cuda.log"
    exit 1
  fi
  sleep 1
done
cp "${ports}" "${OUT}/serve_cuda_ports.json"
grpc_address="$(sed -E 's/.*"grpc_address": "([^"]*)".*/\1/' "${ports}")"
metrics_address="$(sed -E 's/.*"metrics_address": "([^"]*)".*/\1/' "${ports}")"
server_device="$(sed -n 's/^stowage_server: serving gRPC on .*, device \([^ ]*\)$/\1/p' "${log_file}" | head -1)"
serving_note="gRPC ${grpc_address}, metrics ${metrics_address:-none}, device ${server_device:-?}, serving $((SECONDS - start)) s after the command (unpack + build + start-up)"
if ! grep -q 'install: nothing with apt (--debs)' "${log_file}"; then
  record serve FAILED "${serving_note}; the launcher's plan did not take the --debs route"
elif grep -qE '^(Get|Hit|Err):[0-9]+ |apt-get (update|install)' "${log_file}"; then
  record serve FAILED "${serving_note}; apt ran"
elif [[ "${server_device}" != cuda:* ]]; then
  record serve FAILED "${serving_note}: not serving on a CUDA device"
else
  record serve ok "${serving_note}"
fi

# The server's library path, read from the launcher's serve: line (prefix's libraries, then torch's).
ld_path="$(sed 's/\x1b\[[0-9;]*m//g' "${log_file}" | sed -n 's/.*serve: env LD_LIBRARY_PATH=\([^ ]*\) .*/\1/p' | head -1)"
ctl() { LD_LIBRARY_PATH="${ld_path}" "${stowctl}" --target="${grpc_address}" "$@"; }
server_gone() {  # Prints why when the server has exited.
  if kill -0 "${server_pid}" 2>/dev/null; then return 1; fi
  echo "; the server has exited: $(grep -m 2 -E 'terminate|what\(\)|Segmentation|Abort|rror' "${log_file}" | tr '\n' ' ' | head -c 300)"
}

# 3. health, pipelines, Generate.
if ! [[ -x "${stowctl}" ]]; then
  record health FAILED "${stowctl} was not built"
else
  if ctl --timeout=30 health >"${OUT}/serve_cuda_health.txt" 2>&1 && grep -qx SERVING "${OUT}/serve_cuda_health.txt"; then
    record health ok "$(head -n 1 "${OUT}/serve_cuda_health.txt")"
  else
    record health FAILED "$(tail -n 1 "${OUT}/serve_cuda_health.txt")$(server_gone)"
  fi
  if ctl --timeout=30 pipelines >"${OUT}/serve_cuda_pipelines.txt" 2>&1 &&
      grep -q ' on cuda:' "${OUT}/serve_cuda_pipelines.txt"; then
    record pipelines ok "$(head -n 1 "${OUT}/serve_cuda_pipelines.txt" | cut -c 1-160)"
  else
    record pipelines FAILED "$(tail -n 1 "${OUT}/serve_cuda_pipelines.txt" | cut -c 1-200) (expected a pipeline on cuda:N)$(server_gone)"
  fi
  rm -f "${OUT}/serve_cuda.png"
  if ctl --timeout="${request_timeout}" generate --prompt="${prompt}" --seed=1 --out="${OUT}/serve_cuda.png" \
      >"${OUT}/serve_cuda_generate.txt" 2>&1; then
    generate_device="$(awk '$1 == "device" && NF == 2 { print $2; exit }' "${OUT}/serve_cuda_generate.txt")"
    magic="$(head -c 8 "${OUT}/serve_cuda.png" 2>/dev/null | od -An -tx1 | tr -d ' \n')"
    run_time="$(sed -n 's/^run time  *//p' "${OUT}/serve_cuda_generate.txt" | head -1)"
    if [[ "${magic}" != 89504e470d0a1a0a ]]; then
      record generate FAILED "serve_cuda.png is not a PNG"
    elif [[ "${generate_device}" != cuda:* ]]; then
      record generate FAILED "the request ran on '${generate_device}', not on CUDA"
    else
      record generate ok "$(sed -n 's/^image  *//p' "${OUT}/serve_cuda_generate.txt" | head -1 | sed 's/ ->.*//'); device ${generate_device}; run time ${run_time}"
    fi
  else
    record generate FAILED "$(tail -n 1 "${OUT}/serve_cuda_generate.txt")$(server_gone)"
  fi
fi

# 4. The metrics page: the request counter.
url="http://${metrics_address}/metrics"
if [[ -z "${metrics_address}" ]]; then
  record metrics FAILED "the port file names no metrics address"
elif curl -fsS --max-time 20 --noproxy '*' "${url}" >"${tmp}/metrics_full.txt" 2>"${tmp}/metrics_error.txt" ||
    python3 -c 'import sys, urllib.request
sys.stdout.write(urllib.request.build_opener(urllib.request.ProxyHandler({})).open(sys.argv[1], timeout=20).read().decode())' \
      "${url}" >"${tmp}/metrics_full.txt" 2>>"${tmp}/metrics_error.txt"; then
  grep '^stowage_requests_total' "${tmp}/metrics_full.txt" >"${OUT}/serve_cuda_metrics.txt"
  ok_count="$(grep -E '^stowage_requests_total\{.*code="ok"' "${OUT}/serve_cuda_metrics.txt" | awk '{ s += $NF } END { print s + 0 }')"
  if [[ "${ok_count%.*}" -ge 1 ]]; then
    record metrics ok "$(tr '\n' ' ' <"${OUT}/serve_cuda_metrics.txt" | head -c 300)"
  else
    record metrics FAILED "no stowage_requests_total with code=\"ok\" on ${url}: $(tr '\n' ' ' <"${OUT}/serve_cuda_metrics.txt" | head -c 200)"
  fi
else
  record metrics FAILED "cannot fetch ${url}: $(head -c 200 "${tmp}/metrics_error.txt")$(server_gone)"
fi

# 5. Stop: SIGTERM, exit status 0.
gone="$(server_gone)"
shutdown_rc=0
stop_server || shutdown_rc=$?
if [[ -n "${gone}" ]]; then
  record shutdown FAILED "the server exited (status ${shutdown_rc}) before it was asked to stop${gone}"
elif ((shutdown_rc == 0)); then
  record shutdown ok "exit status 0 after SIGTERM"
else
  record shutdown FAILED "exit status ${shutdown_rc} after SIGTERM; see serve_cuda.log"
fi
