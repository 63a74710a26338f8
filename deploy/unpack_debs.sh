#!/usr/bin/env bash
# Unpacks a folder of Debian .deb files into a prefix (PREFIX/usr/include, PREFIX/usr/lib/<multiarch>,
# PREFIX/usr/bin) without installing anything: for a machine without network or apt, which builds
# against the prefix with CMake (-DSTOWAGE_DEPS_PREFIX=PREFIX) and runs with
# PREFIX/usr/lib/<multiarch> on LD_LIBRARY_PATH. Used by `./stowage serve --cuda --debs=DIR` and
# deploy/gpu_host/build_and_serve.sh; the .deb files come from deploy/gpu_host/fetch_debs.sh.
#
# Usage: deploy/unpack_debs.sh DEB_DIR PREFIX
#
# Idempotent: PREFIX/.stowage-stamp records the set unpacked (file names and sizes); when it matches
# DEB_DIR's, nothing is done. Otherwise PREFIX is emptied and every package unpacked again (dpkg -x;
# without dpkg, ar + tar). Debian's absolute symlinks (libz.so -> /lib/x86_64-linux-gnu/libz.so.1...)
# are re-pointed into PREFIX, or at the host's library of the same name when PREFIX lacks it.
#
# Output: one line on stdout saying what was done; warnings and errors on stderr.
# Exit status: 0 done (or already done); 1 unpacking failed; 2 usage error, no .deb files in DEB_DIR,
# or a PREFIX this script will not empty.
set -euo pipefail

me="unpack_debs.sh"
usage() { echo "usage: deploy/unpack_debs.sh DEB_DIR PREFIX" >&2; exit 2; }
fail() { echo "${me}: error: $*" >&2; exit "${code:-1}"; }
warn() { echo "${me}: warning: $*" >&2; }

(($# == 2)) || usage
deb_dir="$1"
deps="$2"
[[ -n "${deb_dir}" && -n "${deps}" ]] || usage
code=2
[[ -d "${deb_dir}" ]] || fail "${deb_dir} is not a folder of .deb files"
shopt -s nullglob
debs=("${deb_dir}"/*.deb)
shopt -u nullglob
((${#debs[@]})) || fail "no .deb files in ${deb_dir}; run deploy/gpu_host/fetch_debs.sh on the Debian machine and carry .deb/ along"
# The prefix is emptied before unpacking: never /, and never a folder that is not ours.
mkdir -p "${deps}" || fail "cannot create ${deps}"
deps="$(cd "${deps}" && pwd -P)"
[[ "${deps}" != / ]] || fail "PREFIX is /"
if [[ ! -f "${deps}/.stowage-stamp" && ! -f "${deps}/.stowage-partial" ]] &&
    [[ -n "$(ls -A "${deps}")" ]]; then
  fail "${deps} is not empty and holds no unpacked packages of ours (.stowage-stamp); give an empty or new folder"
fi
code=1
if ! command -v dpkg >/dev/null 2>&1; then
  for tool in ar tar; do command -v "${tool}" >/dev/null 2>&1 || fail "neither dpkg nor ${tool} is available"; done
fi

multiarch="$(gcc -print-multiarch 2>/dev/null || true)"
multiarch="${multiarch:-x86_64-linux-gnu}"
deps_lib="${deps}/usr/lib/${multiarch}"
stamp="$(for d in "${debs[@]}"; do printf '%s %s\n' "$(basename "${d}")" "$(stat -c %s "${d}")"; done | sha256sum | cut -d' ' -f1)"
if [[ -f "${deps}/.stowage-stamp" && "$(cat "${deps}/.stowage-stamp")" == "${stamp}" ]]; then
  [[ -d "${deps_lib}" ]] || fail "${deps_lib} does not exist (the stamp says ${deps} is unpacked; remove ${deps} and run again)"
  echo "${#debs[@]} packages already unpacked in ${deps}"
  exit 0
fi

find "${deps}" -mindepth 1 -delete
: >"${deps}/.stowage-partial"
for deb in "${debs[@]}"; do
  if command -v dpkg >/dev/null 2>&1; then
    dpkg -x "${deb}" "${deps}" || fail "dpkg -x ${deb} failed"
  else  # No dpkg: a .deb is an ar archive holding data.tar.{xz,zst,gz}.
    member="$(ar t "${deb}" | grep '^data\.tar' | head -1)" || fail "${deb} is not a Debian package (no data.tar member)"
    case "${member}" in
      *.xz) z=(-J) ;; *.zst) z=(--zstd) ;; *.gz) z=(-z) ;; *) z=() ;;
    esac
    ar p "${deb}" "${member}" | tar -x "${z[@]}" -C "${deps}" || fail "cannot unpack ${deb}"
  fi
done
# Debian's -dev link names can be absolute (libz.so -> /lib/x86_64-linux-gnu/libz.so.1.2.13).
# Point them into the prefix, or at the host's library of the same name when the prefix lacks it.
relinked=()
while IFS= read -r -d '' link; do
  target="$(readlink "${link}")"
  [[ "${target}" == /* ]] || continue
  if [[ -e "${deps}${target}" ]]; then
    ln -sfn "${deps}${target}" "${link}"
  elif [[ ! -e "${target}" ]]; then
    name="$(basename "${link}")"
    host_lib=""
    for cand in /usr/lib/"${multiarch}"/"${name}".* /lib/"${multiarch}"/"${name}".*; do
      [[ -e "${cand}" ]] || continue
      if [[ -z "${host_lib}" || ${#cand} -lt ${#host_lib} ]]; then host_lib="${cand}"; fi
    done
    if [[ -n "${host_lib}" ]]; then
      ln -sfn "${host_lib}" "${link}"
      relinked+=("${name}->${host_lib}")
    else
      warn "${link} -> ${target} is dangling and the host has no ${name}.*"
    fi
  fi
done < <(find "${deps}" -type l -print0)
[[ -d "${deps_lib}" ]] || fail "${deps_lib} does not exist after unpacking"
echo "${stamp}" >"${deps}/.stowage-stamp"
rm -f "${deps}/.stowage-partial"
echo "${#debs[@]} packages into ${deps}${relinked:+; re-pointed ${relinked[*]}}"
