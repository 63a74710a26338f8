# Sourced by the parity tests (zimage_parity_test.sh, flux_parity_test.sh). The caller sets $check
# (the comparison binary), $bf16 (its --bf16_tolerance) and optionally $skip (its --skip list).

# Adds 0.5 to every element of float32 tensor $2 of safetensors file $1, or without $2 of its first
# 2-D float32 weight by name. Pick a weight whose change the output must show: not one a following
# normalisation cancels (a constant added to every row of Flux's context_embedder is).
perturb() {
  /usr/bin/python3 - "$1" "${2:-}" <<'PY'
import json, struct, sys
path, name = sys.argv[1], sys.argv[2]
data = bytearray(open(path, "rb").read())
header_len = struct.unpack("<Q", data[:8])[0]
header = json.loads(data[8:8 + header_len])
if not name:
    name = next(k for k, v in sorted(header.items()) if k != "__metadata__" and v["dtype"] == "F32"
                and "weight" in k and len(v["shape"]) == 2)
info = header[name]
assert info["dtype"] == "F32", info
begin, end = (8 + header_len + o for o in info["data_offsets"])
values = struct.unpack(f"<{(end - begin) // 4}f", data[begin:end])
data[begin:end] = struct.pack(f"<{len(values)}f", *(v + 0.5 for v in values))
open(path, "wb").write(bytes(data))
print("perturbed", name, "in", path)
PY
}

# Runs the check on fixture copy $2 (label $1): it must exit 1 with the check matching regex $3 failed.
expect_failure() {
  set +e
  "$check" "$2" --bf16_tolerance="$bf16" ${skip:+--skip="$skip"} >"$TEST_TMPDIR/$1.txt" 2>&1
  local rc=$?
  set -e
  cat "$TEST_TMPDIR/$1.txt"
  [ "$rc" -eq 1 ] || { echo "$1: expected exit 1, got $rc"; exit 1; }
  grep -Eq "^$3 .*FAIL" "$TEST_TMPDIR/$1.txt" || { echo "$1: '$3' did not fail"; exit 1; }
}
