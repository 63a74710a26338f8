#include "base/out_of_memory.h"
#include "placement/placement_manager.h"

#include <algorithm>
#include <functional>
#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "base/load_progress.h"

#include "models/core/lora.h"
#include "models/pipelines/tiny_pipeline.h"
#include "offload/compression.h"

namespace stowage {
namespace {

// The request every test here generates.
GenerationParams HarbourParams() {
  GenerationParams params;
  params.prompt = "a harbour";
  params.width = 64;
  params.height = 64;
  params.steps = 2;
  params.seed = 3;
  return params;
}

struct Harness {
  explicit Harness(const SimulatedBackendOptions& options = {})
      : backend(CreateSimulatedBackend(options)), placement(backend.get()) {
    pipeline = *CreateTinyPipeline({});
    for (Component* c : pipeline->components()) EXPECT_TRUE(placement.Register("tiny", c).ok());
  }
  absl::StatusOr<Image> Generate() {
    RunContext context(nullptr, nullptr);
    return pipeline->Run(HarbourParams(), placement, context);
  }
  // A run's body that allocates `bytes` on the device (held until it returns), throwing the device's
  // out-of-memory error when they do not fit.
  std::function<void()> Allocating(int64_t bytes) {
    return [this, bytes] {
      auto t = backend->AllocateBytes(bytes);
      if (!t.ok()) throw DeviceOutOfMemory("sim:0", bytes, backend->GetMemoryStats().allocated_bytes, 0);
    };
  }
  const ComponentView& View(const std::string& name) {
    views = placement.Snapshot();
    for (const ComponentView& v : views) {
      if (v.name == name) return v;
    }
    static ComponentView none;
    return none;
  }
  // Placement goes before the pipeline whose modules its offloaders hook.
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<Pipeline> pipeline;
  PlacementManager placement;
  std::vector<ComponentView> views;
};

// The image `params` gives on an unbudgeted device with nothing offloaded (what every run under
// offloading and caching must reproduce).
Image PlainImage(const GenerationParams& params) {
  Harness plain;
  RunContext context(nullptr, nullptr);
  auto image = plain.pipeline->Run(params, plain.placement, context);
  EXPECT_TRUE(image.ok()) << image.status();
  return image.ok() ? *std::move(image) : Image{};
}

// `s` with the spare-room cache on (a 256-byte margin) and `ids` streamed on a copy stream.
void StreamWithSpareRoomCache(Harness& s, const std::vector<std::string>& ids) {
  s.placement.set_streamed_group_cache(true, /*margin_bytes=*/256);
  GroupOffloadOptions options;
  options.use_stream = true;
  for (const std::string& id : ids) ASSERT_TRUE(s.placement.EnableGroupOffload(id, options).ok()) << id;
}

// `s` under the footprint strategy, its transformer streamed with the spare-room cache on (as above),
// after two requests without a budget: the cache holds every streamed group. Returns its bytes.
int64_t FullCacheAfterTwoRequests(Harness& s) {
  (void)s.placement.SetStrategy(MakeFootprintStrategy(0));
  StreamWithSpareRoomCache(s, {"tiny/transformer"});
  EXPECT_TRUE(s.Generate().ok());
  EXPECT_TRUE(s.Generate().ok());
  return s.placement.GroupOffloadStatsOf("tiny/transformer")->cache_bytes;
}

TEST(PlacementManagerTest, ComponentsStartOffloadedAndBecomeResidentWhenRun) {
  Harness s;
  EXPECT_EQ(s.View("transformer").state, ComponentState::kOffloaded);
  EXPECT_EQ(s.backend->GetMemoryStats().allocated_bytes, 0);
  ASSERT_TRUE(s.Generate().ok());
  int64_t total = 0;
  for (const ComponentView& v : s.placement.Snapshot()) {
    EXPECT_EQ(v.state, ComponentState::kResident) << v.id;
    EXPECT_EQ(v.device_bytes, v.weight_bytes);
    total += v.weight_bytes;
  }
  EXPECT_EQ(s.backend->GetMemoryStats().allocated_bytes, total);
}

TEST(PlacementManagerTest, ComponentLifecycleFollowsItsPipelines) {
  Harness s;
  for (const ComponentView& v : s.placement.Snapshot()) EXPECT_EQ(v.lifecycle, ComponentLifecycle::kLoading) << v.id;
  s.placement.MarkReady("tiny");
  for (const ComponentView& v : s.placement.Snapshot()) EXPECT_EQ(v.lifecycle, ComponentLifecycle::kReady) << v.id;
  // The text encoder is shared with a second pipeline: unloading "tiny" leaves it READY.
  Component* text_encoder = s.pipeline->components()[0];
  ASSERT_TRUE(s.placement.Register("other", text_encoder).ok());
  s.placement.MarkReady("other");
  s.placement.MarkUnloading("tiny");
  for (const ComponentView& v : s.placement.Snapshot()) {
    EXPECT_EQ(v.lifecycle, v.name == text_encoder->name() ? ComponentLifecycle::kReady : ComponentLifecycle::kUnloading)
        << v.id;
  }
  // Requests accepted before the unload still run through UNLOADING components.
  EXPECT_TRUE(s.Generate().ok());
  s.placement.AbandonUnloading("tiny");
  for (const ComponentView& v : s.placement.Snapshot()) EXPECT_EQ(v.lifecycle, ComponentLifecycle::kReady) << v.id;
  // Registered again by another pipeline while on its way out: READY again.
  s.placement.MarkUnloading("tiny");
  Component* vae = s.pipeline->components().back();
  ASSERT_TRUE(s.placement.Register("third", vae).ok());
  EXPECT_EQ(s.View(vae->name()).lifecycle, ComponentLifecycle::kReady);
  s.placement.Unregister("tiny");
  s.placement.Unregister("other");
  s.placement.Unregister("third");
  EXPECT_TRUE(s.placement.Snapshot().empty());
}

// The spare-room cache (set_streamed_group_cache): a streamed transformer's later steps copy only
// what the free room could not keep, and the cache stays for the next request while nothing needs
// its room; the image is the same; under a budget the room a run needs comes from the cache first
// (no weights move), and nothing goes over the budget.
TEST(PlacementManagerTest, TheSpareRoomCacheKeepsStreamedGroupsBetweenStepsWithinTheBudget) {
  GenerationParams params = HarbourParams();
  params.steps = 4;
  const Image expected = PlainImage(params);
  ASSERT_FALSE(expected.rgb.empty());

  Harness s;
  StreamWithSpareRoomCache(s, {"tiny/transformer"});
  const auto generate = [&] {
    RunContext context(nullptr, nullptr);
    return s.pipeline->Run(params, s.placement, context);
  };
  const auto stats = [&] { return *s.placement.GroupOffloadStatsOf("tiny/transformer"); };
  const int groups = stats().streamed_groups;
  ASSERT_GT(groups, 1);
  const int64_t ring = stats().slots * stats().slot_bytes + stats().scratch_bytes;
  const int64_t streamed = stats().streamed_bytes;

  // No budget: its first step (run headroom unknown) caches nothing, the second keeps every streamed
  // group, the last two copy none of them.
  auto image = generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected.rgb);
  EXPECT_EQ(stats().cache_hits, 2 * groups);
  EXPECT_EQ(stats().cache_hit_bytes, 2 * streamed);
  // The VAE ran last: the transformer's ring went back (recorded), its cache stayed (nothing needed
  // the room), and the next request copies none of its streamed groups.
  EXPECT_EQ(stats().cache_bytes, streamed);
  EXPECT_EQ(s.View("transformer").device_bytes, streamed);
  int64_t released = 0;
  for (const PlacementDecision& d : s.placement.DecisionLog(100)) {
    if (d.component == "tiny/transformer" && d.action == "release_slots") released = d.bytes;
  }
  EXPECT_EQ(released, ring);
  ASSERT_TRUE(generate().ok());
  EXPECT_EQ(stats().cache_hits, 6 * groups);

  // A budget with room for everything else and the transformer's working set but half of its cache:
  // its next run takes the room it needs from its own cache first (no weights move), the rest of
  // the cache still serves, and nothing goes over the budget.
  const DeviceMemoryStats now = s.backend->GetMemoryStats();
  const int64_t budget = now.context_bytes + now.allocated_bytes - streamed / 2 + ring;
  ASSERT_TRUE(s.backend->SetMemoryBudget(budget).ok());
  s.backend->ResetPeakStats();
  const size_t decisions = s.placement.DecisionLog(1000).size();
  const int64_t hits = stats().cache_hits;
  image = generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected.rgb);
  EXPECT_GT(stats().cache_hits, hits);
  EXPECT_LE(s.backend->GetMemoryStats().peak_allocated_bytes + now.context_bytes, budget);
  const std::vector<PlacementDecision> log = s.placement.DecisionLog(1000);
  bool shrank = false;
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "offload") << log[k].component << ": " << log[k].reason;
    shrank = shrank || (log[k].component == "tiny/transformer" && log[k].action == "release_group_cache");
  }
  EXPECT_TRUE(shrank);
  for (const ComponentView& v : s.placement.Snapshot()) {
    if (v.name != "transformer") {
      EXPECT_EQ(v.state, ComponentState::kResident) << v.id;
    }
  }
  // Off again: the next run's allowance is 0, so the cache empties and serves nothing.
  s.placement.set_streamed_group_cache(false, 0);
  const int64_t hits_off = stats().cache_hits;
  ASSERT_TRUE(generate().ok());
  EXPECT_EQ(stats().cache_hits, hits_off);
  EXPECT_EQ(stats().cache_allowance_bytes, 0);
  EXPECT_EQ(stats().cache_bytes, 0);
}

// Under a budget, a component that needs room takes it from idle spare-room caches before any
// weights move, and a streamed component of another pipeline starting to run takes the cache of one
// that serves none of its pipelines.
TEST(PlacementManagerTest, SpareRoomCachesGiveWayBeforeWeightsMove) {
  GenerationParams params = HarbourParams();
  params.steps = 3;
  auto backend = CreateSimulatedBackend({});
  auto a = *CreateTinyPipeline({});
  auto b = *CreateTinyPipeline({});
  PlacementManager placement(backend.get());
  for (Component* c : a->components()) ASSERT_TRUE(placement.Register("a", c).ok());
  for (Component* c : b->components()) ASSERT_TRUE(placement.Register("b", c).ok());
  placement.set_streamed_group_cache(true, 256);
  GroupOffloadOptions options;
  options.use_stream = true;
  ASSERT_TRUE(placement.EnableGroupOffload("a/transformer", options).ok());
  ASSERT_TRUE(placement.EnableGroupOffload("b/transformer", options).ok());
  const auto run = [&](Pipeline& p) {
    RunContext context(nullptr, nullptr);
    return p.Run(params, placement, context);
  };
  const auto cache = [&](const std::string& id) { return placement.GroupOffloadStatsOf(id)->cache_bytes; };
  ASSERT_TRUE(run(*a).ok());
  ASSERT_TRUE(run(*a).ok());
  const int64_t a_cache = cache("a/transformer");
  EXPECT_GT(a_cache, 0);
  // b's text encoder and VAE (whole components) run first and find room; when b's streamed
  // transformer runs, a's cache (pipeline a only) goes: the room is b's now.
  ASSERT_TRUE(run(*b).ok());
  ASSERT_TRUE(run(*b).ok());
  EXPECT_EQ(cache("a/transformer"), 0);
  EXPECT_GT(cache("b/transformer"), 0);
  bool taken = false;
  for (const PlacementDecision& d : placement.DecisionLog(1000)) {
    taken = taken || (d.component == "a/transformer" && d.action == "release_group_cache" &&
                      d.reason.find("another pipeline") != std::string::npos);
  }
  EXPECT_TRUE(taken);
  // A budget that holds every whole component but leaves b's cache no room: a's next request
  // shrinks b's cache instead of moving weights.
  const DeviceMemoryStats now = backend->GetMemoryStats();
  ASSERT_TRUE(backend->SetMemoryBudget(now.context_bytes + now.allocated_bytes - cache("b/transformer") +
                                       placement.GroupOffloadStatsOf("a/transformer")->working_set_bytes)
                  .ok());
  const size_t decisions = placement.DecisionLog(1000).size();
  ASSERT_TRUE(run(*a).ok());
  const std::vector<PlacementDecision> log = placement.DecisionLog(1000);
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "offload") << log[k].component << ": " << log[k].reason;
  }
  EXPECT_EQ(cache("b/transformer"), 0);
}

// Spare room goes to the component a request runs most: a streamed text encoder (once a request)
// that filled the room first gives it to the streamed transformer (every step) when the transformer
// could cache more than the room left, and never takes it back; the transformer's later steps and
// the next request copy nothing of what it keeps, the images are the same, the budget holds.
TEST(PlacementManagerTest, TheSpareRoomGoesToTheComponentARequestRunsMostOften) {
  GenerationParams params = HarbourParams();
  params.steps = 4;
  const Image expected = PlainImage(params);
  ASSERT_FALSE(expected.rgb.empty());

  Harness s;
  StreamWithSpareRoomCache(s, {"tiny/text_encoder", "tiny/transformer"});
  int request = 0;
  const auto generate = [&] {
    s.placement.SetRequestId(absl::StrCat("req-", ++request));
    RunContext context(nullptr, nullptr);
    return s.pipeline->Run(params, s.placement, context);
  };
  const auto stats = [&](const std::string& id) { return *s.placement.GroupOffloadStatsOf(id); };
  // Unbudgeted, both keep every streamed group.
  for (int i = 0; i < 2; ++i) {
    auto image = generate();
    ASSERT_TRUE(image.ok()) << image.status();
    EXPECT_EQ(image->rgb, expected.rgb);
  }
  const GroupOffloadStats te = stats("tiny/text_encoder"), tr = stats("tiny/transformer");
  ASSERT_EQ(te.cache_bytes, te.streamed_bytes);
  ASSERT_EQ(tr.cache_bytes, tr.streamed_bytes);
  // A budget without the caches empties them (no weights move)...
  DeviceMemoryStats now = s.backend->GetMemoryStats();
  std::vector<std::string> offloaded;
  ASSERT_TRUE(s.placement.SetMemoryBudget(now.context_bytes + now.allocated_bytes - te.cache_bytes - tr.cache_bytes,
                                          &offloaded)
                  .ok());
  EXPECT_TRUE(offloaded.empty());
  EXPECT_EQ(stats("tiny/text_encoder").cache_bytes + stats("tiny/transformer").cache_bytes, 0);
  // ...and the next one leaves the text encoder room for all of its groups beside both working sets,
  // but once they are cached the transformer room for only half of its own (or less: the text
  // encoder's).
  int64_t headroom = 0;
  for (const ComponentView& v : s.placement.Snapshot()) headroom = std::max(headroom, v.run_headroom_bytes);
  now = s.backend->GetMemoryStats();
  const int64_t half = std::min(tr.streamed_bytes / 2, te.streamed_bytes);
  const int64_t budget = now.context_bytes + now.allocated_bytes + te.working_set_bytes + tr.working_set_bytes +
                         headroom + 256 + te.streamed_bytes + tr.streamed_bytes - half;
  ASSERT_TRUE(s.placement.SetMemoryBudget(budget, &offloaded).ok());
  s.backend->ResetPeakStats();
  const size_t decisions = s.placement.DecisionLog(1000).size();
  auto image = generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected.rgb);
  std::vector<PlacementDecision> log = s.placement.DecisionLog(1000);
  int64_t yielded = 0;
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "offload") << log[k].component << ": " << log[k].reason;
    EXPECT_FALSE(log[k].component == "tiny/transformer" && log[k].action == "release_group_cache") << log[k].reason;
    if (log[k].component == "tiny/text_encoder" && log[k].action == "release_group_cache") {
      EXPECT_NE(log[k].reason.find("tiny/transformer runs 4 times a request, tiny/text_encoder 1"), std::string::npos)
          << log[k].reason;
      yielded += log[k].bytes;
    }
  }
  EXPECT_GT(yielded, 0);
  EXPECT_EQ(stats("tiny/transformer").cache_bytes, tr.streamed_bytes);
  EXPECT_LT(stats("tiny/text_encoder").cache_bytes, te.streamed_bytes);
  EXPECT_LE(s.backend->GetMemoryStats().peak_allocated_bytes + now.context_bytes, budget);

  // The next request: the text encoder finds no room beyond what it kept (the transformer's cache
  // is not its to take), the transformer's steps copy none of its streamed groups.
  const int64_t tr_hits = stats("tiny/transformer").cache_hits;
  const size_t next_decisions = s.placement.DecisionLog(1000).size();
  image = generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected.rgb);
  EXPECT_EQ(stats("tiny/transformer").cache_hits - tr_hits, 4 * tr.streamed_groups);
  log = s.placement.DecisionLog(1000);
  for (size_t k = next_decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "release_group_cache") << log[k].component << ": " << log[k].reason;
  }
  EXPECT_LE(s.backend->GetMemoryStats().peak_allocated_bytes + now.context_bytes, budget);
}

// A run that runs out of device memory while spare-room caches hold room (on CUDA: a VAE at 1024²
// whose blocks the allocator could not find beside a cache) gets the caches back and runs again
// before any weights move; the caches keep a wider margin from then on, and the next transformer's
// cache leaves the room the VAE's run allocates, so the next request runs out of nothing.
TEST(PlacementManagerTest, OutOfMemoryTakesTheSpareRoomCachesBeforeAnyWeights) {
  Harness s;
  const int64_t cache = FullCacheAfterTwoRequests(s);
  const auto stats = [&] { return *s.placement.GroupOffloadStatsOf("tiny/transformer"); };
  ASSERT_GT(cache, 1024);
  Component* vae = s.pipeline->components().back();
  const int64_t activations = cache / 4;
  const int64_t working_set = stats().working_set_bytes;
  // Room for the VAE's activations only with the cache given back.
  const DeviceMemoryStats now = s.backend->GetMemoryStats();
  const int64_t extra = activations / 2;
  const int64_t budget = now.context_bytes + now.allocated_bytes + extra;
  ASSERT_TRUE(s.backend->SetMemoryBudget(budget).ok());
  s.backend->ResetPeakStats();
  size_t decisions = s.placement.DecisionLog(1000).size();
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(activations)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 1);
  EXPECT_EQ(stats().cache_bytes, 0);
  EXPECT_EQ(s.placement.learned_cache_margin(), 256);
  std::vector<PlacementDecision> log = s.placement.DecisionLog(1000);
  bool released = false, widened = false;
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "offload") << log[k].component << ": " << log[k].reason;
    released = released || (log[k].action == "release_group_cache" && log[k].bytes == cache &&
                             log[k].reason.find("out of memory running tiny/vae") != std::string::npos);
    if (log[k].action == "widen_cache_margin") {
      widened = true;
      EXPECT_EQ(log[k].bytes, 512);
    }
  }
  EXPECT_TRUE(released);
  EXPECT_TRUE(widened);
  for (const ComponentView& v : s.placement.Snapshot()) {
    if (v.name != "transformer") {
      EXPECT_EQ(v.state, ComponentState::kResident) << v.id;
    }
  }
  EXPECT_EQ(s.View("vae").run_headroom_bytes, activations);
  // The next request: the transformer caches again, but only what leaves the VAE's run its room and
  // the widened margin, so the VAE finds its room without the cache or the weights moving.
  decisions = s.placement.DecisionLog(1000).size();
  ASSERT_TRUE(s.Generate().ok());
  EXPECT_GT(stats().cache_bytes, 0);
  // Its allowance: what was free once the cache went back, less its working set, the VAE's run and
  // the margin (256 configured, 256 learned).
  EXPECT_EQ(stats().cache_allowance_bytes, extra + cache - working_set - activations - 512);
  EXPECT_LE(stats().cache_bytes, stats().cache_allowance_bytes);
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(activations)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 1);
  log = s.placement.DecisionLog(1000);
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "oom") << log[k].reason;
    EXPECT_NE(log[k].action, "offload") << log[k].component << ": " << log[k].reason;
  }
  EXPECT_LE(s.backend->GetMemoryStats().peak_allocated_bytes + now.context_bytes, budget);

  // The learned margin halves once kCacheMarginNarrowAfterRuns requests began without running
  // out (none here: half of 256 is below the configured 256), and the next cache takes that room.
  ASSERT_TRUE(s.Generate().ok());
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(activations)).ok());
  const int64_t allowance = stats().cache_allowance_bytes;
  decisions = s.placement.DecisionLog(1000).size();
  for (int k = 1; k < PlacementManager::kCacheMarginNarrowAfterRuns; ++k) {
    s.placement.BeginRequest(absl::StrCat("quiet-", k));
  }
  EXPECT_EQ(s.placement.learned_cache_margin(), 256);
  s.placement.BeginRequest("quiet-last");
  EXPECT_EQ(s.placement.learned_cache_margin(), 0);
  log = s.placement.DecisionLog(1000);
  ASSERT_EQ(log.size(), decisions + 1);
  EXPECT_EQ(log.back().action, "narrow_cache_margin");
  EXPECT_EQ(log.back().bytes, 256);
  EXPECT_EQ(log.back().request_id, "quiet-last");
  ASSERT_TRUE(s.Generate().ok());
  EXPECT_EQ(stats().cache_allowance_bytes, allowance + 256);
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(activations)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 1);
  EXPECT_LE(s.backend->GetMemoryStats().peak_allocated_bytes + now.context_bytes, budget);
}

// A learned margin halves step by step, and an out-of-memory error in between starts the count of
// quiet requests again: the margin narrows only after that many requests without one.
TEST(PlacementManagerTest, ALearnedCacheMarginNarrowsAfterQuietRequestsOnly) {
  Harness s;
  Component* vae = s.pipeline->components().back();
  const int64_t cache = FullCacheAfterTwoRequests(s);
  ASSERT_GT(cache, 1024);
  // Each out-of-memory run below happens with the cache full and half the VAE's run free, the run
  // allocating more than any before it (so the headroom learned before does not make its room).
  int64_t activations = cache / 16;
  const auto run_out = [&](int64_t expected_margin) {
    activations *= 2;
    ASSERT_TRUE(s.backend->SetMemoryBudget(0).ok());
    ASSERT_TRUE(s.Generate().ok());  // The cache fills again without a budget.
    const DeviceMemoryStats now = s.backend->GetMemoryStats();
    ASSERT_TRUE(s.backend->SetMemoryBudget(now.context_bytes + now.allocated_bytes + activations / 2).ok());
    ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(activations)).ok());
    EXPECT_EQ(s.placement.learned_cache_margin(), expected_margin);
  };
  const auto quiet = [&](int requests) {
    for (int k = 0; k < requests; ++k) s.placement.BeginRequest(absl::StrCat("quiet-", k));
  };
  run_out(256);
  run_out(512);
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns - 1);
  run_out(1024);  // Before the count ran out: it starts again.
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns - 1);
  EXPECT_EQ(s.placement.learned_cache_margin(), 1024);
  quiet(1);
  EXPECT_EQ(s.placement.learned_cache_margin(), 512);
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns);
  EXPECT_EQ(s.placement.learned_cache_margin(), 256);
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns);
  EXPECT_EQ(s.placement.learned_cache_margin(), 0);
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns);
  EXPECT_EQ(s.placement.learned_cache_margin(), 0);
  int narrowed = 0;
  for (const PlacementDecision& d : s.placement.DecisionLog(1000)) narrowed += d.action == "narrow_cache_margin";
  EXPECT_EQ(narrowed, 3);
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 3);
}

// A run that succeeded although the allocator ran short inside it changes no margin while spare-room
// caches held room: not a retry (the allocator gave its cached blocks back and the allocation fitted),
// not an out-of-memory error a library recovered from (a workspace refused, the caches' room would have
// served it: cuDNN going a slower way that once, the worker's thread renewal keeping it from staying).
// Each costs that run a little; a wider margin would cost every streamed request after it copies
// (multi-tenant runs 14 and 15). The caches stay as they were, no placement recovery is counted, and
// the reply's counts still see every shortfall. A run that fails for want of room still widens it.
TEST(PlacementManagerTest, AllocatorShortfallsARunRecoveredFromLeaveTheCacheMarginAsItIs) {
  SimulatedBackendOptions options;
  options.caching_allocator = true;
  Harness s(options);
  const int64_t cache = FullCacheAfterTwoRequests(s);
  ASSERT_GT(cache, 1024);
  Component* vae = s.pipeline->components().back();
  s.backend->ReleaseCachedMemory();
  const DeviceMemoryStats full = s.backend->GetMemoryStats();
  ASSERT_EQ(full.reserved_bytes, full.allocated_bytes);
  ASSERT_TRUE(s.backend->SetMemoryBudget(full.context_bytes + full.allocated_bytes + cache).ok());
  // From no cached block: half the free room, given back (cached), then three quarters of it: no
  // cached block holds it and the cached one leaves too little, so the allocator gives it back and
  // allocates again.
  const auto retrying = [&s] {
    return [&s] {
      s.backend->ReleaseCachedMemory();
      const int64_t free_bytes = s.backend->GetMemoryStats().free_bytes();
      { absl::StatusOr<at::Tensor> first = s.backend->AllocateBytes(free_bytes / 2); ASSERT_TRUE(first.ok()); }
      absl::StatusOr<at::Tensor> second = s.backend->AllocateBytes(free_bytes * 3 / 4);
      ASSERT_TRUE(second.ok()) << second.status();
    };
  };
  // What a library does with a workspace it cannot have: asks, is refused, runs without it. 1.5x the
  // free room: the caches' room would have served it.
  const auto recovering = [&s, cache] {
    return [&s, cache] {
      s.backend->ReleaseCachedMemory();
      EXPECT_FALSE(s.backend->AllocateBytes(cache + cache / 2).ok());
    };
  };
  const DeviceMemoryStats before = s.backend->GetMemoryStats();
  const size_t decisions = s.placement.DecisionLog(1000).size();
  int requests = 0;
  for (int k = 0; k < 3; ++k) {
    s.placement.BeginRequest(absl::StrCat("retry-", ++requests));
    ASSERT_TRUE(s.placement.Run(*vae, retrying()).ok());
    s.placement.BeginRequest(absl::StrCat("refused-", ++requests));
    ASSERT_TRUE(s.placement.Run(*vae, recovering()).ok());
  }
  const DeviceMemoryStats after = s.backend->GetMemoryStats();
  EXPECT_EQ(after.allocator_retries, before.allocator_retries + 3);
  EXPECT_EQ(after.allocator_ooms, before.allocator_ooms + 3);
  EXPECT_EQ(s.placement.learned_cache_margin(), 0);
  const std::vector<PlacementDecision> log = s.placement.DecisionLog(1000);
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "widen_cache_margin") << log[k].reason;
    EXPECT_NE(log[k].action, "release_group_cache") << log[k].reason;
  }
  EXPECT_EQ(s.placement.GroupOffloadStatsOf("tiny/transformer")->cache_bytes, cache);
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 0);
  // A run that fails for want of the room the caches hold gets it back, runs again, and widens the margin.
  s.placement.BeginRequest("failed");
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(cache + cache / 2)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 1);
  EXPECT_EQ(s.placement.learned_cache_margin(), 256);
  // Its "oom" decision says where the allocator's unallocated room lay (the simulator's retry gave
  // every cached block back before refusing).
  int ooms = 0;
  for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
    if (d.action != "oom" || d.request_id != "failed") continue;
    ++ooms;
    EXPECT_NE(d.reason.find("; allocator: "), std::string::npos) << d.reason;
  }
  EXPECT_EQ(ooms, 1);
}

// The worker's fresh thread ran short again (WidenCacheMarginForShortRoom): the margin widens and the
// caches give back what it added — only under a budget, with the caches on and holding room, and for a
// refusal the caches and the free memory together could have served.
TEST(PlacementManagerTest, AFreshThreadShortOfRoomWidensTheMarginOnlyWhereTheCachesCouldHaveServed) {
  Harness s;
  const int64_t cache = FullCacheAfterTwoRequests(s);
  ASSERT_GT(cache, 1024);
  const auto cached = [&] { return s.placement.GroupOffloadStatsOf("tiny/transformer")->cache_bytes; };
  // No budget: no margin to widen.
  EXPECT_FALSE(s.placement.WidenCacheMarginForShortRoom(cache, "unbudgeted"));
  const DeviceMemoryStats full = s.backend->GetMemoryStats();
  ASSERT_TRUE(s.backend->SetMemoryBudget(full.context_bytes + full.allocated_bytes + cache).ok());
  const int64_t room = cache + s.backend->GetMemoryStats().free_bytes();
  // Larger than all the room there is, or of no known size: not the caches' doing.
  EXPECT_FALSE(s.placement.WidenCacheMarginForShortRoom(room + 1, "larger than the room"));
  EXPECT_FALSE(s.placement.WidenCacheMarginForShortRoom(0, "no size"));
  EXPECT_EQ(s.placement.learned_cache_margin(), 0);
  EXPECT_EQ(s.placement.cache_margin_widenings(), 0);
  EXPECT_EQ(cached(), cache);
  // Within it: the margin widens, the caches leave it.
  EXPECT_TRUE(s.placement.WidenCacheMarginForShortRoom(room, "short again"));
  EXPECT_EQ(s.placement.learned_cache_margin(), 256);
  EXPECT_EQ(s.placement.cache_margin_widenings(), 1);
  EXPECT_LT(cached(), cache);
  EXPECT_GE(s.backend->GetMemoryStats().free_bytes(), 256);
  // With the caches off (or empty), nothing.
  s.placement.set_streamed_group_cache(false, 256);
  EXPECT_FALSE(s.placement.WidenCacheMarginForShortRoom(room, "off"));
  s.placement.set_streamed_group_cache(true, 256);
  std::vector<std::string> offloaded;
  const DeviceMemoryStats now = s.backend->GetMemoryStats();
  ASSERT_TRUE(s.placement.SetMemoryBudget(now.context_bytes + now.allocated_bytes - 1, &offloaded).ok());
  ASSERT_EQ(cached(), 0);
  EXPECT_FALSE(s.placement.WidenCacheMarginForShortRoom(1, "empty"));
  EXPECT_EQ(s.placement.cache_margin_widenings(), 1);
}

// A peer's request runs its components here one call at a time: counted once, at its first call,
// and each call's decisions carry its id.
TEST(PlacementManagerTest, APeersRequestCountsAsOneRunHoweverManyCallsItMakes) {
  Harness s;
  s.placement.BeginRequest("own-1");
  for (int k = 0; k < 3; ++k) s.placement.BeginPeerRun("peer-1");
  EXPECT_EQ(s.placement.request_id(), "peer-1");
  s.placement.SetRequestId("own-1");  // The device's own request again, between the peer's calls.
  s.placement.BeginPeerRun("peer-1");
  s.placement.BeginPeerRun("peer-2");
  EXPECT_EQ(s.placement.request_id(), "peer-2");
  EXPECT_EQ(s.placement.TakeSnapshot().counters.runs_begun, 3);
}

// An out-of-memory error while the learned margin is already at its cap (a quarter of the budget)
// changes nothing but still says the margin is too small: the count of quiet runs starts again; under
// a lower budget one brings the margin down to that budget's cap.
TEST(PlacementManagerTest, AnOutOfMemoryErrorAtTheCappedMarginRestartsTheQuietCount) {
  Harness s;
  const int64_t cache = FullCacheAfterTwoRequests(s);
  ASSERT_GT(cache, 1024);
  // A configured margin above a quarter of any budget below: the first widening reaches the cap.
  const DeviceMemoryStats full = s.backend->GetMemoryStats();
  s.placement.set_streamed_group_cache(true, /*margin_bytes=*/full.allocated_bytes);
  const int64_t activations = cache / 4;
  const int64_t budget = full.context_bytes + full.allocated_bytes + activations / 2;
  ASSERT_TRUE(s.backend->SetMemoryBudget(budget).ok());
  Component* vae = s.pipeline->components().back();
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(activations)).ok());
  ASSERT_EQ(s.placement.learned_cache_margin(), budget / 4);
  const auto quiet = [&](int runs) {
    for (int k = 0; k < runs; ++k) s.placement.BeginRequest(absl::StrCat("quiet-", k));
  };
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns - 1);
  // The cache full again under the same budget, and a run that allocates more than its known
  // headroom (the text encoder's) runs out: the margin stays at its cap.
  ASSERT_TRUE(s.backend->SetMemoryBudget(0).ok());
  ASSERT_TRUE(s.Generate().ok());
  ASSERT_EQ(s.backend->GetMemoryStats().allocated_bytes, full.allocated_bytes);
  ASSERT_TRUE(s.backend->SetMemoryBudget(budget).ok());
  Component* text_encoder = s.pipeline->components().front();
  ASSERT_TRUE(s.placement.Run(*text_encoder, s.Allocating(activations)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 2);
  EXPECT_EQ(s.placement.learned_cache_margin(), budget / 4);
  EXPECT_EQ(s.placement.TakeSnapshot().cache_margin_bytes, full.allocated_bytes + budget / 4);
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns - 1);
  EXPECT_EQ(s.placement.learned_cache_margin(), budget / 4);
  // Under a lower budget an error brings the margin down to that budget's cap (a narrowing).
  ASSERT_TRUE(s.backend->SetMemoryBudget(0).ok());
  ASSERT_TRUE(s.Generate().ok());
  const int64_t lower = full.context_bytes + full.allocated_bytes + activations / 4;
  ASSERT_LT(lower, budget);
  ASSERT_TRUE(s.backend->SetMemoryBudget(lower).ok());
  const size_t decisions = s.placement.DecisionLog(1000).size();
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(3 * activations)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 3);
  EXPECT_EQ(s.placement.learned_cache_margin(), lower / 4);
  const std::vector<PlacementDecision> log = s.placement.DecisionLog(1000);
  bool narrowed = false;
  for (size_t k = decisions; k < log.size(); ++k) {
    EXPECT_NE(log[k].action, "widen_cache_margin") << log[k].reason;
    narrowed = narrowed || (log[k].action == "narrow_cache_margin" && log[k].bytes == full.allocated_bytes + lower / 4);
  }
  EXPECT_TRUE(narrowed);
  quiet(PlacementManager::kCacheMarginNarrowAfterRuns - 1);
  EXPECT_EQ(s.placement.learned_cache_margin(), lower / 4);
  quiet(1);
  EXPECT_EQ(s.placement.learned_cache_margin(), 0);  // Half of it is below the configured margin.
  EXPECT_EQ(s.placement.TakeSnapshot().cache_margin_bytes, full.allocated_bytes);
}

// An out-of-memory recovery moves the strategy's kept components last: when moving the others makes
// the room, a keep_resident transformer stays (two-pipeline run 5 on the H200: a Flux VAE's recovery moved
// both kept transformers off); when it does not, the kept one moves too and the run still succeeds.
TEST(PlacementManagerTest, OutOfMemoryRecoveryMovesKeptComponentsLast) {
  Harness s;
  (void)s.placement.SetStrategy(MakeFootprintStrategy(0, {"transformer"}));
  ASSERT_TRUE(s.Generate().ok());
  Component* vae = s.pipeline->components().back();
  ASSERT_EQ(vae->name(), "vae");
  const int64_t text_encoder = s.View("text_encoder").weight_bytes;
  const int64_t transformer = s.View("transformer").weight_bytes;
  ASSERT_LT(s.View("vae").run_headroom_bytes, text_encoder / 2);  // Nothing moves before the run.
  const DeviceMemoryStats now = s.backend->GetMemoryStats();
  ASSERT_TRUE(s.backend->SetMemoryBudget(now.context_bytes + now.allocated_bytes + text_encoder / 2).ok());
  const auto state = [&](const std::string& name) { return s.View(name).state; };
  // Moving the text encoder off makes the room: the transformer stays.
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(text_encoder)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 1);
  EXPECT_EQ(state("text_encoder"), ComponentState::kOffloaded);
  EXPECT_EQ(state("transformer"), ComponentState::kResident);
  // More than the others free: the kept transformer moves as well, and the run succeeds.
  ASSERT_TRUE(s.placement.Run(*vae, s.Allocating(text_encoder + text_encoder / 2 + transformer / 2)).ok());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.oom_recoveries, 2);
  EXPECT_EQ(state("transformer"), ComponentState::kOffloaded);
}

TEST(PlacementManagerTest, GroupOffloadedComponentPlacesItselfAndKeepsTheImageExact) {
  Harness plain;
  auto expected = plain.Generate();
  ASSERT_TRUE(expected.ok());

  Harness s;
  ASSERT_TRUE(s.Generate().ok());  // Everything resident first: enabling must take it off.
  GroupOffloadOptions options;
  options.use_stream = true;
  ASSERT_TRUE(s.placement.EnableGroupOffload("tiny/transformer", options).ok());
  const ComponentView& view = s.View("transformer");
  EXPECT_EQ(view.state, ComponentState::kGroupOffloaded);
  auto stats = s.placement.GroupOffloadStatsOf("tiny/transformer");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(view.device_bytes, stats->slots * stats->slot_bytes + stats->resident_bytes);
  EXPECT_GT(stats->slots, 0);
  EXPECT_LT(view.device_bytes, view.weight_bytes);
  auto image = s.Generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);
  EXPECT_EQ(s.View("transformer").state, ComponentState::kGroupOffloaded);  // Never moved.
  EXPECT_GT(s.placement.GroupOffloadStatsOf("tiny/transformer")->forwards, 0);
  // The VAE ran after it: its idle slot ring was given back for the VAE, and recorded.
  EXPECT_EQ(s.View("transformer").device_bytes, 0);
  bool released = false;
  for (const PlacementDecision& d : s.placement.DecisionLog(100)) {
    if (d.component == "tiny/transformer" && d.action == "release_slots") {
      released = true;
      EXPECT_EQ(d.bytes, stats->slots * stats->slot_bytes);
    }
  }
  EXPECT_TRUE(released);
  // And the next request allocates it again and draws the same image.
  auto second = s.Generate();
  ASSERT_TRUE(second.ok()) << second.status();
  EXPECT_EQ(second->rgb, expected->rgb);

  EXPECT_EQ(s.placement.EnableGroupOffload("tiny/transformer", options).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.placement.DisableGroupOffload("tiny/transformer").ok());
  EXPECT_EQ(s.View("transformer").state, ComponentState::kOffloaded);
  auto again = s.Generate();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rgb, expected->rgb);
  EXPECT_EQ(s.View("transformer").state, ComponentState::kResident);
  EXPECT_EQ(s.placement.DisableGroupOffload("tiny/transformer").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.placement.EnableGroupOffload("tiny/nope", options).code(), absl::StatusCode::kNotFound);
}

// Overlap across components: the pipeline announces the component that runs next; its first
// groups are copied while the current one computes and its slots kept, so its forward finds them
// ready (no synchronous onload), where without the hint its slots were given back while the other
// component ran and its first group waited for its copy.
// Pinned host copies: registered components are pinned in place ("pin_host" decisions), group
// offloading unpins one first (its own pinned-in-place store then registers the same pages without a
// clash, and the image stays exact), disabling pins it again, unloading unpins; a host that refuses
// to lock memory leaves the copies pageable with a warning; off by default.
TEST(PlacementManagerTest, PinnedHostCopiesFollowTheComponentsLifecycle) {
  Harness plain;
  auto expected = plain.Generate();
  ASSERT_TRUE(expected.ok());
  for (const ComponentView& v : plain.placement.Snapshot()) {
    EXPECT_EQ(plain.pipeline->components().front()->host_weights().pinned_in_place_bytes(), 0) << v.id;  // Off by default.
  }

  auto backend = CreateSimulatedBackend({});
  std::unique_ptr<Pipeline> pipeline = *CreateTinyPipeline({});
  PlacementManager placement(backend.get());
  placement.set_pin_host_copies(true);
  auto component = [&](const std::string& name) -> Component& {
    for (Component* c : pipeline->components()) {
      if (c->name() == name) return *c;
    }
    ADD_FAILURE() << "no component " << name;
    return *pipeline->components().front();
  };
  // Registered during a load (its LoadProgress the running thread's), the pinning shows in it.
  LoadProgress progress;
  {
    const ScopedLoadProgress loading(&progress);
    for (Component* c : pipeline->components()) ASSERT_TRUE(placement.Register("tiny", c).ok());
  }
  int64_t pinned = 0;
  for (Component* c : pipeline->components()) pinned += c->host_weights().pinned_in_place_bytes();
  EXPECT_GT(pinned, 0);
  EXPECT_EQ(progress.bytes_pinned.load(), pinned);
  int pins = 0;
  for (const PlacementDecision& d : placement.DecisionLog(100)) {
    if (d.action == "pin_host") {
      ++pins;
      EXPECT_GE(d.bytes, 1);
    }
  }
  EXPECT_EQ(pins, static_cast<int>(pipeline->components().size()));
  for (Component* c : pipeline->components()) {
    EXPECT_GE(c->host_weights().pinned_in_place_bytes(), c->weight_bytes()) << c->name();
  }
  RunContext context(nullptr, nullptr);
  const GenerationParams params = HarbourParams();
  auto image = pipeline->Run(params, placement, context);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);

  GroupOffloadOptions options;
  options.use_stream = true;
  options.target = OffloadTarget::kPageableHost;  // Pins the pages itself: they must be free to pin.
  ASSERT_TRUE(placement.EnableGroupOffload("tiny/transformer", options).ok());
  EXPECT_EQ(component("transformer").host_weights().pinned_in_place_bytes(), 0);
  auto stats = placement.GroupOffloadStatsOf("tiny/transformer");
  ASSERT_TRUE(stats.ok());
  EXPECT_GT(stats->pinned_in_place_bytes, 0) << stats->pin_in_place_error;  // Its store pinned them, not staged.
  image = pipeline->Run(params, placement, context);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);
  ASSERT_TRUE(placement.DisableGroupOffload("tiny/transformer").ok());
  EXPECT_GE(component("transformer").host_weights().pinned_in_place_bytes(), component("transformer").weight_bytes());
  EXPECT_TRUE(placement.Warnings().empty());

  placement.Unregister("tiny");
  for (Component* c : pipeline->components()) EXPECT_EQ(c->host_weights().pinned_in_place_bytes(), 0) << c->name();

  // A host that refuses: pageable copies, a warning naming the component, a "pin_failed" decision.
  SimulatedBackendOptions refusing;
  refusing.refuse_host_registration = true;
  auto strict = CreateSimulatedBackend(refusing);
  std::unique_ptr<Pipeline> other = *CreateTinyPipeline({});
  PlacementManager refused(strict.get());
  refused.set_pin_host_copies(true);
  for (Component* c : other->components()) ASSERT_TRUE(refused.Register("other", c).ok());
  ASSERT_FALSE(refused.Warnings().empty());
  EXPECT_NE(refused.Warnings().front().find("host copies of 'other/"), std::string::npos) << refused.Warnings().front();
  EXPECT_EQ(refused.DecisionLog(1).back().action, "pin_failed");
  image = other->Run(params, refused, context);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);
  refused.Unregister("other");
  EXPECT_TRUE(refused.Warnings().empty());
}

// Enabling group offloading on a full device (an admin change at run time) makes room for the
// component's slots by moving the other components off, recorded with the reason, instead of
// failing with out of memory.
TEST(PlacementManagerTest, EnablingGroupOffloadOnAFullDeviceMakesRoom) {
  Harness h;
  auto expected = h.Generate();  // Everything of "tiny" resident.
  ASSERT_TRUE(expected.ok());
  std::unique_ptr<Pipeline> other = *CreateTinyPipeline({});
  for (Component* c : other->components()) ASSERT_TRUE(h.placement.Register("other", c).ok());
  const int64_t full = h.backend->GetMemoryStats().allocated_bytes;
  ASSERT_TRUE(h.backend->SetMemoryBudget(full).ok());  // Not a byte free.
  GroupOffloadOptions options;
  options.use_stream = true;
  const absl::Status enabled = h.placement.EnableGroupOffload("other/transformer", options);
  EXPECT_TRUE(enabled.ok()) << enabled;
  bool made_room = false;
  for (const PlacementDecision& d : h.placement.DecisionLog(100)) {
    made_room |= d.action == "offload" && d.reason == "make room for group offloading other/transformer";
  }
  EXPECT_TRUE(made_room);
  EXPECT_LE(h.backend->GetMemoryStats().allocated_bytes, full);
  auto image = h.Generate();
  EXPECT_TRUE(image.ok()) << image.status();
  if (image.ok()) {
    EXPECT_EQ(image->rgb, expected->rgb);
  }
  h.placement.Unregister("other");  // Before its components go.
}

TEST(PlacementManagerTest, PrefetchingTheNextComponentSparesItsFirstSynchronousOnload) {
  for (const bool prefetch : {true, false}) {
    SCOPED_TRACE(prefetch);
    Harness s;
    s.placement.set_prefetch_next_component(prefetch);
    PipelineGroupOffloadOptions options;
    options.defaults.use_stream = true;
    ASSERT_TRUE(s.placement.EnablePipelineGroupOffload("tiny", options).ok());
    ASSERT_TRUE(s.Generate().ok());  // The first forwards record each component's order.
    auto sync = [&](const std::string& name) {
      return s.placement.GroupOffloadStatsOf("tiny/" + name)->sync_onloads;
    };
    const int64_t transformer_before = sync("transformer"), vae_before = sync("vae");
    ASSERT_TRUE(s.Generate().ok());
    int prefetches = 0;
    for (const PlacementDecision& d : s.placement.DecisionLog(1000)) prefetches += d.action == "prefetch";
    if (prefetch) {
      EXPECT_EQ(sync("transformer"), transformer_before);
      EXPECT_EQ(sync("vae"), vae_before);
      EXPECT_GT(s.placement.GroupOffloadStatsOf("tiny/transformer")->early_prefetches, 0);
      EXPECT_GT(s.placement.GroupOffloadStatsOf("tiny/vae")->early_prefetches, 0);
      EXPECT_EQ(prefetches, 2);  // The second request: the transformer and the VAE (the first recorded).
    } else {
      EXPECT_GT(sync("transformer"), transformer_before);
      EXPECT_GT(sync("vae"), vae_before);
      EXPECT_EQ(prefetches, 0);
    }
  }
}

TEST(PlacementManagerTest, BudgetedGroupOffloadIsPartiallyResidentAndStillNeverMoved) {
  Harness s;
  const int64_t tr = s.View("transformer").weight_bytes;
  GroupOffloadOptions options;
  options.use_stream = true;
  options.budget_bytes = tr * 19 / 20;  // Two slots, the always-on group and one resident block.
  ASSERT_TRUE(s.placement.EnableGroupOffload("tiny/transformer", options).ok());
  EXPECT_EQ(s.View("transformer").state, ComponentState::kPartiallyResident);
  EXPECT_LE(s.View("transformer").device_bytes, options.budget_bytes);
  EXPECT_GT(s.placement.GroupOffloadStatsOf("tiny/transformer")->resident_groups, 0);
  s.placement.SetStrategy(*MakeCustomStrategy("lru"));
  ASSERT_TRUE(s.Generate().ok());
  EXPECT_EQ(s.View("transformer").state, ComponentState::kPartiallyResident);
  EXPECT_EQ(s.placement.Warnings().size(), 0u);
}

TEST(PlacementManagerTest, PipelineLevelWithExclusionsOverridesAndAllOrNothing) {
  Harness s;
  PipelineGroupOffloadOptions options;
  options.defaults.use_stream = true;
  options.exclude = {"vae"};
  GroupOffloadOptions leaf;
  leaf.type = OffloadType::kLeafLevel;
  options.overrides["text_encoder"] = leaf;
  ASSERT_TRUE(s.placement.EnablePipelineGroupOffload("tiny", options).ok());
  EXPECT_EQ(s.View("text_encoder").state, ComponentState::kGroupOffloaded);
  EXPECT_EQ(s.View("transformer").state, ComponentState::kGroupOffloaded);
  EXPECT_EQ(s.View("vae").state, ComponentState::kOffloaded);
  EXPECT_EQ(s.placement.GroupOffloadStatsOf("tiny/text_encoder")->streamed_groups,
            // Leaf level: every leaf with weights (2 layers × 8 leaves: norm1, to_q/k/v/out, norm2,
            // fc1, fc2; the embedding; the final norm). The root's position is always-on.
            2 * 8 + 2);
  ASSERT_TRUE(s.Generate().ok());

  Harness t;
  PipelineGroupOffloadOptions bad;
  bad.exclude = {"unet"};
  EXPECT_EQ(t.placement.EnablePipelineGroupOffload("tiny", bad).code(), absl::StatusCode::kInvalidArgument);
  PipelineGroupOffloadOptions partly_bad;
  GroupOffloadOptions impossible;
  impossible.budget_bytes = 1;  // Refused for the VAE, after the others were enabled.
  partly_bad.overrides["vae"] = impossible;
  const absl::Status status = t.placement.EnablePipelineGroupOffload("tiny", partly_bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("tiny_vae"), std::string::npos) << status;
  for (const ComponentView& v : t.placement.Snapshot()) {
    EXPECT_EQ(v.state, ComponentState::kOffloaded) << v.id;  // Rolled back.
  }
  EXPECT_EQ(t.placement.EnablePipelineGroupOffload("sdxl", {}).code(), absl::StatusCode::kNotFound);
}

int64_t Bytes(Harness& h, const std::string& name) {
  for (Component* c : h.pipeline->components()) {
    if (c->name() == name) return c->weight_bytes();
  }
  return -1;
}

int64_t PeakOfOneRequest(Harness& h) {
  h.backend->ResetPeakStats();
  EXPECT_TRUE(h.Generate().ok());
  return h.backend->GetMemoryStats().peak_allocated_bytes;
}

// The four modes of the upstream demo (ANCHORS.md), on the simulated device with a budget.
TEST(PlacementScenarioTest, FourModesHaveExactPeaks) {
  const int64_t budget = int64_t{64} << 20;
  Harness all;
  ASSERT_TRUE(all.backend->SetMemoryBudget(budget).ok());
  const int64_t te = Bytes(all, "text_encoder");
  const int64_t tr = Bytes(all, "transformer");
  const int64_t vae = Bytes(all, "vae");
  // 1. Everything resident (the default footprint strategy never fires: it all fits).
  EXPECT_EQ(PeakOfOneRequest(all), te + tr + vae);
  for (const PlacementDecision& d : all.placement.DecisionLog(100)) EXPECT_NE(d.action, "offload");
  // 2. Footprint auto on a budget that fits: same peak, nothing moved.
  Harness footprint;
  ASSERT_TRUE(footprint.backend->SetMemoryBudget(te + tr + vae).ok());
  EXPECT_EQ(footprint.placement.SetStrategy(MakeFootprintStrategy(0)), "");
  EXPECT_EQ(PeakOfOneRequest(footprint), te + tr + vae);
  // 3. Workflow "text encoders only": the text encoder leaves before the transformer runs.
  Harness workflow;
  ASSERT_TRUE(workflow.backend->SetMemoryBudget(budget).ok());
  workflow.placement.SetStrategy(*MakeCustomStrategy("text-encoders-only"));
  EXPECT_EQ(PeakOfOneRequest(workflow), std::max(te, tr + vae));
  // 4. The same with the transformer group-offloaded: it is never moved; its slot ring exists only
  // while it runs (given back while the text encoder and the VAE run).
  Harness grouped;
  ASSERT_TRUE(grouped.backend->SetMemoryBudget(budget).ok());
  grouped.placement.SetStrategy(*MakeCustomStrategy("text-encoders-only"));
  GroupOffloadOptions options;
  options.use_stream = true;
  ASSERT_TRUE(grouped.placement.EnableGroupOffload("tiny/transformer", options).ok());
  const GroupOffloadStats stats = *grouped.placement.GroupOffloadStatsOf("tiny/transformer");
  const int64_t slots = stats.slots * stats.slot_bytes;
  EXPECT_EQ(PeakOfOneRequest(grouped), std::max({te, slots + stats.always_on_bytes, vae}));
  EXPECT_LT(std::max({te, slots + stats.always_on_bytes, vae}), std::max(te, tr + vae));
  int releases = 0;
  for (const PlacementDecision& d : grouped.placement.DecisionLog(100)) {
    if (d.component == "tiny/transformer") {
      EXPECT_NE(d.action, "offload");
    }
    if (d.component == "tiny/transformer" && d.action == "release_slots") {
      ++releases;
      EXPECT_EQ(d.free_after - d.free_before, slots);  // Given back to the device's budget.
    }
  }
  // Enable allocated the ring; the text encoder's run gave it back, the transformer's forwards took
  // it again, the VAE's run gave it back.
  EXPECT_EQ(releases, 2);
  EXPECT_TRUE(grouped.placement.Warnings().empty());  // Not a footprint strategy.
  EXPECT_NE(grouped.placement.SetStrategy(MakeFootprintStrategy(0)), "");
  EXPECT_EQ(grouped.placement.Warnings().size(), 1u);
}

TEST(PlacementScenarioTest, FootprintEvictsUnderABudgetAndRecordsWhy) {
  Harness h;
  const int64_t tr = Bytes(h, "transformer");
  const int64_t vae = Bytes(h, "vae");
  // Room for the transformer and the VAE, not for all three.
  ASSERT_TRUE(h.backend->SetMemoryBudget(tr + vae).ok());
  ASSERT_TRUE(h.Generate().ok());
  EXPECT_LE(h.backend->GetMemoryStats().peak_allocated_bytes, tr + vae);
  ASSERT_TRUE(h.Generate().ok());  // The text encoder comes back: something must go again.
  bool evicted = false;
  for (const PlacementDecision& d : h.placement.DecisionLog(100)) {
    if (d.action == "offload") {
      evicted = true;
      EXPECT_EQ(d.strategy, "footprint");
      EXPECT_NE(d.reason.find("make room for"), std::string::npos) << d.reason;
      EXPECT_GE(d.free_after, d.free_before);
    }
  }
  EXPECT_TRUE(evicted);
}

// A component whose run allocates more than the free memory (a VAE decoding at 1024², beside a
// resident text encoder and transformer) runs out once; placement remembers what its run took and
// from then on makes that room before it runs — moving off the fewest bytes that suffice, instead of
// the out-of-memory recovery throwing every other component off the device on every request.
TEST(PlacementScenarioTest, WhatARunAllocatesIsRoomMadeBeforeItsNextRun) {
  Harness h;
  (void)h.placement.SetStrategy(MakeFootprintStrategy(0));
  Component* text_encoder = h.pipeline->components().front();
  Component* transformer = h.pipeline->components()[1];
  Component* vae = h.pipeline->components().back();
  const int64_t te = text_encoder->weight_bytes(), tr = transformer->weight_bytes(), v = vae->weight_bytes();
  const int64_t smaller = std::min(te, tr);
  const int64_t slack = smaller / 2;
  const int64_t activations = smaller;  // More than the slack, less than the slack and either one.
  const auto nothing = [] {};
  ASSERT_TRUE(h.backend->SetMemoryBudget(te + tr + v + slack).ok());
  ASSERT_TRUE(h.placement.Run(*text_encoder, nothing).ok());
  ASSERT_TRUE(h.placement.Run(*transformer, nothing).ok());
  EXPECT_EQ(h.View("vae").run_headroom_bytes, 0);
  // First run: out of memory, recovered by moving everything else off.
  ASSERT_TRUE(h.placement.Run(*vae, h.Allocating(activations)).ok());
  EXPECT_EQ(h.placement.TakeSnapshot().counters.oom_recoveries, 1);
  EXPECT_EQ(h.View("text_encoder").state, ComponentState::kOffloaded);
  EXPECT_EQ(h.View("transformer").state, ComponentState::kOffloaded);
  EXPECT_EQ(h.View("vae").run_headroom_bytes, activations);
  // The next request: the encoder and transformer come back; before the VAE runs, only the smaller
  // of them leaves, and no out-of-memory happens.
  ASSERT_TRUE(h.placement.Run(*text_encoder, nothing).ok());
  ASSERT_TRUE(h.placement.Run(*transformer, nothing).ok());
  const int64_t decisions_before = h.placement.DecisionLog(1000).size();
  ASSERT_TRUE(h.placement.Run(*vae, h.Allocating(activations)).ok());
  EXPECT_EQ(h.placement.TakeSnapshot().counters.oom_recoveries, 1);
  const std::string kept = te <= tr ? "transformer" : "text_encoder";
  const std::string moved = te <= tr ? "text_encoder" : "transformer";
  EXPECT_EQ(h.View(kept).state, ComponentState::kResident);
  EXPECT_EQ(h.View(moved).state, ComponentState::kOffloaded);
  const std::vector<PlacementDecision> log = h.placement.DecisionLog(1000);
  int offloads = 0;
  for (size_t i = decisions_before; i < log.size(); ++i) {
    EXPECT_NE(log[i].action, "oom");
    if (log[i].action != "offload") continue;
    ++offloads;
    EXPECT_EQ(log[i].component, "tiny/" + moved);
    EXPECT_NE(log[i].reason.find(absl::StrCat(activations, " bytes its runs allocate")), std::string::npos)
        << log[i].reason;
  }
  EXPECT_EQ(offloads, 1);
  // Within the budget throughout.
  EXPECT_LE(h.backend->GetMemoryStats().peak_allocated_bytes, te + tr + v + slack);
}

TEST(PlacementScenarioTest, OutOfMemoryIsRecoveredByGroupOffloadingAndTheImageIsExact) {
  Harness reference;
  auto expected = reference.Generate();
  ASSERT_TRUE(expected.ok());
  Harness h;
  const int64_t tr = Bytes(h, "transformer");
  // Less than the transformer alone: only group offloading lets it run.
  ASSERT_TRUE(h.backend->SetMemoryBudget(tr * 3 / 4).ok());
  auto image = h.Generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);
  EXPECT_GE(h.placement.TakeSnapshot().counters.oom_recoveries, 1);
  EXPECT_EQ(h.View("transformer").state, ComponentState::kGroupOffloaded);
  // Its host copy pinned where it was: no second, packed pinned copy.
  auto recovered = h.placement.GroupOffloadStatsOf("tiny/transformer");
  ASSERT_TRUE(recovered.ok());
  EXPECT_GT(recovered->pinned_in_place_bytes, 0) << recovered->pin_in_place_error;
  EXPECT_EQ(recovered->pinned_host_bytes, 0);
  bool saw_oom = false, saw_group_offload = false;
  for (const PlacementDecision& d : h.placement.DecisionLog(100)) {
    saw_oom |= d.action == "oom";
    saw_group_offload |= d.action == "group_offload" && d.component == "tiny/transformer";
  }
  EXPECT_TRUE(saw_oom);
  EXPECT_TRUE(saw_group_offload);
  // Far too small for anything: a clear, non-retryable OUT_OF_RANGE ("cannot fit", not "busy"),
  // and what was tried.
  Harness tiny;
  ASSERT_TRUE(tiny.backend->SetMemoryBudget(1024).ok());
  auto failed = tiny.Generate();
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kOutOfRange);
  EXPECT_TRUE(IsCannotFit(failed.status())) << failed.status();
  EXPECT_NE(std::string(failed.status().message()).find("retrying will not help"), std::string::npos);
  EXPECT_NE(std::string(failed.status().message()).find("group offloading it failed too"), std::string::npos)
      << failed.status();
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// Peer eviction at the placement level: a peer (a second simulated device with its own registry)
// adopts what this device's strategy evicts when the device-to-device copy is cheaper than bringing
// it back from the host, copying it device to device (no host-to-device bytes on the peer).
SimulatedBackendOptions PeerOptions() {
  SimulatedBackendOptions options;
  options.index = 1;
  return options;
}

struct PeerHarness {
  explicit PeerHarness(double peer_bandwidth, double host_bandwidth)
      : peer_backend(CreateSimulatedBackend(PeerOptions())), peer(peer_backend.get()) {
    PeerEviction eviction;
    eviction.peer_bytes_per_second = peer_bandwidth;
    eviction.host_to_device_bytes_per_second = host_bandwidth;
    eviction.eligible = [](const std::string& pipeline) { return pipeline == "tiny"; };
    eviction.peers = [this] {
      return std::vector<std::pair<std::string, int64_t>>{{"sim:1", peer_backend->GetMemoryStats().free_bytes()}};
    };
    eviction.move = [this](const std::string& pipeline, Component& component, const std::string& device) {
      EXPECT_EQ(device, "sim:1");
      return peer.AdoptFromPeer(pipeline, component, "test");
    };
    h.placement.SetPeerEviction(std::move(eviction));
  }
  std::unique_ptr<DeviceBackend> peer_backend;
  PlacementManager peer;
  Harness h;
};

int64_t WeightOf(Harness& h, const std::string& name) { return h.View(name).weight_bytes; }

TEST(PeerEvictionTest, ACheaperPeerAdoptsTheEvictedComponentDeviceToDevice) {
  PeerHarness p(/*peer_bandwidth=*/1e11, /*host_bandwidth=*/1e9);
  const int64_t te = WeightOf(p.h, "text_encoder"), tr = WeightOf(p.h, "transformer"), vae = WeightOf(p.h, "vae");
  ASSERT_TRUE(p.h.backend->SetMemoryBudget(tr + vae).ok());  // Room for two of the three.
  ASSERT_TRUE(p.h.Generate().ok());
  std::vector<PlacementDecision> moves;
  for (const PlacementDecision& d : p.h.placement.DecisionLog(100)) {
    if (d.action == "offload_to_peer") moves.push_back(d);
  }
  ASSERT_EQ(moves.size(), 1u);
  const PlacementDecision& d = moves.front();
  EXPECT_EQ(d.to_device, "sim:1");
  EXPECT_DOUBLE_EQ(d.d2d_seconds, static_cast<double>(d.bytes) / 1e11);
  EXPECT_DOUBLE_EQ(d.h2d_seconds, static_cast<double>(d.bytes) / 1e9);
  // Exact bytes: the moved component lives on the peer now, copied from device to device.
  const DeviceMemoryStats peer = p.peer_backend->GetMemoryStats();
  EXPECT_EQ(peer.allocated_bytes, d.bytes);
  EXPECT_EQ(peer.peer_to_device_bytes, d.bytes);
  EXPECT_EQ(peer.host_to_device_bytes, 0);
  EXPECT_EQ(p.h.backend->GetMemoryStats().allocated_bytes + peer.allocated_bytes, te + tr + vae);
  ASSERT_EQ(p.peer.Snapshot().size(), 1u);
  EXPECT_EQ(p.peer.Snapshot()[0].id, d.component);
  EXPECT_EQ(p.peer.Snapshot()[0].state, ComponentState::kResident);
  for (const ComponentView& v : p.h.placement.Snapshot()) EXPECT_NE(v.id, d.component);
  p.peer.Unregister("tiny");
  EXPECT_EQ(p.peer_backend->GetMemoryStats().allocated_bytes, 0);
}

std::unique_ptr<Component> AdapterComponent(int64_t rank);  // Below.

// A LoRA adapter is never peer-evicted: the layers that read it run here. Evicted to make room, it
// goes to the host even when a peer would be cheaper.
TEST(PeerEvictionTest, AnAdapterGoesToTheHostNeverToAPeer) {
  auto adapter = AdapterComponent(64);  // Outlives the managers that register it.
  PeerHarness p(/*peer_bandwidth=*/1e11, /*host_bandwidth=*/1e9);
  ASSERT_TRUE(p.h.placement.Register("tiny", adapter.get()).ok());
  const int64_t tr = WeightOf(p.h, "transformer");
  ASSERT_TRUE(p.h.backend->SetMemoryBudget(tr + (int64_t{1} << 20)).ok());  // The transformer, little else.
  ASSERT_TRUE(p.h.placement.Hold(*adapter, "a batch").ok());
  p.h.placement.Unhold(*adapter);  // Resident, no longer held: a candidate for eviction.
  ASSERT_TRUE(p.h.Generate().ok());
  bool offloaded = false;
  for (const PlacementDecision& d : p.h.placement.DecisionLog(100)) {
    if (d.component != "tiny/lora:style") continue;
    EXPECT_NE(d.action, "offload_to_peer");
    offloaded = offloaded || d.action == "offload";
  }
  EXPECT_TRUE(offloaded) << "the budget never made the adapter move: the test proves nothing";
  for (const ComponentView& v : p.peer.Snapshot()) EXPECT_NE(v.id, "tiny/lora:style");
  p.peer.Unregister("tiny");
}

TEST(PeerEvictionTest, TheHostWinsWhenBringingItBackIsCheaper) {
  PeerHarness p(/*peer_bandwidth=*/1e9, /*host_bandwidth=*/1e11);
  const int64_t tr = WeightOf(p.h, "transformer"), vae = WeightOf(p.h, "vae");
  ASSERT_TRUE(p.h.backend->SetMemoryBudget(tr + vae).ok());
  ASSERT_TRUE(p.h.Generate().ok());
  int declined = 0, offloads = 0, moved = 0;
  for (const PlacementDecision& d : p.h.placement.DecisionLog(100)) {
    if (d.action == "peer_declined") {
      ++declined;
      EXPECT_EQ(d.to_device, "");
      EXPECT_DOUBLE_EQ(d.d2d_seconds, static_cast<double>(d.bytes) / 1e9);
      EXPECT_DOUBLE_EQ(d.h2d_seconds, static_cast<double>(d.bytes) / 1e11);
    }
    offloads += d.action == "offload";
    moved += d.action == "offload_to_peer";
  }
  EXPECT_GE(declined, 1);
  EXPECT_EQ(offloads, declined);
  EXPECT_EQ(moved, 0);
  EXPECT_EQ(p.peer_backend->GetMemoryStats().allocated_bytes, 0);
  EXPECT_TRUE(p.peer.Snapshot().empty());
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// A LoRA adapter's module as its own component: `rank` x 4096 matrices (float32).
std::unique_ptr<Component> AdapterComponent(int64_t rank) {
  LoraWeights w;
  w.down = at::randn({rank, 4096});
  w.up = at::randn({4096, rank});
  LoraAdapterModule made = MakeLoraAdapterModule({{"layer", &w}}, {at::kFloat});
  return std::move(*Component::Create("lora:style", std::move(made.module), at::kFloat));
}

// Adapters are placed like components but held: every adapted layer reads them while its own
// component runs, so while a run holds one, no other component's move evicts it; released, it
// moves like any other. Holds nest; a held or adapter component is never group-offloaded.
TEST(PlacementManagerTest, AHeldComponentStaysResidentWhileOthersMoveAndMovesOnceReleased) {
  auto adapter = AdapterComponent(64);  // 2 MiB. Outlives the manager that registers it.
  Harness s;
  ASSERT_TRUE(s.placement.Register("tiny", adapter.get()).ok());
  int64_t largest = 0;
  for (Component* c : s.pipeline->components()) largest = std::max(largest, c->weight_bytes());
  const int64_t margin = int64_t{1} << 20;  // The tiny pipeline's activations.
  ASSERT_TRUE(s.backend->SetMemoryBudget(largest + adapter->weight_bytes() + margin).ok());

  ASSERT_TRUE(s.placement.Hold(*adapter, "held for the test").ok());
  ASSERT_TRUE(s.placement.Hold(*adapter, "again (nested)").ok());
  EXPECT_EQ(s.View("lora:style").state, ComponentState::kResident);
  ASSERT_TRUE(s.Generate().ok());
  EXPECT_EQ(s.View("lora:style").state, ComponentState::kResident);
  int offloads_of_others = 0;
  for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
    EXPECT_FALSE(d.component == "tiny/lora:style" && d.action == "offload") << d.reason;
    if (d.action == "offload") ++offloads_of_others;
    if (d.component == "tiny/lora:style" && d.action == "onload") {
      EXPECT_EQ(d.reason, "held for the test");
    }
  }
  EXPECT_GT(offloads_of_others, 0) << "the budget made nothing move: the test proves nothing";
  // Never group-offloaded: not while held, and not as an adapter.
  GroupOffloadOptions options;
  EXPECT_EQ(s.placement.EnableGroupOffload("tiny/lora:style", options).code(), absl::StatusCode::kFailedPrecondition);

  // Released (both holds), with no room for it beside the transformer: it moves off.
  s.placement.Unhold(*adapter);
  ASSERT_TRUE(s.Generate().ok());
  EXPECT_EQ(s.View("lora:style").state, ComponentState::kResident) << "still held once";
  s.placement.Unhold(*adapter);
  ASSERT_TRUE(s.backend->SetMemoryBudget(largest + margin).ok());
  ASSERT_TRUE(s.Generate().ok());
  EXPECT_EQ(s.View("lora:style").state, ComponentState::kOffloaded);
}

TEST(PlacementManagerTest, AHoldThatCannotFitFailsNamingTheComponentAndHoldsNothing) {
  auto adapter = AdapterComponent(64);  // Outlives the manager that registers it.
  Harness s;
  ASSERT_TRUE(s.placement.Register("tiny", adapter.get()).ok());
  ASSERT_TRUE(s.backend->SetMemoryBudget(adapter->weight_bytes() / 2).ok());
  const absl::Status held = s.placement.Hold(*adapter, "too big");
  EXPECT_EQ(held.code(), absl::StatusCode::kOutOfRange) << held;  // The cannot-fit status.
  EXPECT_NE(held.message().find("tiny/lora:style"), std::string::npos) << held;
  EXPECT_EQ(s.View("lora:style").state, ComponentState::kOffloaded);
  // Not held: with room again it is an ordinary candidate; an unregistered component is refused.
  ASSERT_TRUE(s.backend->SetMemoryBudget(int64_t{1} << 30).ok());
  ASSERT_TRUE(s.placement.Hold(*adapter, "fits now").ok());
  s.placement.Unhold(*adapter);
  auto stranger = AdapterComponent(4);
  EXPECT_EQ(s.placement.Hold(*stranger, "x").code(), absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// A module that keeps something on the device besides its weights (as a model's captured CUDA
// graphs do: models/core/step_graphs.h), counting the calls that free it.
class CacheHolder : public Module {
 public:
  CacheHolder() : Module("CacheHolder") { AddParameter("weight", at::zeros({256, 256})); }
  // What a run on the device would leave behind (a capture).
  void Keep(int64_t bytes) { held_ = bytes; }
  int64_t ReleaseDeviceCaches() override {
    const int64_t freed = held_;
    released += freed;
    held_ = 0;
    return freed;
  }
  int64_t released = 0;  // Bytes freed so far.

 private:
  int64_t held_ = 0;
};

// Without a budget nothing asks for idle components' caches; under one, they go before weights
// move to make room (recorded under the idle component), and a component's own go when its weights
// leave the device.
TEST(PlacementManagerTest, DeviceCachesOfIdleComponentsGoUnderABudgetBeforeWeightsMove) {
  for (const bool budget : {false, true}) {
    SCOPED_TRACE(budget ? "budget" : "no budget");
    Harness s;
    auto owned = std::make_unique<CacheHolder>();
    CacheHolder* holder = owned.get();
    auto component = Component::Create("cache_holder", std::move(owned), at::kFloat);
    ASSERT_TRUE(component.ok()) << component.status();
    ASSERT_TRUE(s.placement.Register("tiny", component->get()).ok());
    ASSERT_TRUE(s.placement.Hold(**component, "make it resident").ok());
    s.placement.Unhold(**component);  // Resident and idle.
    holder->Keep(12345);
    if (budget) {
      // Room for the largest component and little else: every component run moves weights.
      int64_t largest = 0;
      for (Component* c : s.pipeline->components()) largest = std::max(largest, c->weight_bytes());
      ASSERT_TRUE(s.backend->SetMemoryBudget(largest + (int64_t{1} << 20)).ok());
    }
    ASSERT_TRUE(s.Generate().ok());
    bool recorded = false, offloaded = false;
    for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
      if (d.action == "release_graphs") {
        recorded = true;
        EXPECT_EQ(d.component, "tiny/cache_holder");
        EXPECT_EQ(d.bytes, 12345) << d.reason;
        EXPECT_NE(d.reason.find("its captured graphs go before weights move"), std::string::npos) << d.reason;
        EXPECT_FALSE(offloaded) << "released after weights had already moved";
      }
      offloaded = offloaded || d.action == "offload";
    }
    if (!budget) {
      EXPECT_EQ(holder->released, 0) << "no budget: nothing to make room for";
      EXPECT_FALSE(recorded);
      // Its weights leave the device (the pipeline unloads): its caches go with them.
      s.placement.Unregister("tiny");
      EXPECT_EQ(holder->released, 12345);
    } else {
      EXPECT_EQ(holder->released, 12345);
      EXPECT_TRUE(recorded);
      EXPECT_TRUE(offloaded) << "the budget made nothing move: the test proves nothing";
      s.placement.Unregister("tiny");  // Before the component goes: it must outlive its registration.
    }
  }
}

// Two tiny pipelines on one simulated device whose host copies are pinned ("a" and "b", b's weights
// from another seed), for the cross-pipeline prefetch.
struct TwoPipelines {
  explicit TwoPipelines(SimulatedBackendOptions options = {}, bool pin = true, bool ready = true)
      : backend(CreateSimulatedBackend(options)), placement(backend.get()) {
    placement.set_pin_host_copies(pin);
    TinyPipelineOptions a_options;
    a_options.name = "a";
    TinyPipelineOptions b_options;
    b_options.name = "b";
    b_options.weight_seed = 7;
    a = *CreateTinyPipeline(a_options);
    b = *CreateTinyPipeline(b_options);
    for (Component* c : a->components()) EXPECT_TRUE(placement.Register("a", c).ok());
    for (Component* c : b->components()) EXPECT_TRUE(placement.Register("b", c).ok());
    placement.MarkReady("a");
    if (ready) placement.MarkReady("b");
  }
  absl::StatusOr<Image> Generate(Pipeline& pipeline) {
    RunContext context(nullptr, nullptr);
    return pipeline.Run(HarbourParams(), placement, context);
  }
  static std::vector<const Component*> Components(Pipeline& pipeline) {
    std::vector<const Component*> out;
    for (Component* c : pipeline.components()) out.push_back(c);
    return out;
  }
  static int64_t Bytes(Pipeline& pipeline) {
    int64_t bytes = 0;
    for (Component* c : pipeline.components()) bytes += c->weight_bytes();
    return bytes;
  }
  int Decisions(const std::string& action) const {
    int n = 0;
    for (const PlacementDecision& d : placement.DecisionLog(1000)) n += d.action == action ? 1 : 0;
    return n;
  }
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<Pipeline> a;
  std::unique_ptr<Pipeline> b;
  PlacementManager placement;
};

// b's image with nothing prefetched, for comparison.
absl::StatusOr<Image> ImageOfB() {
  TwoPipelines plain;
  return plain.Generate(*plain.b);
}

// While "a" has nothing more to copy, b's offloaded components start copying (on a slow link: still
// arriving when the call returns) without evicting anything; b's run then onloads nothing, waits for
// the copies, and its image is exact; the counters and the decision log say what happened.
TEST(PipelinePrefetchTest, TheNextPipelineCopiesWhileTheRunningOneNeedsNothingMore) {
  const absl::StatusOr<Image> expected = ImageOfB();
  ASSERT_TRUE(expected.ok()) << expected.status();
  SimulatedBackendOptions slow;
  slow.bandwidth_bytes_per_second = 20'000'000;
  TwoPipelines s(slow);
  ASSERT_TRUE(s.Generate(*s.a).ok());
  const PlacementCounters before = s.placement.TakeSnapshot().counters;
  const int64_t b_bytes = TwoPipelines::Bytes(*s.b);
  EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "b waits next"), b_bytes);
  for (Component* c : s.b->components()) EXPECT_EQ(s.placement.StateOf(*c), ComponentState::kResident) << c->name();
  for (Component* c : s.a->components()) EXPECT_EQ(s.placement.StateOf(*c), ComponentState::kResident) << c->name();
  EXPECT_EQ(s.Decisions("prefetch_pipeline"), static_cast<int>(s.b->components().size()));
  for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
    if (d.action == "prefetch_pipeline") {
      EXPECT_NE(d.reason.find("b waits next"), std::string::npos) << d.reason;
    }
  }
  PlacementCounters c = s.placement.TakeSnapshot().counters;
  EXPECT_EQ(c.pipeline_prefetches, static_cast<int64_t>(s.b->components().size()));
  EXPECT_EQ(c.pipeline_prefetch_bytes, b_bytes);
  EXPECT_EQ(c.onload_bytes - before.onload_bytes, b_bytes);
  EXPECT_EQ(c.offloads, before.offloads);
  const absl::StatusOr<Image> image = s.Generate(*s.b);
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);
  c = s.placement.TakeSnapshot().counters;
  EXPECT_EQ(c.onload_bytes - before.onload_bytes, b_bytes);  // Its run onloaded nothing more.
  EXPECT_EQ(c.pipeline_prefetches_used, static_cast<int64_t>(s.b->components().size()));
  EXPECT_EQ(c.pipeline_prefetch_used_bytes, b_bytes);
  EXPECT_EQ(c.pipeline_prefetches_unused, 0);
  EXPECT_EQ(s.backend->GetMemoryStats().allocated_bytes, TwoPipelines::Bytes(*s.a) + b_bytes);
  // Nothing is left to prefetch: a second call starts nothing.
  EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "again"), 0);
}

// A request of the next pipeline that did not run what was prefetched for it (its last run did,
// this one did not: an image encoder, say) ends with it counted unused, and the strategy may move
// it again; what was prefetched for another pipeline keeps its mark.
TEST(PipelinePrefetchTest, WhatARunOfItsPipelineDidNotUseCountsAsUnused) {
  TwoPipelines s;
  ASSERT_TRUE(s.Generate(*s.a).ok());
  ASSERT_GT(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
  s.placement.EndPipelineRun("a");
  EXPECT_EQ(s.placement.TakeSnapshot().counters.pipeline_prefetches_unused, 0);
  s.placement.EndPipelineRun("b");
  const int64_t n = static_cast<int64_t>(s.b->components().size());
  EXPECT_EQ(s.placement.TakeSnapshot().counters.pipeline_prefetches_unused, n);
  s.placement.EndPipelineRun("b");
  ASSERT_TRUE(s.Generate(*s.b).ok());
  const PlacementCounters c = s.placement.TakeSnapshot().counters;
  EXPECT_EQ(c.pipeline_prefetches_unused, n);
  EXPECT_EQ(c.pipeline_prefetches_used, 0);
}

// Only the components the next request runs, in the order it runs them: one it does not run (here
// b's transformer, left out of the order) stays on the host.
TEST(PipelinePrefetchTest, OnlyWhatTheNextRequestRunsInItsOrder) {
  TwoPipelines s;
  ASSERT_TRUE(s.Generate(*s.a).ok());
  const std::vector<Component*> b = s.b->components();
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(s.placement.PrefetchPipeline("b", {b[2], b[0]}, TwoPipelines::Components(*s.a), "r"),
            b[2]->weight_bytes() + b[0]->weight_bytes());
  EXPECT_EQ(s.placement.StateOf(*b[1]), ComponentState::kOffloaded);
  std::vector<std::string> order;
  for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
    if (d.action == "prefetch_pipeline") order.push_back(d.component);
  }
  EXPECT_EQ(order, (std::vector<std::string>{"b/" + b[2]->name(), "b/" + b[0]->name()}));
}

// A prefetch never holds up the running request, never evicts, and takes only what qualifies.
TEST(PipelinePrefetchTest, OnlyWhenTheRunningRequestCopiesNothingMoreAndWhatFits) {
  {
    // a has not run: its components are offloaded, so its run still copies.
    TwoPipelines s;
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    // Only what is left of the run counts: a's transformer and VAE are still offloaded.
    Component* text_encoder = s.a->components().front();
    ASSERT_TRUE(s.placement.Run(*text_encoder, [] {}).ok());
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    EXPECT_EQ(s.Decisions("prefetch_pipeline"), 0);
  }
  {
    // A group-offloaded component still to run streams: nothing.
    TwoPipelines s;
    ASSERT_TRUE(s.Generate(*s.a).ok());
    GroupOffloadOptions options;
    options.use_stream = true;
    ASSERT_TRUE(s.placement.EnableGroupOffload("a/transformer", options).ok());
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    // Past it (only the VAE left), b may come.
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), {s.a->components().back()}, "r"), TwoPipelines::Bytes(*s.b));
  }
  {
    // Room: the budget leaves space for b's smallest component only; nothing of a moves.
    std::vector<int64_t> sizes;
    TwoPipelines probe;
    for (Component* c : probe.b->components()) sizes.push_back(c->weight_bytes());
    const int64_t smallest = *std::min_element(sizes.begin(), sizes.end());
    for (int64_t bytes : sizes) ASSERT_TRUE(bytes == smallest || bytes > smallest + smallest / 2) << bytes;
    SimulatedBackendOptions budget;
    budget.budget_bytes = TwoPipelines::Bytes(*probe.a) + smallest + smallest / 2;
    TwoPipelines s(budget);
    ASSERT_TRUE(s.Generate(*s.a).ok());
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), smallest);
    for (Component* c : s.a->components()) EXPECT_EQ(s.placement.StateOf(*c), ComponentState::kResident) << c->name();
    EXPECT_EQ(s.placement.TakeSnapshot().counters.offloads, 0);
  }
  {
    // Host copies not page-locked: an onload would hold up the worker.
    TwoPipelines s({}, /*pin=*/false);
    ASSERT_TRUE(s.Generate(*s.a).ok());
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
  }
  {
    // b still loading; then switched off; an unknown pipeline; the running pipeline itself.
    TwoPipelines s({}, true, /*ready=*/false);
    ASSERT_TRUE(s.Generate(*s.a).ok());
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    s.placement.MarkReady("b");
    s.placement.set_prefetch_next_pipeline(false);
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    s.placement.set_prefetch_next_pipeline(true);
    EXPECT_EQ(s.placement.PrefetchPipeline("nope", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    EXPECT_EQ(s.placement.PrefetchPipeline("", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    EXPECT_EQ(s.Decisions("prefetch_pipeline"), 0);
  }
}

// The next request's first streamed (group-offloaded) component gets its first groups copied into
// its slots while the running request has nothing more to copy; they stay while that request runs;
// the next request's forward finds them there (used, its image exact). Had another pipeline run
// first, they go back (unused).
TEST(PipelinePrefetchTest, TheNextRequestsFirstStreamedGroupsCopyAhead) {
  const absl::StatusOr<Image> expected = ImageOfB();
  ASSERT_TRUE(expected.ok()) << expected.status();
  for (const bool scheduler_kept_its_word : {true, false}) {
    SCOPED_TRACE(scheduler_kept_its_word ? "b runs next" : "a runs again instead");
    TwoPipelines s;
    GroupOffloadOptions options;
    options.use_stream = true;
    ASSERT_TRUE(s.placement.EnableGroupOffload("b/transformer", options).ok());
    ASSERT_TRUE(s.Generate(*s.b).ok());  // Its forward records the order its groups load in.
    ASSERT_TRUE(s.Generate(*s.a).ok());  // b's idle slots go back meanwhile.
    absl::StatusOr<GroupOffloadStats> stats = s.placement.GroupOffloadStatsOf("b/transformer");
    ASSERT_TRUE(stats.ok()) << stats.status();
    const int64_t early_before = stats->early_prefetches;
    const PlacementCounters before = s.placement.TakeSnapshot().counters;
    Component* a_vae = s.a->components().back();
    const int64_t copied = s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), {a_vae}, "b waits next");
    ASSERT_GT(copied, 0);
    stats = s.placement.GroupOffloadStatsOf("b/transformer");
    EXPECT_EQ(stats->early_prefetches, early_before + 1);
    EXPECT_LE(copied, stats->slot_bytes);  // The groups its forward loads first (prefetch_depth 1).
    bool logged = false;
    for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
      logged |= d.action == "prefetch_pipeline" && d.component == "b/transformer" && d.bytes == copied &&
                d.reason.find("its first groups") != std::string::npos;
    }
    EXPECT_TRUE(logged);
    PlacementCounters c = s.placement.TakeSnapshot().counters;
    EXPECT_EQ(c.pipeline_prefetches - before.pipeline_prefetches, 1);
    EXPECT_EQ(c.pipeline_prefetch_bytes - before.pipeline_prefetch_bytes, copied);
    // Once is enough: its first groups are there.
    EXPECT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), {a_vae}, "again"), 0);
    const auto released = [&] {
      int n = 0;
      for (const PlacementDecision& d : s.placement.DecisionLog(1000)) {
        n += d.action == "release_slots" && d.component == "b/transformer" ? 1 : 0;
      }
      return n;
    };
    // The running request's last component runs: the slots stay.
    const int released_before = released();
    ASSERT_TRUE(s.placement.Run(*a_vae, [] {}).ok());
    EXPECT_EQ(released(), released_before);
    s.placement.EndPipelineRun("a");
    if (scheduler_kept_its_word) {
      const int64_t sync_before = s.placement.GroupOffloadStatsOf("b/transformer")->sync_onloads;
      const absl::StatusOr<Image> image = s.Generate(*s.b);
      ASSERT_TRUE(image.ok()) << image.status();
      EXPECT_EQ(image->rgb, expected->rgb);
      c = s.placement.TakeSnapshot().counters;
      EXPECT_EQ(c.pipeline_prefetches_used - before.pipeline_prefetches_used, 1);
      EXPECT_EQ(c.pipeline_prefetch_used_bytes - before.pipeline_prefetch_used_bytes, copied);
      EXPECT_EQ(c.pipeline_prefetches_unused, before.pipeline_prefetches_unused);
      // Its first forward found its first groups on the device (no synchronous onload for them).
      EXPECT_LE(s.placement.GroupOffloadStatsOf("b/transformer")->sync_onloads, sync_before);
    } else {
      ASSERT_TRUE(s.placement.Run(*s.a->components().front(), [] {}).ok());
      EXPECT_EQ(released(), released_before + 1);
      c = s.placement.TakeSnapshot().counters;
      EXPECT_EQ(c.pipeline_prefetches_unused - before.pipeline_prefetches_unused, 1);
      EXPECT_EQ(c.pipeline_prefetches_used, before.pipeline_prefetches_used);
      // b runs as usual afterwards.
      const absl::StatusOr<Image> image = s.Generate(*s.b);
      ASSERT_TRUE(image.ok()) << image.status();
      EXPECT_EQ(image->rgb, expected->rgb);
    }
  }
}

// A prefetched component moved off or unloaded before it ran waits for its copies first (they are
// still running on a slow link) and counts as unused; b then runs as usual with an exact image.
TEST(PipelinePrefetchTest, APrefetchMovedOffUnusedWaitsForItsCopiesAndCountsAsUnused) {
  const absl::StatusOr<Image> expected = ImageOfB();
  ASSERT_TRUE(expected.ok());
  SimulatedBackendOptions slow;
  slow.bandwidth_bytes_per_second = 20'000'000;
  {
    TwoPipelines s(slow);
    ASSERT_TRUE(s.Generate(*s.a).ok());
    ASSERT_GT(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), 0);
    s.placement.Unregister("b");
    EXPECT_EQ(s.placement.TakeSnapshot().counters.pipeline_prefetches_unused,
              static_cast<int64_t>(s.b->components().size()));
    EXPECT_EQ(s.backend->GetMemoryStats().allocated_bytes, TwoPipelines::Bytes(*s.a));
  }
  {
    // Under a budget that holds both pipelines, a third pipeline's run evicts b's prefetched
    // components (least recently used once a's have run again).
    TinyPipelineOptions c_options;
    c_options.name = "c";
    c_options.weight_seed = 9;
    std::unique_ptr<Pipeline> c = *CreateTinyPipeline(c_options);
    TwoPipelines probe;
    SimulatedBackendOptions budget = slow;
    budget.budget_bytes = TwoPipelines::Bytes(*probe.a) + TwoPipelines::Bytes(*probe.b);
    TwoPipelines s(budget);
    (void)s.placement.SetStrategy(*MakeCustomStrategy("lru"));
    for (Component* component : c->components()) ASSERT_TRUE(s.placement.Register("c", component).ok());
    s.placement.MarkReady("c");
    ASSERT_TRUE(s.Generate(*s.a).ok());
    ASSERT_EQ(s.placement.PrefetchPipeline("b", TwoPipelines::Components(*s.b), TwoPipelines::Components(*s.a), "r"), TwoPipelines::Bytes(*s.b));
    for (Component* component : s.a->components()) ASSERT_TRUE(s.placement.Run(*component, [] {}).ok());
    ASSERT_TRUE(s.placement.Run(*c->components().front(), [] {}).ok());
    const PlacementCounters counters = s.placement.TakeSnapshot().counters;
    EXPECT_GE(counters.pipeline_prefetches_unused, 1);
    EXPECT_EQ(counters.pipeline_prefetches_used, 0);
    EXPECT_LE(s.backend->GetMemoryStats().peak_allocated_bytes, budget.budget_bytes);
    // b runs as usual (what was evicted comes back); its image is exact.
    const absl::StatusOr<Image> image = s.Generate(*s.b);
    ASSERT_TRUE(image.ok()) << image.status();
    EXPECT_EQ(image->rgb, expected->rgb);
  }
}

// SetMemoryBudget at run time: a smaller budget moves whole components off, least recently used
// first, only as many as needed; a larger one moves nothing; one that what cannot move (a held
// component) does not fit is refused naming it, with the previous budget back and nothing moved.
TEST(PlacementManagerTest, ASmallerBudgetMovesTheLeastRecentlyUsedUntilWhatStaysFits) {
  Harness h;
  ASSERT_TRUE(h.Generate().ok());
  const int64_t te = h.View("text_encoder").weight_bytes, tr = h.View("transformer").weight_bytes,
                v = h.View("vae").weight_bytes;
  std::vector<std::string> moved;
  ASSERT_TRUE(h.placement.SetMemoryBudget(te + tr + v - 1, &moved).ok());
  EXPECT_EQ(moved, std::vector<std::string>{"tiny/text_encoder"});  // It ran first.
  EXPECT_EQ(h.View("text_encoder").state, ComponentState::kOffloaded);
  EXPECT_EQ(h.View("transformer").state, ComponentState::kResident);
  EXPECT_EQ(h.backend->GetMemoryStats().budget_bytes, te + tr + v - 1);
  EXPECT_EQ(h.backend->GetMemoryStats().allocated_bytes, tr + v);
  const std::vector<PlacementDecision> log = h.placement.DecisionLog(5);
  EXPECT_EQ(log.back().action, "set_budget");
  EXPECT_EQ(log.back().bytes, te + tr + v - 1);
  EXPECT_NE(log[log.size() - 2].reason.find("memory budget set to"), std::string::npos) << log[log.size() - 2].reason;
  moved.clear();
  ASSERT_TRUE(h.placement.SetMemoryBudget(te + tr + v, &moved).ok());
  EXPECT_TRUE(moved.empty());
  // Held: the VAE cannot move, and alone it exceeds a budget of one byte.
  Component* vae = h.pipeline->components().back();
  ASSERT_TRUE(h.placement.Hold(*vae, "held for the test").ok());
  const absl::Status refused = h.placement.SetMemoryBudget(1, &moved);
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(refused.message().find("tiny/vae (held by a run, "), std::string::npos) << refused;
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(h.backend->GetMemoryStats().budget_bytes, te + tr + v);
  EXPECT_EQ(h.View("transformer").state, ComponentState::kResident);
  h.placement.Unhold(*vae);
  EXPECT_EQ(h.placement.SetMemoryBudget(-1, &moved).code(), absl::StatusCode::kInvalidArgument);
  // Refused from no budget at all: none again (not the device's size).
  {
    Harness fresh;
    ASSERT_TRUE(fresh.Generate().ok());
    Component* held = fresh.pipeline->components().back();
    ASSERT_TRUE(fresh.placement.Hold(*held, "held for the test").ok());
    EXPECT_EQ(fresh.placement.SetMemoryBudget(1, &moved).code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_EQ(fresh.backend->MemoryBudget(), 0);
    fresh.placement.Unhold(*held);
  }
  ASSERT_TRUE(h.placement.SetMemoryBudget(0, &moved).ok());  // None.
  EXPECT_TRUE(moved.empty());
  ASSERT_TRUE(h.Generate().ok());
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// A layer whose FP8 weight is deferred (Module::DeferFp8): its codes are written only when something
// reads its host copy.
class DeferredLayer : public Module {
 public:
  DeferredLayer() : Module("DeferredLayer") {
    at::manual_seed(5);
    const at::Tensor source = at::randn({64, 128}).to(at::kBFloat16);
    const int codes = AddParameter("weight", UnwrittenHostTensor({64, 128}, at::kByte));
    const int scales = AddBuffer("weight_scale", UnwrittenHostTensor({64}, at::kFloat));
    DeferFp8(codes, scales, source);
    want = Quantize(source, CompressFormat::kFp8E4M3);
  }
  QuantizedTensor want;
};

// Registering pins a component's host copies — which reads them: a component with deferred FP8
// weights (made with its int4 copy when group offloading starts, right after registering) is left
// unpinned then ("pin_deferred"), its weights unwritten; once something reads them (here an
// uncompressed group offload) they are written, and switching group offloading off pins them.
TEST(PlacementManagerTest, RegisteringLeavesDeferredWeightsUnwrittenAndUnpinned) {
  auto backend = CreateSimulatedBackend({});
  auto layer = std::make_unique<DeferredLayer>();
  const QuantizedTensor want = layer->want;
  std::unique_ptr<Component> component = *Component::Create("layer", std::move(layer), at::kBFloat16);
  PlacementManager placement(backend.get());
  placement.set_pin_host_copies(true);
  ASSERT_TRUE(placement.Register("p", component.get()).ok());
  HostWeights& weights = component->host_weights();
  EXPECT_TRUE(weights.has_unwritten());
  EXPECT_EQ(weights.pinned_in_place_bytes(), 0);
  EXPECT_EQ(placement.DecisionLog(1).back().action, "pin_deferred");
  GroupOffloadOptions options;
  options.type = OffloadType::kLeafLevel;
  options.target = OffloadTarget::kPageableHost;  // Its store pins the pages where they are, then gives them back.
  ASSERT_TRUE(placement.EnableGroupOffload("p/layer", options).ok());
  EXPECT_FALSE(weights.has_unwritten());
  ASSERT_TRUE(placement.DisableGroupOffload("p/layer").ok());
  EXPECT_GT(weights.pinned_in_place_bytes(), 0);
  const HostWeights::Deferred& d = weights.deferred().front();
  EXPECT_TRUE(at::equal(weights.entries()[d.codes].host, want.q));
  EXPECT_TRUE(at::equal(weights.entries()[d.scales].host, want.scale));
}

}  // namespace
}  // namespace stowage
