// The runtime without gRPC: a DeviceSet built from an injected registry whose "latch" pipeline
// waits at a gate the test holds, so each test decides what runs when — a request that is running,
// requests queued behind it, an unload or an admin change posted meanwhile — and checks the order
// and the outcome. No test sleeps to order anything; AwaitState (runtime_state.h) waits for a state
// the runtime reports (its worker's queue, a pipeline's lifecycle).
#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "base/status_macros.h"
#include "google/protobuf/text_format.h"
#include "offload/group_offload.h"
#include "models/core/conv_lane.h"
#include "models/core/lora.h"
#include "placement/placement_manager.h"
#include "runtime/config.h"
#include "runtime/device_runtime.h"
#include "runtime/device_set.h"
#include "runtime/runtime_factories.h"
#include "tests/runtime/latch_pipeline.h"
#include "tests/runtime/runtime_state.h"

#ifdef STOWAGE_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace stowage {
namespace {

class RuntimeCoreTest : public ::testing::Test {
 protected:
  void SetUp() override {
    gate_ = std::make_shared<LatchGate>();
    registry_ = std::make_unique<PipelineRegistry>(LatchRegistry(gate_));
  }
  void TearDown() override {
    gate_->Open();  // A failed test's runs finish; the DeviceSet's destructor does not hang.
    for (std::thread& t : threads_) t.join();
    devices_.reset();
  }

  // Starts a server core with one "latch" pipeline (batching up to `max_batch`).
  // Starts a server core with one "latch" pipeline (batching up to `max_batch`) on the default
  // device, or on what `make_backend` makes (with `budget` bytes, 0 for none).
  // `extra`: more of the server config, in text format.
  void Start(int max_batch = 1, decltype(RuntimeFactories::make_backend) make_backend = nullptr, int64_t budget = 0,
             const std::string& extra = "") {
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
        absl::StrCat("pipelines { name: \"latch\" builtin: \"latch\" warmup: false batching { max_batch_size: ",
                     max_batch, " max_queue_delay_ms: 0 } } ", extra),
        &config));
    if (make_backend) config.mutable_device()->set_kind(v1::DeviceConfig::KIND_SIMULATED);  // Its name.
    if (budget > 0) config.mutable_device()->set_memory_budget_bytes(budget);
    absl::StatusOr<v1::ServerConfig> finalized = FinalizeServerConfig(config, registry_.get());
    ASSERT_TRUE(finalized.ok()) << finalized.status();
    auto devices = DeviceSet::Create(*finalized, nullptr, RuntimeFactories{registry_.get(), std::move(make_backend)});
    ASSERT_TRUE(devices.ok()) << devices.status();
    devices_ = std::move(*devices);
  }

  DeviceRuntime& core() { return *devices_->devices().front(); }

  // A backend factory for Start: the simulated device at the config's index.
  static decltype(RuntimeFactories::make_backend) SimulatedBackend() {
    return [](const v1::DeviceConfig& device) -> absl::StatusOr<std::unique_ptr<DeviceBackend>> {
      SimulatedBackendOptions options;
      options.index = device.index();
      return CreateSimulatedBackend(options);
    };
  }
  // A number for the calling thread, its own from the first time it asks: a thread-local, as
  // LibTorch's plan caches are (a fresh thread has none, whatever id the system reuses for it).
  static int ThreadMark() {
    static std::atomic<int> next{1};
    static thread_local int mark = 0;
    if (mark == 0) mark = next++;
    return mark;
  }
  // Runs `fn` on the worker (the only owner of the device) and returns the thread the device's
  // convolutions ran on in that item (its lane's, models/core/conv_lane.h: what allocator shortfalls
  // renew; the worker's own without a lane); the worker's own thread goes into worker_threads_.
  int OnWorker(const std::function<void(PlacementManager&)>& fn) {
    int id = 0;
    EXPECT_TRUE(core().ChangeDevice([&](PlacementManager& placement) {
                        worker_threads_.insert(ThreadMark());
                        fn(placement);
                        ConvLane* lane = ConvLane::ForThisThread();
                        if (lane != nullptr) {
                          lane->Run([&] { id = ThreadMark(); });
                        } else {
                          id = ThreadMark();
                        }
                        return absl::OkStatus();
                      },
                      [] { return absl::OkStatus(); })
                    .ok());
    return id;
  }
  std::set<int> worker_threads_;  // ThreadMark of each thread the worker ran an item on.

  struct Outcome {
    absl::Mutex mu;
    bool done = false;
    absl::StatusOr<v1::GenerateResponse> result = absl::UnknownError("not run");
  };
  // Generates on a thread of its own; `interrupt` (optional) is the request's caller.
  std::shared_ptr<Outcome> GenerateAsync(const std::string& prompt, int steps, uint64_t seed,
                                         std::function<absl::Status()> interrupt = nullptr) {
    auto outcome = std::make_shared<Outcome>();
    v1::GenerateRequest request;
    request.set_pipeline("latch");
    request.set_prompt(prompt);
    request.set_num_inference_steps(steps);
    request.set_seed(seed);
    threads_.emplace_back([this, outcome, request, interrupt] {
      CallControl control;
      control.interrupt = interrupt ? interrupt : [] { return absl::OkStatus(); };
      absl::StatusOr<v1::GenerateResponse> result = devices_->Generate(request, control);
      absl::MutexLock lock(&outcome->mu);
      outcome->result = std::move(result);
      outcome->done = true;
    });
    return outcome;
  }
  static absl::StatusOr<v1::GenerateResponse> Await(const std::shared_ptr<Outcome>& outcome) {
    absl::MutexLock lock(&outcome->mu);
    outcome->mu.Await(absl::Condition(&outcome->done));
    return outcome->result;
  }
  v1::PipelineState StateOf(const std::string& name) { return ::stowage::StateOf(*devices_, name); }

  // With the latch transformer streamed through a spare-room cache under the budget `set_budget`
  // sets (if any): one shortfall and a clean first item on the fresh thread widen nothing; short again
  // in the fresh thread's first item widens the margin by the configured 256 bytes once, the caches
  // giving it back; a first item that widened it itself and ran short widens it no more.
  void ExpectAFreshThreadShortOfRoomAgainWidensTheMargin(const std::function<absl::Status(PlacementManager&)>& set_budget) {
    const absl::Status streamed = core().ChangeDevice(
        [&set_budget](PlacementManager& placement) {
          placement.set_streamed_group_cache(true, /*margin_bytes=*/256);
          GroupOffloadOptions options;
          options.type = OffloadType::kLeafLevel;
          options.use_stream = true;
          RETURN_IF_ERROR(placement.EnableGroupOffload("latch/transformer", options));
          return set_budget(placement);
        },
        [] { return absl::OkStatus(); });
    ASSERT_TRUE(streamed.ok()) << streamed;
    gate_->Open();
    for (int k = 0; k < 2; ++k) {
      const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync(absl::StrCat("fill ", k), 2, 1));
      ASSERT_TRUE(reply.ok()) << reply.status();
    }
    int64_t margin = -1, cached = 0;
    const auto look = [&](PlacementManager& placement) {
      margin = placement.learned_cache_margin();
      cached = placement.GroupOffloadStatsOf("latch/transformer")->cache_bytes;
    };
    const int first = OnWorker(look);
    ASSERT_GT(cached, 0);
    ASSERT_EQ(margin, 0);
    // Refused while another allocation held the room, which is then given back.
    const auto short_of_room = [](PlacementManager& placement) {
      DeviceBackend& backend = placement.backend();
      const int64_t free_bytes = backend.GetMemoryStats().free_bytes();
      {
        absl::StatusOr<at::Tensor> held = backend.AllocateBytes(free_bytes / 2);
        ASSERT_TRUE(held.ok()) << held.status();
        EXPECT_FALSE(backend.AllocateBytes(free_bytes * 3 / 4).ok());
      }
      backend.ReleaseCachedMemory();  // On CUDA the held block would stay reserved in the allocator.
    };
    // Once, then a clean first item on the fresh thread: no wider margin.
    EXPECT_EQ(OnWorker(short_of_room), first);
    const int second = OnWorker(look);
    EXPECT_NE(second, first);
    EXPECT_EQ(OnWorker(look), second);
    EXPECT_EQ(margin, 0);
    // Short again in the fresh thread's first item: the margin widens, the caches give back what it added.
    const int64_t cached_before = cached;
    EXPECT_EQ(OnWorker(short_of_room), second);
    const int third = OnWorker(short_of_room);
    EXPECT_NE(third, second);
    OnWorker(look);
    EXPECT_EQ(margin, 256);
    EXPECT_LT(cached, cached_before);
    std::vector<PlacementDecision> log;
    OnWorker([&](PlacementManager& placement) { log = placement.DecisionLog(1000); });
    int widened = 0;
    bool released = false;
    for (const PlacementDecision& d : log) {
      released = released || (d.action == "release_group_cache" &&
                              d.reason.find("ran short of memory again (the largest refusal") != std::string::npos &&
                              d.reason.find(": the caches leave the wider margin") != std::string::npos);
      if (d.action != "widen_cache_margin") continue;
      ++widened;
      EXPECT_NE(d.reason.find("the first item after the convolutions went on on a fresh thread ran short of memory again"),
                std::string::npos)
          << d.reason;
    }
    EXPECT_EQ(widened, 1);
    EXPECT_TRUE(released);
    // Requests still run.
    const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("after", 2, 3));
    ASSERT_TRUE(reply.ok()) << reply.status();
    // A fresh thread's first item that widened the margin itself (as a run that fails for want of room
    // does) and ran short: one widening, not two.
    const int fourth = OnWorker(short_of_room);
    int64_t widenings = 0;
    const int fifth = OnWorker([&](PlacementManager& placement) {
      ASSERT_TRUE(placement.WidenCacheMarginForShortRoom(1, "the item's own"));
      widenings = placement.cache_margin_widenings();
      short_of_room(placement);
    });
    EXPECT_NE(fifth, fourth);
    OnWorker([&](PlacementManager& placement) {
      EXPECT_EQ(placement.cache_margin_widenings(), widenings);
      EXPECT_EQ(placement.learned_cache_margin(), 512);
    });
    EXPECT_EQ(worker_threads_.size(), 1u);  // Only the convolutions' thread was renewed.
  }

  std::shared_ptr<LatchGate> gate_;
  std::unique_ptr<PipelineRegistry> registry_;
  std::unique_ptr<DeviceSet> devices_;
  std::vector<std::thread> threads_;
};

// The scheduler's residency weight: whole components on the host count whole, resident ones nothing,
// adapters nothing, and a streamed component one forward's copy less what its cache holds; those
// the pipeline's runs never used nothing once it has run.
TEST(PipelineMoveBytesTest, CountsWholeComponentsOnTheHostAndTheUncachedShareOfStreamedOnes) {
  PlacementSnapshot snapshot;
  const auto add = [&](const std::string& id, std::vector<std::string> pipelines, ComponentState state,
                       int64_t weight_bytes, const std::string& kind = "Module") -> ComponentView& {
    ComponentView v;
    v.id = id;
    v.kind = kind;
    v.pipelines = std::move(pipelines);
    v.state = state;
    v.weight_bytes = weight_bytes;
    snapshot.components.push_back(v);
    return snapshot.components.back();
  };
  add("a/text_encoder", {"a", "b"}, ComponentState::kOffloaded, 1000);
  add("a/vae", {"a"}, ComponentState::kResident, 500);
  add("a/style", {"a"}, ComponentState::kOffloaded, 300, kLoraAdapterKind);
  GroupOffloadStats streamed;
  streamed.streamed_bytes = 8000;
  streamed.bytes_per_forward = 4000;  // A compressed copy: half the bytes it widens to.
  add("b/transformer", {"b"}, ComponentState::kGroupOffloaded, 9000).group_offload = streamed;
  EXPECT_EQ(PipelineMoveBytes(snapshot, "a"), 1000);
  EXPECT_EQ(PipelineMoveBytes(snapshot, "b"), 1000 + 4000);
  EXPECT_EQ(PipelineMoveBytes(snapshot, "c"), 0);
  // Three quarters of its link bytes stay on the device (as 6000 widened bytes, or as 3000 bytes
  // of compressed copies: what counts is the link bytes they spare).
  snapshot.components.back().group_offload->cache_bytes = 6000;
  snapshot.components.back().group_offload->cache_link_bytes = 3000;
  EXPECT_EQ(PipelineMoveBytes(snapshot, "b"), 1000 + 1000);
  snapshot.components.back().group_offload->cache_bytes = 3000;
  EXPECT_EQ(PipelineMoveBytes(snapshot, "b"), 1000 + 1000);
  snapshot.components.back().group_offload->cache_link_bytes = 4000;
  EXPECT_EQ(PipelineMoveBytes(snapshot, "b"), 1000);
  // Once some of a pipeline's components have run, a component on the host none of its runs used
  // (an image encoder) does not count; until then every one does.
  add("a/vae_encoder", {"a"}, ComponentState::kOffloaded, 700);
  EXPECT_EQ(PipelineMoveBytes(snapshot, "a"), 1000 + 700);
  snapshot.components[1].ran = true;  // a/vae.
  EXPECT_EQ(PipelineMoveBytes(snapshot, "a"), 0);
  snapshot.components[0].ran = true;  // a/text_encoder (on the host, it ran before: it counts).
  EXPECT_EQ(PipelineMoveBytes(snapshot, "a"), 1000);
  // "b" shares the text encoder, which ran (for "a"): that says nothing of b's own components,
  // none of which ran, so every one of them counts (its transformer's forward is all cached: 0).
  add("b/vae_encoder", {"b"}, ComponentState::kOffloaded, 200);
  EXPECT_EQ(PipelineMoveBytes(snapshot, "b"), 1000 + 200);
  snapshot.components[3].ran = true;  // b/transformer: "b" has run; its image encoder never did.
  EXPECT_EQ(PipelineMoveBytes(snapshot, "b"), 1000);
}

TEST_F(RuntimeCoreTest, ANewFamilyIsOneRegistrationTheRuntimeIsGiven) {
  v1::ServerConfig config;
  config.add_pipelines()->set_name("latch");
  config.mutable_pipelines(0)->set_builtin("latch");
  // The server's own registry does not know the family; the injected one does.
  const absl::StatusOr<v1::ServerConfig> refused = FinalizeServerConfig(config);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("unknown built-in 'latch'"), std::string::npos) << refused.status();
  Start();
  gate_->Open();
  absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("a red square", 2, 7));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(gate_->arrivals(), 2);  // One gate per step.
  // A LoadPipeline through the runtime is checked against the same registry.
  v1::PipelineConfig extra;
  extra.set_name("second");
  extra.set_builtin("latch");
  extra.set_warmup(false);
  EXPECT_TRUE(devices_->LoadPipeline(extra, [] { return absl::OkStatus(); }).ok());
  extra.set_name("third");
  extra.set_builtin("tiny");
  const absl::StatusOr<v1::Pipeline> unknown = devices_->LoadPipeline(extra, [] { return absl::OkStatus(); });
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("available: latch"), std::string::npos) << unknown.status();
}

// The backend is injected too: the runtime runs on what the factory makes, with the config's budget.
TEST_F(RuntimeCoreTest, TheDeviceIsTheInjectedBackendWithTheConfigsBudget) {
  int made = 0;
  Start(1,
        [&](const v1::DeviceConfig& device) -> absl::StatusOr<std::unique_ptr<DeviceBackend>> {
          ++made;
          SimulatedBackendOptions options;
          options.index = device.index();
          options.context_bytes = 12345;  // Not the config's: shows whose backend runs.
          return CreateSimulatedBackend(options);
        },
        /*budget=*/int64_t{1} << 20);
  EXPECT_EQ(made, 1);
  ASSERT_NE(core().placement_snapshot(), nullptr);
  EXPECT_EQ(core().placement_snapshot()->memory.context_bytes, 12345);
  EXPECT_EQ(core().placement_snapshot()->memory.budget_bytes, int64_t{1} << 20);
  gate_->Open();
  const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("on the injected device", 1, 3));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->stats().device(), "sim:0");
}

// With a high-priority compute stream the default device (CUDA on the GPU host, where the worker's
// thread then computes on a high-priority stream; the simulated device elsewhere, where nothing
// changes) serves as before.
TEST_F(RuntimeCoreTest, AHighPriorityComputeStreamServesAsBefore) {
  Start(1, nullptr, 0, "device { high_priority_compute: true }");
  gate_->Open();
  const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("high priority", 1, 3));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->stats().device(), core().device_name());
}

TEST_F(RuntimeCoreTest, UnloadWaitsForTheRunningRequestAndRefusesNewOnes) {
  Start();
  auto running = GenerateAsync("running", 2, 1);
  gate_->AwaitArrivals(1);  // Its first step waits at the gate: the request is running.
  absl::Status unloaded = absl::UnknownError("not returned");
  std::atomic<bool> unload_returned{false};
  threads_.emplace_back([&] {
    unloaded = devices_->UnloadPipeline("latch", [] { return absl::OkStatus(); });
    unload_returned = true;
  });
  ASSERT_TRUE(AwaitState([&] { return StateOf("latch") == v1::PIPELINE_UNLOADING; }));
  // Accepted no more; the running request is not disturbed.
  const absl::StatusOr<v1::GenerateResponse> refused = Await(GenerateAsync("late", 2, 2));
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("unload"), std::string::npos) << refused.status();
  EXPECT_FALSE(unload_returned.load());  // Still waits for the request that runs.
  gate_->Allow(2);
  const absl::StatusOr<v1::GenerateResponse> finished = Await(running);
  ASSERT_TRUE(finished.ok()) << finished.status();
  EXPECT_EQ(finished->width(), 64);
  ASSERT_TRUE(AwaitState([&] { return unload_returned.load(); }));
  EXPECT_TRUE(unloaded.ok()) << unloaded;
  EXPECT_EQ(StateOf("latch"), v1::PIPELINE_STATE_UNSPECIFIED);  // Gone.
}

TEST_F(RuntimeCoreTest, RequestsQueuedBehindARunningOneRunAsOneBatch) {
  Start(/*max_batch=*/3);
  auto first = GenerateAsync("first", 1, 1);
  gate_->AwaitArrivals(1);
  auto b = GenerateAsync("b", 1, 2);
  auto c = GenerateAsync("c", 1, 3);
  auto d = GenerateAsync("d", 1, 4);
  ASSERT_TRUE(AwaitState([&] { return core().waiting().jobs == 3; }));
  gate_->Open();
  ASSERT_TRUE(Await(first).ok());
  for (const auto& outcome : {b, c, d}) {
    const absl::StatusOr<v1::GenerateResponse> reply = Await(outcome);
    ASSERT_TRUE(reply.ok()) << reply.status();
    EXPECT_EQ(reply->stats().batch_size(), 3);
  }
  const std::vector<std::vector<std::string>> batches = gate_->batches();
  ASSERT_EQ(batches.size(), 2u);
  EXPECT_EQ(batches[0], std::vector<std::string>{"first"});
  std::vector<std::string> second = batches[1];
  std::sort(second.begin(), second.end());
  EXPECT_EQ(second, (std::vector<std::string>{"b", "c", "d"}));
  // Placement was told of each run's beginning (a learned cache margin counts them to narrow).
  EXPECT_TRUE(AwaitState([&] {
    const auto snapshot = core().placement_snapshot();
    return snapshot != nullptr && snapshot->counters.runs_begun == 2;
  }));
}

TEST_F(RuntimeCoreTest, ACancelledMemberLeavesItsBatchAtTheNextStepAndTheOthersFinish) {
  Start(/*max_batch=*/2);
  auto first = GenerateAsync("first", 1, 1);
  gate_->AwaitArrivals(1);
  std::atomic<bool> gone{false};
  auto stays = GenerateAsync("stays", 3, 2);
  auto leaves = GenerateAsync("leaves", 3, 3, [&]() -> absl::Status {
    return gone ? absl::CancelledError("cancelled by the client") : absl::OkStatus();
  });
  ASSERT_TRUE(AwaitState([&] { return core().waiting().jobs == 2; }));
  gate_->Allow(2);          // "first" finishes; the batch of two passes its first step.
  gate_->AwaitArrivals(3);  // The batch waits at its second step...
  gone = true;              // ...when one member's caller goes.
  gate_->Open();
  ASSERT_TRUE(Await(first).ok());
  const absl::StatusOr<v1::GenerateResponse> kept = Await(stays);
  ASSERT_TRUE(kept.ok()) << kept.status();
  EXPECT_EQ(kept->stats().batch_size(), 2);
  EXPECT_EQ(Await(leaves).status().code(), absl::StatusCode::kCancelled);
  // Steps 2 and 3 ran for the one that stayed: 1 + 3 arrivals in all.
  EXPECT_EQ(gate_->arrivals(), 4);
}

// A change in how a component runs (group offloading enabled or disabled) may put kernels and
// streams in use that no warm-up ran, so the next request runs with the warm-up's context reserve
// counted against the budget; later requests, and requests after other changes, do not.
TEST_F(RuntimeCoreTest, TheFirstRequestAfterAChangeRunsWithTheContextReserve) {
  constexpr int64_t kContext = 1000;
  constexpr int64_t kBudget = int64_t{1} << 20;
  DeviceBackend* sim = nullptr;
  Start(1,
        [&](const v1::DeviceConfig& device) -> absl::StatusOr<std::unique_ptr<DeviceBackend>> {
          SimulatedBackendOptions options;
          options.index = device.index();
          options.context_bytes = kContext;
          options.count_context_reserve = true;
          std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend(options);
          sim = backend.get();
          return backend;
        },
        kBudget);
  ASSERT_NE(sim, nullptr);
  const int64_t reserve = (kBudget - kContext) / 4;  // The warm-up's: a quarter of the budget at most 1 GiB.
  const auto context_while_running = [&](const std::string& prompt, int arrivals) {
    auto outcome = GenerateAsync(prompt, 1, 1);
    gate_->AwaitArrivals(arrivals);
    const int64_t context = sim->GetMemoryStats().context_bytes;
    gate_->Allow(1);
    EXPECT_TRUE(Await(outcome).ok()) << prompt;
    EXPECT_EQ(sim->GetMemoryStats().context_bytes, kContext) << "after " << prompt;
    return context;
  };
  EXPECT_EQ(context_while_running("first", 1), kContext);
  // A change that does not alter how anything runs (here: none): no reserve.
  ASSERT_TRUE(core().ChangeDevice([](PlacementManager&) { return absl::OkStatus(); },
                                  [] { return absl::OkStatus(); }).ok());
  EXPECT_EQ(context_while_running("after a plain change", 2), kContext);
  const auto group_offload = [&](bool on) {
    return core().ChangeDevice(
        [on](PlacementManager& placement) {
          GroupOffloadOptions options;
          options.type = OffloadType::kLeafLevel;
          return on ? placement.EnableGroupOffload("latch/transformer", options)
                    : placement.DisableGroupOffload("latch/transformer");
        },
        [] { return absl::OkStatus(); });
  };
  ASSERT_TRUE(group_offload(true).ok());
  EXPECT_EQ(context_while_running("after group offloading", 3), kContext + reserve);
  EXPECT_EQ(context_while_running("then", 4), kContext);
  ASSERT_TRUE(group_offload(false).ok());
  EXPECT_EQ(context_while_running("after disabling it", 5), kContext + reserve);
  EXPECT_EQ(context_while_running("and then", 6), kContext);
}

// Allocator out-of-memory errors move the device's convolutions to a fresh thread once the room they
// asked for is back (on CUDA, cuDNN may have caught one and kept a slower plan on its thread): the
// next change's convolutions run there, requests still run, and without another error the thread
// stays. A refusal larger than the room there is now moves nothing (a fresh thread would choose short
// again). The worker itself stays on its thread throughout (what it cached, attention graphs among
// it, stays with it).
TEST_F(RuntimeCoreTest, AllocatorOutOfMemoryErrorsMoveTheConvolutionsToAFreshThreadOnceTheRoomIsBack) {
  constexpr int64_t kBudget = int64_t{1} << 20;
  Start(1, SimulatedBackend(), kBudget);
  const auto on_worker = [&](const std::function<void(DeviceBackend&)>& fn) {
    return OnWorker([&](PlacementManager& placement) { fn(placement.backend()); });
  };
  const auto nothing = [](DeviceBackend&) {};
  int64_t ooms = 0;
  const int first = on_worker([&](DeviceBackend& backend) { ooms = backend.GetMemoryStats().allocator_ooms; });
  EXPECT_EQ(on_worker(nothing), first);
  // Refused while another allocation held the room, which is then given back.
  EXPECT_EQ(on_worker([](DeviceBackend& backend) {
              absl::StatusOr<at::Tensor> held = backend.AllocateBytes(kBudget / 2);
              ASSERT_TRUE(held.ok()) << held.status();
              EXPECT_FALSE(backend.AllocateBytes(kBudget * 3 / 4).ok());
            }),
            first);
  const int second =
      on_worker([&](DeviceBackend& backend) { EXPECT_EQ(backend.GetMemoryStats().allocator_ooms, ooms + 1); });
  EXPECT_NE(second, first);
  EXPECT_NE(second, ThreadMark());
  EXPECT_EQ(on_worker(nothing), second);
  // Larger than the whole budget: counted, but the room never comes back for it.
  EXPECT_EQ(on_worker([](DeviceBackend& backend) { EXPECT_FALSE(backend.AllocateBytes(2 * kBudget).ok()); }), second);
  EXPECT_EQ(on_worker([&](DeviceBackend& backend) { EXPECT_EQ(backend.GetMemoryStats().allocator_ooms, ooms + 2); }),
            second);
  gate_->Open();
  const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("on the fresh thread", 1, 3));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(on_worker(nothing), second);
  EXPECT_EQ(on_worker(nothing), second);
  EXPECT_EQ(worker_threads_.size(), 1u);
}

// With DeviceConfig.convolution_lane false the convolutions run on the worker's own thread, and the
// same refusal, once its room is back, hands the worker itself to a fresh thread (before session 45
// the only way); requests run there.
TEST_F(RuntimeCoreTest, WithoutAConvolutionLaneTheWorkerItselfGoesOnOnAFreshThread) {
  constexpr int64_t kBudget = int64_t{1} << 20;
  Start(1, SimulatedBackend(), kBudget, "device { convolution_lane: false }");
  const auto nothing = [](PlacementManager&) {};
  const int first = OnWorker([](PlacementManager&) { EXPECT_EQ(ConvLane::ForThisThread(), nullptr); });
  EXPECT_EQ(OnWorker(nothing), first);
  EXPECT_EQ(OnWorker([](PlacementManager& placement) {
              DeviceBackend& backend = placement.backend();
              absl::StatusOr<at::Tensor> held = backend.AllocateBytes(kBudget / 2);
              ASSERT_TRUE(held.ok()) << held.status();
              EXPECT_FALSE(backend.AllocateBytes(kBudget * 3 / 4).ok());
            }),
            first);
  const int second = OnWorker(nothing);
  EXPECT_NE(second, first);
  EXPECT_EQ(OnWorker(nothing), second);
  EXPECT_EQ(worker_threads_, (std::set<int>{first, second}));  // Here the worker's thread is the one renewed.
  gate_->Open();
  const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("on the fresh worker thread", 1, 3));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(OnWorker(nothing), second);
}

// A fresh thread whose first item runs short of memory again says the room, not a plan kept on the old
// thread, is missing: then, and only then, the spare-room caches' margin widens (one shortfall a fresh
// thread does not meet again widens nothing: multi-tenant run 15's cost of a wider margin).
TEST_F(RuntimeCoreTest, AFreshThreadShortOfRoomAgainWidensTheSpareRoomCachesMargin) {
  constexpr int64_t kBudget = int64_t{1} << 20;
  Start(1, SimulatedBackend(), kBudget);
  ExpectAFreshThreadShortOfRoomAgainWidensTheMargin([](PlacementManager&) { return absl::OkStatus(); });
}

// The same on CUDA (the GPU host; skipped elsewhere): LibTorch's allocator refuses under a budget set
// a GiB above what the process holds, its out-of-memory observer gives the refused size.
TEST_F(RuntimeCoreTest, OnCudaAFreshThreadShortOfRoomAgainWidensTheSpareRoomCachesMargin) {
  Start(1);
  if (core().device_name().rfind("cuda", 0) != 0) GTEST_SKIP() << "needs a CUDA device, not " << core().device_name();
  ExpectAFreshThreadShortOfRoomAgainWidensTheMargin([](PlacementManager& placement) {
    DeviceBackend& backend = placement.backend();
    backend.ReleaseCachedMemory();
    const DeviceMemoryStats stats = backend.GetMemoryStats();
    std::vector<std::string> offloaded;
    return placement.SetMemoryBudget(stats.context_bytes + stats.reserved_bytes + (int64_t{1} << 30), &offloaded);
  });
}

// The same on CUDA (the GPU host; skipped elsewhere) with the high-priority compute stream: under a
// budget set a GiB above what the device holds (not the whole card: ctest runs other GPU tests beside
// this one), an allocation that does not fit beside another makes LibTorch's allocator raise, and
// count, an out-of-memory error; with the budget lifted the next change's convolutions run on a fresh
// thread, which computes on the worker's stream (the high-priority one), and a request still runs.
TEST_F(RuntimeCoreTest, OnCudaTheFreshThreadKeepsTheComputeStream) {
  Start(1, nullptr, 0, "device { high_priority_compute: true }");
  if (core().device_name().rfind("cuda", 0) != 0) GTEST_SKIP() << "needs a CUDA device, not " << core().device_name();
  // The lane's thread, and the stream current there (and on the worker) while it runs.
  const auto on_worker = [&](const std::function<void(PlacementManager&)>& fn, int64_t* stream) {
    int id = 0;
    EXPECT_TRUE(core().ChangeDevice([&](PlacementManager& placement) {
                        worker_threads_.insert(ThreadMark());
                        fn(placement);
                        ConvLane* lane = ConvLane::ForThisThread();
                        EXPECT_NE(lane, nullptr);
                        if (lane == nullptr) return absl::OkStatus();
#ifdef STOWAGE_WITH_CUDA
                        const int64_t worker_stream = c10::cuda::getCurrentCUDAStream().id();
                        lane->RunOn(c10::Device(c10::kCUDA, 0), [&] {
                          id = ThreadMark();
                          if (stream != nullptr) *stream = c10::cuda::getCurrentCUDAStream().id();
                        });
                        if (stream != nullptr) EXPECT_EQ(*stream, worker_stream);
#else
                        lane->Run([&] { id = ThreadMark(); });
#endif
                        return absl::OkStatus();
                      },
                      [] { return absl::OkStatus(); })
                    .ok());
    return id;
  };
  constexpr int64_t kGiB = int64_t{1} << 30;
  int64_t stream_before = -1, stream_after = -2;
  int64_t ooms_before = 0, ooms_after = 0;
  const int first = on_worker([](PlacementManager&) {}, &stream_before);
  EXPECT_EQ(on_worker(
                [&](PlacementManager& placement) {
                  DeviceBackend& backend = placement.backend();
                  backend.ReleaseCachedMemory();  // No cached block serves the refused allocation.
                  const DeviceMemoryStats stats = backend.GetMemoryStats();
                  ooms_before = stats.allocator_ooms;
                  std::vector<std::string> offloaded;
                  ASSERT_TRUE(placement.SetMemoryBudget(stats.context_bytes + stats.reserved_bytes + kGiB, &offloaded).ok());
                  {
                    absl::StatusOr<at::Tensor> held = backend.AllocateBytes(kGiB / 2);
                    ASSERT_TRUE(held.ok()) << held.status();
                    EXPECT_FALSE(backend.AllocateBytes(kGiB * 3 / 4).ok());
                  }
                  ooms_after = backend.GetMemoryStats().allocator_ooms;
                  EXPECT_TRUE(placement.SetMemoryBudget(0, &offloaded).ok());
                },
                nullptr),
            first);
  EXPECT_GT(ooms_after, ooms_before);
  const int second = on_worker([](PlacementManager&) {}, &stream_after);
  EXPECT_NE(second, first);
#ifdef STOWAGE_WITH_CUDA
  EXPECT_EQ(stream_after, stream_before);
#endif
  EXPECT_EQ(worker_threads_.size(), 1u);
  gate_->Open();
  const absl::StatusOr<v1::GenerateResponse> reply = Await(GenerateAsync("after the refusal", 2, 3));
  ASSERT_TRUE(reply.ok()) << reply.status();
  EXPECT_EQ(reply->stats().device(), core().device_name());
}

TEST_F(RuntimeCoreTest, AnAdminChangeRunsAfterTheRunningRequestAndBeforeTheQueuedOnes) {
  Start();
  auto first = GenerateAsync("first", 1, 1);
  gate_->AwaitArrivals(1);
  auto queued = GenerateAsync("queued", 1, 2);
  ASSERT_TRUE(AwaitState([&] { return core().waiting().jobs == 1; }));
  size_t batches_when_changed = 99;
  absl::Status changed = absl::UnknownError("not run");
  threads_.emplace_back([&] {
    changed = core().ChangeDevice(
        [&](PlacementManager&) {
          batches_when_changed = gate_->batches().size();
          return absl::OkStatus();
        },
        [] { return absl::OkStatus(); });
  });
  ASSERT_TRUE(AwaitState([&] { return core().waiting().tasks == 1; }));
  gate_->Open();
  ASSERT_TRUE(Await(first).ok());
  ASSERT_TRUE(Await(queued).ok());
  threads_.back().join();
  threads_.pop_back();
  EXPECT_TRUE(changed.ok()) << changed;
  EXPECT_EQ(batches_when_changed, 1u);  // After "first" began, before "queued" did.
}

TEST_F(RuntimeCoreTest, AQueuedRequestWhoseDeadlinePassedNeverRuns) {
  Start();
  auto first = GenerateAsync("first", 1, 1);
  gate_->AwaitArrivals(1);
  std::atomic<bool> expired{false};
  auto late = GenerateAsync("late", 1, 2, [&]() -> absl::Status {
    return expired ? absl::DeadlineExceededError("deadline passed") : absl::OkStatus();
  });
  ASSERT_TRUE(AwaitState([&] { return core().waiting().jobs == 1; }));
  expired = true;
  gate_->Open();
  ASSERT_TRUE(Await(first).ok());
  EXPECT_EQ(Await(late).status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(gate_->batches().size(), 1u);  // Only "first" ran.
}

}  // namespace
}  // namespace stowage
