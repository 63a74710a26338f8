#!/usr/bin/env bash
# bench/multi_tenant.py end to end on the simulated device: tiny Z-Image and Flux folders, four
# pipelines (two of them drawn with their own transformer seed, sharing the rest by content) under a
# budget that holds no two transformers, a short seeded trace replayed by three strategies (on one
# server: the budget set after the resident rows, FIFO and the scheduler switched at run time) and
# the flood phase; each row has the fields the benchmark promises, every request succeeds within the
# budget, the components are shared, and the scheduler's reorders are in its placement log.
set -euo pipefail
here=$(pwd)  # Holds server/, clients/, bench/ and tests/ (Bazel's runfiles root).
scripts=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
/usr/bin/python3 "$scripts/make_zimage_random_dir.py" "$TEST_TMPDIR/zimage" --size tiny >/dev/null
/usr/bin/python3 "$scripts/make_flux_random_dir.py" "$TEST_TMPDIR/flux" --size tiny \
  --tokenizers "$here/tests/fixtures/flux_tiny/pipeline" >/dev/null
run() {
  /usr/bin/python3 "$scripts/multi_tenant.py" stowage --server "$here/server/stowage_server" \
    --stowctl "$here/clients/stowctl/stowctl" --zimage "$TEST_TMPDIR/zimage" --flux "$TEST_TMPDIR/flux" \
    --device sim --dtype float32 --size 64 --steps zimage=2,zimage-ft=2,flux-schnell=1,flux-dev=3 \
    --requests 24 --rate 40 --flood_requests 6 --flood_rate 40 --flood_lead_s 0.2 --budget_gib 0.003 --flux_keep_gib 0.0005 \
    --reorder_ms 2000 --machine ci --commit test "$@"
}
run --out "$TEST_TMPDIR/rows.jsonl" --logs "$TEST_TMPDIR/logs" --preemption resident >"$TEST_TMPDIR/out.txt"
/usr/bin/python3 - "$TEST_TMPDIR/rows.jsonl" "$TEST_TMPDIR/logs" "$TEST_TMPDIR/out.txt" <<'PY'
import json, os, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
main = [r for r in rows if r.get("phase") != "flood"]
flood = [r for r in rows if r.get("phase") == "flood"]
assert sorted({r["strategy"] for r in main}) == ["fifo", "resident", "scheduler"], rows
fields = ("p50_s", "p99_s", "resident_p50_s", "resident_p99_s", "images_per_s", "bytes_moved_per_request",
          "peak_device_bytes", "peak_nvidia_smi_bytes", "budget_bytes", "ok", "machine", "commit", "trace")
for r in main:
    assert r["bench"] == "multi_tenant", r
    for field in fields:
        assert field in r, (field, r)
    assert r["ok"] and not r["errors"], r
    assert r["p50_s"] > 0 and r["resident_p50_s"] > 0 and r["p99_s"] >= r["p50_s"], r
    if r["strategy"] != "resident":
        assert r["budget_bytes"] == int(0.003 * 2**30) and 0 < r["peak_device_bytes"] <= r["budget_bytes"], r
    if r["pipeline"] == "all":
        assert r["requests"] == 24 and r["images_per_s"] > 0, r
    # Preemption (--preemption resident) is the scheduler strategy's only; each row counts its
    # requests that were paused for others.
    assert r["serving"]["preemption"] == ("resident" if r["strategy"] == "scheduler" else "none"), r
    assert r["preempted"] >= 0 and r["mean_preempted_s"] >= 0, r
    if r["strategy"] != "scheduler":
        assert r["preempted"] == 0, r
# The same seeded trace for every strategy: the same requests per pipeline.
per = {}
for r in main:
    per.setdefault(r["pipeline"], set()).add(r["requests"])
assert all(len(v) == 1 for v in per.values()), per
assert per["zimage"] == {max(n for k, v in per.items() if k != "all" for n in v)}, per  # Zipf: zimage is hot.
assert len(flood) == 1 and flood[0]["ok"] and flood[0]["alone_p99_s"] > 0 and flood[0]["flood_images"] > 0, flood
# Shared by content: one Qwen3, one T5, one CLIP, one VAE per family; four transformers.
placement = open(os.path.join(sys.argv[2], "scheduler.placement.txt")).read()
for component in ("zimage/transformer", "zimage-ft/transformer", "flux-dev/transformer",
                  "flux-schnell/transformer", "zimage/text_encoder", "flux-schnell/text_encoder_2"):
    assert component in placement, (component, placement[:3000])
for absent in ("zimage-ft/text_encoder", "flux-dev/text_encoder_2", "flux-dev/vae "):
    assert absent not in placement, (absent, placement[:3000])
log = open(os.path.join(sys.argv[2], "scheduler.placement_log.txt")).read()
assert "schedule" in log, log[:2000]
# The three strategies ran on one loaded server (one_server.log): resident without a budget, then the
# budget set at run time (SetMemoryBudget: FIFO's decisions begin with it and the moves it made), FIFO
# and the scheduler switched with SetScheduler; each kept its own slice of the server log and of the
# decisions.
one = open(os.path.join(sys.argv[2], "one_server.log")).read()
assert "starting:" in one and "admin set_memory_budget" in one, one[-3000:]
assert "starting:" not in open(os.path.join(sys.argv[2], "scheduler.log")).read()
fifo_log = open(os.path.join(sys.argv[2], "fifo.placement_log.txt")).read()
assert "set_budget" in fifo_log and "memory budget set to" in fifo_log, fifo_log[:3000]
assert "set_budget" not in open(os.path.join(sys.argv[2], "resident.placement_log.txt")).read()
def reorders(name):
    lines = open(os.path.join(sys.argv[2], name)).read().splitlines()
    return [l for l in lines if "schedule" in l.split()[1:3]]
assert reorders("scheduler.placement_log.txt") and not reorders("fifo.placement_log.txt")
assert "| strategy | pipeline |" in open(sys.argv[3]).read()
print("ok")
PY
# Where the time went: each strategy's measured requests (the trace's 24, the warm-up left out) and
# its onloads.
/usr/bin/python3 "$scripts/multi_tenant.py" analyze "$TEST_TMPDIR/logs" "$TEST_TMPDIR/rows.jsonl" >"$TEST_TMPDIR/analysis.txt"
for strategy in resident fifo scheduler; do
  grep -q "^$strategy: 24 measured requests, mean run .* s, utilisation at 40.0/s" "$TEST_TMPDIR/analysis.txt" ||
    { cat "$TEST_TMPDIR/analysis.txt"; exit 1; }
done
grep -q "onloads: .*zimage/transformer" "$TEST_TMPDIR/analysis.txt"
# Each pipeline's stage medians from the request lines; the budgeted strategies' beside resident's.
/usr/bin/python3 - "$TEST_TMPDIR/analysis.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
resident = text.split("\nfifo:", 1)[0]
assert re.search(r"\n    stage p50: tokenize [0-9.]+ s, encode_prompt [0-9.]+ s, denoise [0-9.]+ s, decode [0-9.]+ s, "
                 r"encode_image [0-9.]+ s\n", resident), resident
scheduler = text.split("\nscheduler:", 1)[1]
assert re.search(r"denoise [0-9.]+ s \([0-9.]+x resident\)", scheduler), scheduler
PY
# The server's thread renewals (after allocator out-of-memory errors) counted per strategy: the same
# logs with two such lines added to the resident strategy's (unbudgeted: none of its own).
mkdir -p "$TEST_TMPDIR/logs_r" && cp "$TEST_TMPDIR"/logs/* "$TEST_TMPDIR/logs_r/"
for n in 1 2; do
  echo "2026-12-07T04:00:0$n.000+00:00 I device_thread_renewed device=sim:0 reason=\"$n allocator out-of-memory errors\"" \
    >>"$TEST_TMPDIR/logs_r/resident.log"
done
/usr/bin/python3 "$scripts/multi_tenant.py" analyze "$TEST_TMPDIR/logs_r" "$TEST_TMPDIR/rows.jsonl" >"$TEST_TMPDIR/analysis_r.txt"
grep -q "^resident: .*, worker thread renewed 2x after allocator out-of-memory errors$" "$TEST_TMPDIR/analysis_r.txt" ||
  { cat "$TEST_TMPDIR/analysis_r.txt"; exit 1; }
grep "^resident: " "$TEST_TMPDIR/analysis.txt" | grep -vq "renewed" || { cat "$TEST_TMPDIR/analysis.txt"; exit 1; }
# Since session 45 the server renews only its convolutions' thread and says so (thread=convolutions).
echo "2026-12-07T04:00:03.000+00:00 I device_thread_renewed device=sim:0 thread=convolutions reason=\"3 allocator out-of-memory errors\"" \
  >>"$TEST_TMPDIR/logs_r/resident.log"
/usr/bin/python3 "$scripts/multi_tenant.py" analyze "$TEST_TMPDIR/logs_r" "$TEST_TMPDIR/rows.jsonl" >"$TEST_TMPDIR/analysis_c.txt"
grep -q "^resident: .*, convolutions' thread renewed 3x after allocator out-of-memory errors$" "$TEST_TMPDIR/analysis_c.txt" ||
  { cat "$TEST_TMPDIR/analysis_c.txt"; exit 1; }
# The budgeted strategies' bytes split into whole-component onloads and the rest (streamed): FIFO
# moved whole components (its onloads above), so its figure is above nothing.
[ "$(grep -c "^  bytes to the device per measured request [0-9.]* GB, of which whole-component onloads at most [0-9.]* GB" \
    "$TEST_TMPDIR/analysis.txt")" = 2 ] || { cat "$TEST_TMPDIR/analysis.txt"; exit 1; }
/usr/bin/python3 - "$TEST_TMPDIR/analysis.txt" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
fifo = text.split("\nfifo:", 1)[1].split("\nscheduler:", 1)[0]
m = re.search(r"whole-component onloads at most [0-9.]+ GB \([0-9.]+%; ([0-9]+) bytes over the run\)", fifo)
assert m and int(m.group(1)) > 0, fifo
PY
# The log's size column as bytes.
(cd "$scripts" && /usr/bin/python3 -c '
import multi_tenant as m
assert m.logged_bytes(["4.02", "GiB"]) == int(4.02 * (1 << 30))
assert m.logged_bytes(["5.00", "KiB"]) == 5 << 10 and m.logged_bytes(["512", "B"]) == 512
assert m.logged_bytes(["[footprint]"]) == 0 and m.logged_bytes(["1.5", "parsecs"]) == 0
# Out-of-memory errors and how the margin answered, with and without a request id before the action.
lines = ["2026-12-06T18:39:43Z req-206    oom            flux-schnell/vae   0 B  [footprint] running vae",
         "2026-12-06T18:39:43Z req-206    release_group_cache flux-schnell/transformer 2.68 GiB  [footprint] oom",
         "2026-12-06T18:39:43Z req-206    widen_cache_margin    512.00 MiB  [footprint] out of memory",
         "2026-12-06T18:45:00Z narrow_cache_margin    256.00 MiB  [footprint] 32 runs began",
         "2026-12-06T18:45:01Z req-300    onload   zimage/vae  1 GiB  [footprint] oom widen_cache_margin"]
assert m.margin_events(lines) == (1, 1, 1), m.margin_events(lines)
# Where the allocator held its room at the out-of-memory decisions: LibTorch message at the error,
# the decision note after it; nothing when neither is there.
assert m.oom_fragments(lines) == "", m.oom_fragments(lines)
oom = ("2026-12-07T13:00:24Z req-207    oom   zimage/vae   0 B  [footprint] running vae: CUDA out of memory. "
       "3.57 GiB is reserved by PyTorch but unallocated. See; allocator: 3221225472 bytes reserved but "
       "unallocated: 2147483648 in 10 segments that hold live blocks too (536870912 of them in 30 segments "
       "of 20 MiB or less), 1073741824 in 2 free segments; the largest free block 10 bytes")
found = m.oom_fragments([oom, oom.replace("3.57 GiB", "512.00 MiB").replace("2147483648", "1073741824")])
assert found == ("allocator at out-of-memory errors: reserved but unallocated at the 2 errors 0.50-3.57 GiB; "
                 "after them in segments holding live blocks 1.00-2.00 GiB (in segments of 20 MiB or less "
                 "0.50-0.50 GiB), in free segments 1.00-1.00 GiB"), found
assert m.oom_fragments([oom.replace("3.57 GiB", "1073741824 bytes")]).startswith(
    "allocator at out-of-memory errors: reserved but unallocated at the 1 errors 1.00-1.00 GiB;")
# The requests at each margin: from the change on (by request number; a change of no request from the
# request logged before it), the start before any.
assert m.request_number("req-206") == 206 and m.request_number("widen_cache_margin") is None
assert m.request_number("req-") is None and m.request_number("2026-12-06T18:45:00Z") is None
ids = ["req-205", "req-206", "req-207", "req-299", "req-300", "req-301"]
assert m.margin_by_request(lines, ids, "256.00 MiB") == [("256.00 MiB", 5), ("512.00 MiB", 1)], \
    m.margin_by_request(lines, ids, "256.00 MiB")
assert m.margin_by_request(lines[3:], ids, "start") == [("256.00 MiB", 6)], m.margin_by_request(lines[3:], ids, "start")
assert m.margin_by_request([], ids, "start") == [("start", 6)]
# What running short cost the decode: the range of the short runs beside the median of the rest.
note = m.decode_note([(0.094, False), (0.145, True), (0.097, True), (0.094, False), (0.095, False)])
expected = "; their decode 0.097–0.145 s against the others%s median %.3f s" % (chr(39), m.percentile([0.094, 0.094, 0.095], 0.5))
assert note == expected, (note, expected)
assert m.decode_note([(0.094, False)]) == "" and m.decode_note([(0.2, True)]) == ""
# What a thread renewal cost: the first run of a pipeline after one against its other runs.
runs = [("zimage", 0.7, 1, 0, 0, 0, {"encode_prompt": 0.02, "denoise": 0.5}),
        ("zimage", 0.8, 1, 0, 0, 0, {"encode_prompt": 0.08, "denoise": 0.62}),
        ("zimage", 0.7, 1, 0, 0, 0, {"encode_prompt": 0.02, "denoise": 0.52})]
cost = m.renewal_cost(runs, [False, True, False])
assert cost.startswith("first run of a pipeline after a renewal: 1, their prompt encoding + denoising +0.170 s"), cost
assert m.renewal_cost(runs, [False, False, False]) == "" and m.renewal_cost(runs[:1], [True]) == ""
reqs = [{"pipeline": "zimage", "run": 0.7, "stages": {"encode_prompt": 0.02, "denoise": 0.5}, "first_after_renewal": False},
        {"pipeline": "zimage", "run": 0.8, "stages": {"encode_prompt": 0.08, "denoise": 0.62}, "first_after_renewal": True},
        {"pipeline": "zimage", "run": 0.7, "stages": {"encode_prompt": 0.02, "denoise": 0.52}, "first_after_renewal": False}]
shortened, seconds = m.remove_renewal_cost(reqs)
assert shortened == 1 and abs(seconds - 0.17) < 1e-9 and abs(reqs[1]["run"] - 0.63) < 1e-9, reqs
assert [r["run"] for r in reqs[::2]] == [0.7, 0.7], reqs
')
# What preemption would change on this trace, by the model replaying the scheduler strategy's runs.
/usr/bin/python3 "$scripts/multi_tenant.py" replay "$TEST_TMPDIR/logs" "$TEST_TMPDIR/rows.jsonl" >"$TEST_TMPDIR/replay.txt"
grep -q "^replay of 24 requests (scheduler strategy)" "$TEST_TMPDIR/replay.txt" || { cat "$TEST_TMPDIR/replay.txt"; exit 1; }
grep -q "^  zimage .* model none .* model priority .* model resident " "$TEST_TMPDIR/replay.txt" ||
  { cat "$TEST_TMPDIR/replay.txt"; exit 1; }
# The same with the renewals' cost taken out of the runs after them. Whether the simulated device runs
# short under the scheduler's budget depends on how the requests and prefetches interleave (an allocator
# retry, then a renewal of the convolutions' thread): without a renewal in its log nothing is shortened;
# with some, at most the first runs after them that analyze counted, each by a positive amount.
/usr/bin/python3 "$scripts/multi_tenant.py" replay "$TEST_TMPDIR/logs" "$TEST_TMPDIR/rows.jsonl" --renewal_free \
  >"$TEST_TMPDIR/replay_free.txt"
/usr/bin/python3 - "$TEST_TMPDIR/replay_free.txt" "$TEST_TMPDIR/logs/scheduler.log" "$TEST_TMPDIR/analysis.txt" <<'PY'
import re, sys
free = open(sys.argv[1]).read()
renewals = open(sys.argv[2]).read().count(" device_thread_renewed ")
scheduler = open(sys.argv[3]).read().split("\nscheduler:", 1)[1]
m = re.search(r"^  renewals made free: ([0-9]+) first runs after a renewal shortened by ([0-9.]+) s in all$", free, re.M)
assert m, free
runs, seconds = int(m.group(1)), float(m.group(2))
if renewals == 0:
    assert runs == 0 and m.group(2) == "0.000", free
    assert "first run of a pipeline after a renewal" not in scheduler, scheduler
else:
    counted = re.search(r"^  first run of a pipeline after a renewal: ([0-9]+),", scheduler, re.M)
    assert runs <= (int(counted.group(1)) if counted else 0), (free, scheduler)
    assert runs > 0 or seconds == 0.0, free
PY
# A strategy run on its own.
# This one keeps the hot text encoder whole on the device (not streamed, never evicted by the strategy).
# And the fine-tune's transformer streams as int4 instead of moving whole (--zimage_ft_compress).
# Batching on (every pipeline, up to 4 a batch, set through the admin API): the burst's queued
# requests of one pipeline run together, each counting its share of its batch's bytes.
# And the server before session 45: convolutions on the worker's thread (--no_convolution_lane).
run --strategies fifo --out "$TEST_TMPDIR/fifo.jsonl" \
  --logs "$TEST_TMPDIR/logs_fifo" --keep_resident zimage/text_encoder --zimage_ft_compress int4 \
  --max_batch_size 4 --max_queue_delay_ms 20 --no_convolution_lane >/dev/null
/usr/bin/python3 - "$TEST_TMPDIR/fifo.jsonl" "$TEST_TMPDIR/rows.jsonl" "$TEST_TMPDIR/logs_fifo" "$TEST_TMPDIR/logs" <<'PY'
import json, os, re, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert rows and all(r["strategy"] == "fifo" and r["ok"] for r in rows), rows
# No resident strategy in this run: no resident figures (never another run's).
assert all(r["resident_p50_s"] is None and r["resident_p99_s"] is None for r in rows), rows
assert all(r["keep_resident"] == ["zimage/text_encoder"] for r in rows), rows
def text_encoder_lines(folder, name):
    text = open(os.path.join(folder, name)).read()
    return [l for l in text.splitlines() if "zimage/text_encoder" in l]
kept = text_encoder_lines(sys.argv[3], "fifo.placement.txt")
streamed = text_encoder_lines(sys.argv[4], "fifo.placement.txt")
assert kept and streamed and kept != streamed, (kept, streamed)
assert any("group" in l.lower() for l in streamed) and not any("group" in l.lower() for l in kept), (kept, streamed)
placement = open(os.path.join(sys.argv[3], "fifo.placement.txt")).read().splitlines()
ft = [i for i, l in enumerate(placement) if l.strip().startswith("zimage-ft/transformer ")]
assert ft and "GROUP_OFFLOADED" in placement[ft[0]] and "int4" in placement[ft[0] + 1], placement
assert all(r["placement"]["zimage_ft_compress"] == "int4" for r in rows), rows
assert all(r["serving"] == {"compute": "bf16", "text_encoder_compute": "bf16", "t5_compute": "bf16", "max_batch_size": 4,
                           "max_queue_delay_ms": 20, "preemption": "none", "convolution_lane": False} for r in rows), rows
assert "convolution_lane: false" in open(os.path.join(sys.argv[3], "fifo.log.textproto")).read()
every = [r for r in rows if r["pipeline"] == "all"][0]
assert every["mean_batch_size"] > 1, every  # 24 requests at 40/s: some queue together.
unbatched = [r for r in map(json.loads, open(sys.argv[2])) if r["pipeline"] == "all"]
assert all(r["mean_batch_size"] == 1 for r in unbatched), unbatched
# And the footprint strategy never chose it (the budget makes it evict others: it did). This tiny
# budget holds no text encoder beside a transformer, so the out-of-memory recovery, the last resort,
# still moves it: those lines say so and are not the strategy's choice.
log = open(os.path.join(sys.argv[3], "fifo.placement_log.txt")).read().splitlines()
chosen = [l for l in log if re.search(r"\boffload\s", l) and "[footprint]" in l and "out of memory" not in l]
assert chosen, log[:40]
assert not any("zimage/text_encoder " in l for l in chosen), [l for l in chosen if "zimage/text_encoder" in l]
print("ok")
PY
# Hostile flags: refused by name before anything starts.
if run --max_batch_size 65 --out "$TEST_TMPDIR/y.jsonl" --logs "$TEST_TMPDIR/logs_y" 2>"$TEST_TMPDIR/err.txt"; then
  echo "--max_batch_size 65 was taken"; exit 1
fi
grep -q "max_batch_size must be 1..64" "$TEST_TMPDIR/err.txt"
if run --max_batch_size 2 --max_queue_delay_ms -1 --out "$TEST_TMPDIR/y.jsonl" --logs "$TEST_TMPDIR/logs_y" \
    2>"$TEST_TMPDIR/err.txt"; then
  echo "--max_queue_delay_ms -1 was taken"; exit 1
fi
grep -q "max_queue_delay_ms 0..60000" "$TEST_TMPDIR/err.txt"
if run --max_batch_size 2 --batch_in fifo,lifo --out "$TEST_TMPDIR/y.jsonl" --logs "$TEST_TMPDIR/logs_y" \
    2>"$TEST_TMPDIR/err.txt"; then
  echo "--batch_in lifo was taken"; exit 1
fi
grep -q "batch_in: names among" "$TEST_TMPDIR/err.txt"
# The scheduler batches, FIFO as it was (one server, three strategies): only the scheduler's rows
# (and resident's) have batches, and the admin log shows batching switched on and off.
# T5 streams from an int8 host copy here, and the spare-room cache is on (the CUDA allocator
# flags are taken, logged and harmless on the simulator).
run --strategies resident,fifo,scheduler --flood_requests 0 --max_batch_size 4 --batch_in resident,scheduler \
  --text_encoder_compress int8 --streamed_group_cache --cuda_expandable_segments --cuda_max_split_size_mb 256 \
  --out "$TEST_TMPDIR/b.jsonl" \
  --logs "$TEST_TMPDIR/logs_b" >/dev/null
grep -q "cuda_expandable_segments, cuda_max_split_size_mb: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True,max_split_size_mb:256" \
  "$TEST_TMPDIR/logs_b/one_server.log" ||
  { tail -20 "$TEST_TMPDIR/logs_b/one_server.log"; exit 1; }
grep -q "CUDA allocator: " "$TEST_TMPDIR/logs_b/one_server.log" || { tail -20 "$TEST_TMPDIR/logs_b/one_server.log"; exit 1; }
grep -A1 "^  flux-schnell/text_encoder_2 " "$TEST_TMPDIR/logs_b/scheduler.placement.txt" | grep -q "int8" ||
  { cat "$TEST_TMPDIR/logs_b/scheduler.placement.txt"; exit 1; }
# The analysis splits a batch's run among its members (the server logs each one's batch_size).
/usr/bin/python3 "$scripts/multi_tenant.py" analyze "$TEST_TMPDIR/logs_b" "$TEST_TMPDIR/b.jsonl" >"$TEST_TMPDIR/analysis_b.txt"
grep -q "^scheduler: 24 measured requests, .*mean batch [0-9.]* (a request's share" "$TEST_TMPDIR/analysis_b.txt" ||
  { cat "$TEST_TMPDIR/analysis_b.txt"; exit 1; }
grep "^fifo: " "$TEST_TMPDIR/analysis_b.txt" | grep -vq "mean batch" || { cat "$TEST_TMPDIR/analysis_b.txt"; exit 1; }
grep -q "pipeline prefetches: [0-9]" "$TEST_TMPDIR/analysis_b.txt"
grep -q "spare-room cache releases: [0-9]" "$TEST_TMPDIR/analysis_b.txt"
grep -q "^  out of memory: [0-9]*; cache margin widened [0-9]*, narrowed [0-9]*$" "$TEST_TMPDIR/analysis_b.txt"
# On one server a placement dump counts every strategy so far: the analysis gives each its own
# forwards and cache hits (the scheduler's are the difference from FIFO's dump).
/usr/bin/python3 - "$TEST_TMPDIR/analysis_b.txt" "$TEST_TMPDIR/logs_b" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
def own(strategy):
    part = text.split(f"\n{strategy}:", 1)[1].split("\nscheduler:", 1)[0]
    return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in re.finditer(
        r"\n  (\S+): spare-room cache .* at the end; this strategy's ([0-9]+) forwards, ([0-9]+) onloads served "
        r"\([0-9.]+ GiB not copied\), ([0-9.]+) % of its forwards' [0-9.]+ [KMG]?i?B each", part)
        if 0 <= float(m.group(4)) <= 100}
fifo, scheduler = own("fifo"), own("scheduler")
assert fifo and scheduler, text
def dumped(strategy):
    counts = {}
    component = None
    for line in open(f"{sys.argv[2]}/{strategy}.placement.txt"):
        if line.startswith("  ") and not line.startswith("    "):
            component = line.split()[0]
        m = re.search(r"; ([0-9]+) forwards", line)
        if m and component:
            counts[component] = int(m.group(1))
    return counts
before, after = dumped("fifo"), dumped("scheduler")
for c in set(fifo) | set(scheduler):
    assert fifo.get(c, (0, 0))[0] == before.get(c, 0), (c, text)
    assert scheduler.get(c, (0, 0))[0] == after.get(c, 0) - before.get(c, 0), (c, text)
PY
# With the caches on, the placement's device line says their margin, and the analysis repeats it.
grep -q "^  cache margin at the end: [0-9.]* [KMG]*i*B$" "$TEST_TMPDIR/analysis_b.txt" || { cat "$TEST_TMPDIR/analysis_b.txt"; exit 1; }
/usr/bin/python3 - "$TEST_TMPDIR/b.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
every = {r["strategy"]: r for r in rows if r["pipeline"] == "all"}
assert sorted(every) == ["fifo", "resident", "scheduler"], rows
assert every["fifo"]["mean_batch_size"] == 1 and every["fifo"]["serving"]["max_batch_size"] == 1, every["fifo"]
assert every["scheduler"]["serving"]["max_batch_size"] == 4 and every["scheduler"]["mean_batch_size"] > 1, every
assert all(r["ok"] for r in rows), rows
assert all(r["placement"]["streamed_group_cache"] for r in rows if r["strategy"] != "resident"), rows
assert all(r["placement"]["cuda_expandable_segments"] for r in rows if r["strategy"] != "resident"), rows
assert all(r["placement"]["cuda_max_split_size_mb"] == 256 for r in rows if r["strategy"] != "resident"), rows
print("ok")
PY
for flag in --compute --text_encoder_compute --t5_compute; do
  if run $flag fp8 --out "$TEST_TMPDIR/y.jsonl" --logs "$TEST_TMPDIR/logs_y" 2>"$TEST_TMPDIR/err.txt"; then
    echo "$flag fp8 on the simulator was taken"; exit 1
  fi
  grep -q -- "^$flag fp8 needs --device cuda" "$TEST_TMPDIR/err.txt" || { cat "$TEST_TMPDIR/err.txt"; exit 1; }
done
