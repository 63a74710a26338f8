#!/usr/bin/env bash
# bench/png_bench: a small image, its rows well formed (each encoder, both images), the parallel
# writer's bytes the same at every thread count, and bad flags refused.
set -euo pipefail
bin=bench/png_bench
out=${TEST_TMPDIR:-$(mktemp -d)}/rows.jsonl
"$bin" --size=96 --iters=2 --threads=1,3,0 --machine=test --commit=abc --out="$out" >/dev/null
python3 - "$out" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 8, rows
for r in rows:
    assert r["bench"] == "png" and r["machine"] == "test" and r["commit"] == "abc", r
    assert r["width"] == r["height"] == 96 and r["median_ms"] >= r["min_ms"] > 0 and r["bytes"] > 0, r
for image in ("noise", "smooth"):
    parallel = {r["bytes"] for r in rows if r["image"] == image and r["encoder"] == "parallel"}
    assert len(parallel) == 1, (image, parallel)
    assert any(r["image"] == image and r["encoder"] == "libpng_level1" for r in rows), image
PY
if "$bin" --size=0 2>/dev/null; then echo "FAIL: --size=0 accepted" >&2; exit 1; fi
if "$bin" --size=8 --threads=x 2>/dev/null; then echo "FAIL: --threads=x accepted" >&2; exit 1; fi
echo PASS
