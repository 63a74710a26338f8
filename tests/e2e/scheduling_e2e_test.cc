// The request scheduler through a real server over loopback (ServerConfig.scheduler,
// GenerateRequest.priority/tenant): a request for the pipeline whose weights are on the device runs
// before an older one that would move weights (within max_reorder_delay; the placement log says
// why), a higher priority runs first, tenants are counted by bounded labels, a tenant over its queue
// limit is refused by name, and hostile priorities and tenants get clear statuses.
//
// Ordering without sleeps: a long request runs first (its first progress message says it is on the
// device); the requests under test are queued behind it, each once the queue-depth gauge shows the
// one before it waiting; the order they then run in is the scheduler's.
#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"
#include "tests/e2e/queued_together.h"

namespace stowage {
namespace {

using std::chrono::milliseconds;

class SchedulingTest : public ::testing::Test {
 protected:
  void Start(const std::string& config_text) {
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(config_text, &config));
    config.set_metrics_address("127.0.0.1:0");
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
  }
  void TearDown() override {
    if (server_ != nullptr && server_->ok()) EXPECT_TRUE(HealthServing(server_->channel()));
  }

  // Starts a long request for `pipeline` and returns once it runs on the device.
  void StartLong(const std::string& pipeline) {
    long_ = std::make_unique<LongRequest>(server_->generation(), pipeline);
    ASSERT_TRUE(long_->running());
  }
  void FinishLong() { EXPECT_TRUE(long_->Finish()); }
  bool WaitForQueueDepth(int depth) {
    return stowage::WaitForQueueDepth(server_->server().metrics_address(), "sim:0", depth);
  }

  // The cross-pipeline prefetch tests: a server with "z" (Z-Image tiny) and "f" (Flux tiny) whose
  // host copies are pinned, with the prefetch on or off.
  void StartZAndF(bool prefetch) {
    Start(absl::StrCat("device { kind: KIND_SIMULATED pin_host_copies: true prefetch_next_pipeline: ",
                       prefetch ? "true" : "false",
                       " } pipelines { name: \"z\" builtin: \"zimage-tiny\" } "
                       "pipelines { name: \"f\" builtin: \"flux-tiny\" }"));
  }
  // An "f" request queued behind a long "z" request: its reply.
  v1::GenerateResponse FQueuedBehindLongZ() {
    StartLong("z");
    v1::GenerateResponse f_reply;
    std::thread f([&] {
      EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("f", 2), &f_reply, milliseconds(120000)).ok());
    });
    EXPECT_TRUE(WaitForQueueDepth(1));
    FinishLong();
    f.join();
    return f_reply;
  }
  // The placement log's decisions (the whole log: at most 4096).
  v1::GetPlacementLogResponse PlacementLog() {
    v1::GetPlacementLogRequest request;
    request.set_limit(4096);
    v1::GetPlacementLogResponse log;
    EXPECT_TRUE(server_->admin().GetPlacementLog(E2eServer::Authed().get(), request, &log).ok());
    return log;
  }

  // Sends `request` on a thread; records the order replies come back in.
  std::thread Send(const v1::GenerateRequest& request, const std::string& name) {
    return std::thread([this, request, name] {
      v1::GenerateResponse response;
      const grpc::Status status = server_->Generate(request, &response, milliseconds(120000));
      EXPECT_TRUE(status.ok()) << name << ": " << status.error_message();
      absl::MutexLock lock(&mu_);
      finished_.push_back(name);
    });
  }
  std::vector<std::string> Finished() {
    absl::MutexLock lock(&mu_);
    return finished_;
  }
  void ClearFinished() {
    absl::MutexLock lock(&mu_);
    finished_.clear();
  }

  // Two pipelines whose weights do not fit together (two_pipelines_e2e_test's budget: the larger
  // pipeline and half the smaller), with `scheduler` (text of a SchedulerConfig).
  void StartTwoPipelinesUnderABudget(const std::string& scheduler) {
    Start(R"pb(
      device { kind: KIND_SIMULATED }
      pipelines { name: "z" builtin: "zimage-tiny" }
      pipelines { name: "f" builtin: "flux-tiny" }
    )pb");
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(server_->Pipelines(&list).ok());
    std::map<std::string, int64_t> weights;
    for (const auto& p : list.pipelines()) {
      for (const auto& c : p.components()) weights[p.name()] += c.weight_bytes();
    }
    server_.reset();
    Start(absl::StrCat(R"pb(
      device { kind: KIND_SIMULATED memory_budget_bytes: )pb",
                       std::max(weights["z"], weights["f"]) + std::min(weights["z"], weights["f"]) / 2, R"pb( }
      pipelines { name: "z" builtin: "zimage-tiny" }
      pipelines { name: "f" builtin: "flux-tiny" }
      scheduler { )pb", scheduler, " }"));
  }
  // With "z" running on the device, an older "f" request (which would move weights) and a younger
  // "z" one wait; returns the order they finished in. "f" is loaded afresh first (admin Unload and
  // Load): its weights on the host, whatever an earlier round left on the device.
  std::vector<std::string> OrderOfAnOlderMoveAndAYoungerResident() {
    ClearFinished();
    v1::UnloadPipelineRequest unload;
    unload.set_name("f");
    v1::UnloadPipelineResponse unloaded;
    EXPECT_TRUE(server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded).ok());
    v1::LoadPipelineRequest load;
    load.mutable_pipeline()->set_name("f");
    load.mutable_pipeline()->set_builtin("flux-tiny");
    v1::LoadPipelineResponse loaded;
    EXPECT_TRUE(server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded).ok());
    StartLong("z");  // "z" is on the device while it runs.
    std::thread older = Send(E2eServer::SmallRequest("f", 1), "f (older, would move weights)");
    EXPECT_TRUE(WaitForQueueDepth(1));
    std::thread younger = Send(E2eServer::SmallRequest("z", 2), "z (younger, resident)");
    EXPECT_TRUE(WaitForQueueDepth(2));
    FinishLong();
    older.join();
    younger.join();
    return Finished();
  }
  int ScheduleDecisions() {
    const v1::GetPlacementLogResponse log = PlacementLog();
    int schedules = 0;
    for (const auto& d : log.decisions()) schedules += d.action() == "schedule";
    return schedules;
  }

  std::unique_ptr<E2eServer> server_;
  std::unique_ptr<LongRequest> long_;
  absl::Mutex mu_;
  std::vector<std::string> finished_ ABSL_GUARDED_BY(mu_);
};

TEST_F(SchedulingTest, TheResidentPipelineRunsBeforeAnOlderRequestThatWouldMoveWeights) {
  // "z" on the device, "f" on the host.
  StartTwoPipelinesUnderABudget("max_reorder_delay_ms: 60000");
  EXPECT_EQ(OrderOfAnOlderMoveAndAYoungerResident(),
            (std::vector<std::string>{"z (younger, resident)", "f (older, would move weights)"}));
  const v1::GetPlacementLogResponse log = PlacementLog();
  int schedules = 0;
  for (const auto& d : log.decisions()) {
    if (d.action() != "schedule") continue;
    ++schedules;
    EXPECT_EQ(d.component(), "z");
    EXPECT_NE(d.reason().find("ran before an older request of pipeline 'f'"), std::string::npos) << d.reason();
  }
  EXPECT_EQ(schedules, 1);
}

// The admin SetScheduler switches a running server between first come, first served and residency
// reordering (what bench/multi_tenant.py compares on one loaded server); hostile settings are
// refused by field name and leave the scheduler in force; no token, no change.
TEST_F(SchedulingTest, TheSchedulerSwitchedAtRunTimeDecidesTheOrderFromThenOn) {
  StartTwoPipelinesUnderABudget("");
  const std::vector<std::string> fifo = {"f (older, would move weights)", "z (younger, resident)"};
  const std::vector<std::string> reordered = {"z (younger, resident)", "f (older, would move weights)"};
  EXPECT_EQ(OrderOfAnOlderMoveAndAYoungerResident(), fifo);
  EXPECT_EQ(ScheduleDecisions(), 0);
  v1::SetSchedulerRequest set;
  set.mutable_scheduler()->set_max_reorder_delay_ms(60000);
  v1::SetSchedulerResponse now;
  ASSERT_TRUE(server_->admin().SetScheduler(E2eServer::Authed().get(), set, &now).ok());
  EXPECT_EQ(now.scheduler().max_reorder_delay_ms(), 60000);
  EXPECT_EQ(OrderOfAnOlderMoveAndAYoungerResident(), reordered);
  EXPECT_EQ(ScheduleDecisions(), 1);
  // Hostile settings: INVALID_ARGUMENT naming the field; the scheduler in force stays.
  struct Case {
    std::string text;
    std::string needle;
  };
  for (const Case& c : std::vector<Case>{
           {"max_reorder_delay_ms: -1", "scheduler.max_reorder_delay_ms: -1 is out of range"},
           {"max_reorder_delay_ms: 2147483647", "scheduler.max_reorder_delay_ms: 2147483647"},
           {"priority_mode: 7", "scheduler.priority_mode: unknown value 7"},
           {"preemption: 12", "scheduler.preemption: unknown value 12"},
           {"preemption: PREEMPTION_RESIDENT", "scheduler.preemption: PREEMPTION_RESIDENT bounds how long"},
           {"tenant_queue_limit: 17", "scheduler.tenant_queue_limit: 17 is out of range; allowed: 0 (off) ..queue_depth (16)"},
           {"tenant_burst_work: nan", "scheduler.tenant_burst_work: nan"},
           {"tenant_burst_work: 1e300", "scheduler.tenant_burst_work"},
           {"tenant_weights { key: \"a\" value: -1 }", "scheduler.tenant_weights[a]: -1"},
           {"tenant_weights { key: \"a\" value: inf }", "scheduler.tenant_weights[a]: inf"},
           {"tenant_weights { key: \"\" value: 1 }", "scheduler.tenant_weights: tenant ''"},
           {"tenant_weights { key: \"x y\" value: 1 }", "tenant 'x y' is not"},
       }) {
    v1::SetSchedulerRequest bad;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(c.text, bad.mutable_scheduler())) << c.text;
    v1::SetSchedulerResponse ignored;
    const grpc::Status status = server_->admin().SetScheduler(E2eServer::Authed().get(), bad, &ignored);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << c.text;
    EXPECT_NE(status.error_message().find(c.needle), std::string::npos) << c.text << ": " << status.error_message();
  }
  {
    v1::SetSchedulerRequest many;
    for (int i = 0; i < 10000; ++i) (*many.mutable_scheduler()->mutable_tenant_weights())[absl::StrCat("t", i)] = 1;
    v1::SetSchedulerResponse ignored;
    const grpc::Status status = server_->admin().SetScheduler(E2eServer::Authed().get(), many, &ignored);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("scheduler.tenant_weights: 10000 tenants; at most"), std::string::npos)
        << status.error_message();
  }
  {
    grpc::ClientContext no_token;
    v1::SetSchedulerResponse ignored;
    EXPECT_EQ(server_->admin().SetScheduler(&no_token, v1::SetSchedulerRequest(), &ignored).error_code(),
              grpc::UNAUTHENTICATED);
  }
  v1::GetSchedulerResponse in_force;
  ASSERT_TRUE(server_->admin().GetScheduler(E2eServer::Authed().get(), v1::GetSchedulerRequest(), &in_force).ok());
  EXPECT_EQ(in_force.scheduler().max_reorder_delay_ms(), 60000);
  // Back to first come, first served.
  ASSERT_TRUE(server_->admin().SetScheduler(E2eServer::Authed().get(), v1::SetSchedulerRequest(), &now).ok());
  EXPECT_EQ(OrderOfAnOlderMoveAndAYoungerResident(), fifo);
  EXPECT_EQ(ScheduleDecisions(), 1);
}

// SetScheduler while requests wait and run, from several admin clients at once: every request
// succeeds, the last setting is the one in force, and the server still answers health checks.
TEST_F(SchedulingTest, SchedulerChangesWhileRequestsRunLoseNoRequest) {
  // Batching on, and preemption switched among its modes while requests of several priorities and
  // lengths run: batches and requests preempting others between steps lose nothing either.
  Start(R"pb(
    device { kind: KIND_SIMULATED }
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" batching { max_batch_size: 3 } }
  )pb");
  std::vector<std::thread> requests;
  for (int i = 0; i < 12; ++i) {
    v1::GenerateRequest r = E2eServer::SmallRequest("zimage-tiny", 100 + i);
    r.set_tenant(i % 2 == 0 ? "a" : "b");
    r.set_priority(i % 3);
    r.set_num_inference_steps(i % 4 == 0 ? 12 : 2);
    requests.push_back(Send(r, absl::StrCat("r", i)));
  }
  std::vector<std::thread> admins;
  for (int a = 0; a < 3; ++a) {
    admins.emplace_back([this, a] {
      for (int k = 0; k < 20; ++k) {
        v1::SetSchedulerRequest set;
        set.mutable_scheduler()->set_max_reorder_delay_ms((k % 2) * 5000);
        set.mutable_scheduler()->set_priority_mode(k % 2 == 0 ? v1::SchedulerConfig::PRIORITY_WEIGHTED
                                                              : v1::SchedulerConfig::PRIORITY_STRICT);
        (*set.mutable_scheduler()->mutable_tenant_weights())["a"] = 1 + a;
        // Limits that change but never bite (6 requests per tenant): a refusal is a clear status,
        // not a lost request, but it would make this test depend on timing.
        set.mutable_scheduler()->set_tenant_queue_limit(k % 2 == 0 ? 0 : 6);
        set.mutable_scheduler()->set_preemption(k % 2 == 1 && a != 0 ? v1::SchedulerConfig::PREEMPTION_RESIDENT
                                                : k % 3 == 0          ? v1::SchedulerConfig::PREEMPTION_NONE
                                                                      : v1::SchedulerConfig::PREEMPTION_PRIORITY);
        v1::SetSchedulerResponse now;
        EXPECT_TRUE(server_->admin().SetScheduler(E2eServer::Authed().get(), set, &now).ok());
      }
    });
  }
  for (std::thread& t : admins) t.join();
  for (std::thread& t : requests) t.join();
  EXPECT_EQ(Finished().size(), 12u);
  v1::SetSchedulerRequest last;
  last.mutable_scheduler()->set_max_reorder_delay_ms(1234);
  v1::SetSchedulerResponse now;
  ASSERT_TRUE(server_->admin().SetScheduler(E2eServer::Authed().get(), last, &now).ok());
  v1::GetSchedulerResponse in_force;
  ASSERT_TRUE(server_->admin().GetScheduler(E2eServer::Authed().get(), v1::GetSchedulerRequest(), &in_force).ok());
  EXPECT_EQ(in_force.scheduler().max_reorder_delay_ms(), 1234);
  EXPECT_TRUE(in_force.scheduler().tenant_weights().empty());
}

TEST_F(SchedulingTest, AHigherPriorityRunsFirstAndTenantsAreCountedByBoundedLabels) {
  Start(R"pb(
    device { kind: KIND_SIMULATED }
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" }
    scheduler { tenant_weights { key: "gold" value: 2 } }
  )pb");
  StartLong("zimage-tiny");
  v1::GenerateRequest low = E2eServer::SmallRequest("zimage-tiny", 1);
  low.set_tenant("gold");
  v1::GenerateRequest high = E2eServer::SmallRequest("zimage-tiny", 2);
  high.set_priority(5);
  high.set_tenant("someone-else");
  std::thread first = Send(low, "low");
  ASSERT_TRUE(WaitForQueueDepth(1));
  std::thread second = Send(high, "high");
  ASSERT_TRUE(WaitForQueueDepth(2));
  FinishLong();
  first.join();
  second.join();
  EXPECT_EQ(Finished(), (std::vector<std::string>{"high", "low"}));
  const std::string page = HttpGet(server_->server().metrics_address(), "/metrics");
  EXPECT_NE(page.find("stowage_tenant_requests_total{code=\"ok\",priority=\"0\",tenant=\"gold\"} 1"),
            std::string::npos)
      << page.substr(page.find("stowage_tenant"), 800);
  // Unlisted tenants share one label: client input never becomes a label value.
  EXPECT_NE(page.find("stowage_tenant_requests_total{code=\"ok\",priority=\"5\",tenant=\"other\"} 1"),
            std::string::npos);
  EXPECT_NE(page.find("stowage_tenant_requests_total{code=\"ok\",priority=\"0\",tenant=\"default\"} 1"),
            std::string::npos);  // The long request.
  EXPECT_EQ(page.find("someone-else"), std::string::npos);
  EXPECT_NE(page.find("stowage_tenant_queue_wait_seconds_count{priority=\"5\",tenant=\"other\"} 1"),
            std::string::npos);
}

TEST_F(SchedulingTest, ATenantOverItsQueueLimitIsRefusedByNameAndOthersStillGetIn) {
  Start(R"pb(
    device { kind: KIND_SIMULATED }
    queue_depth: 4
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" }
    scheduler { tenant_queue_limit: 1 }
  )pb");
  StartLong("zimage-tiny");
  v1::GenerateRequest a = E2eServer::SmallRequest("zimage-tiny", 1);
  a.set_tenant("a");
  std::thread waiting = Send(a, "a-1");
  ASSERT_TRUE(WaitForQueueDepth(1));
  v1::GenerateResponse ignored;
  const grpc::Status refused = server_->Generate(a, &ignored);
  EXPECT_EQ(refused.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_NE(refused.error_message().find("tenant 'a' has 1 requests waiting on sim:0"), std::string::npos)
      << refused.error_message();
  v1::GenerateRequest b = E2eServer::SmallRequest("zimage-tiny", 2);
  b.set_tenant("b");
  std::thread other = Send(b, "b-1");
  ASSERT_TRUE(WaitForQueueDepth(2));
  FinishLong();
  waiting.join();
  other.join();
  EXPECT_EQ(Finished().size(), 2u);
}

// Cross-pipeline prefetch (DeviceConfig.prefetch_next_pipeline, on by default): while a long "z"
// request computes with nothing more to copy, the "f" request queued behind it has "f"'s weights
// (what its last run used, in that order) copied onto the device; "f" then moves only what was not
// prefetched itself, and the placement log, GetPlacement and the metrics say so. Switched off,
// nothing is prefetched. "f" is put back on the host after its first request (group offloading
// enabled and disabled again: its components are then offloaded); the host copies are pinned (a
// prefetch needs them page-locked).
TEST_F(SchedulingTest, TheNextPipelinesWeightsCopyWhileTheRunningRequestComputes) {
  std::vector<std::string> f_images;  // "f"'s image with the prefetch on, then off: the same.
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "prefetch on" : "prefetch off");
    StartZAndF(on);
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(server_->Pipelines(&list).ok());
    int64_t f_weights = 0;
    for (const auto& p : list.pipelines()) {
      if (p.name() != "f") continue;
      for (const auto& c : p.components()) f_weights += c.weight_bytes();
    }
    // First requests teach the server the order each pipeline runs its components in.
    ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("f", 1)).ok());
    ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("z", 1)).ok());
    v1::EnableGroupOffloadRequest enable;
    enable.set_pipeline("f");
    v1::EnableGroupOffloadResponse enabled;
    ASSERT_TRUE(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled).ok());
    v1::DisableGroupOffloadRequest disable;
    disable.set_pipeline("f");
    v1::DisableGroupOffloadResponse disabled;
    ASSERT_TRUE(server_->admin().DisableGroupOffload(E2eServer::Authed().get(), disable, &disabled).ok());
    for (const auto& c : disabled.components()) EXPECT_EQ(c.state(), v1::ComponentPlacement::OFFLOADED) << c.id();
    const v1::GenerateResponse f_reply = FQueuedBehindLongZ();
    f_images.push_back(f_reply.image());
    const v1::GetPlacementLogResponse log = PlacementLog();
    int prefetches = 0;
    for (const auto& d : log.decisions()) {
      EXPECT_NE(d.action(), "prefetch_failed") << d.reason();
      if (d.action() != "prefetch_pipeline") continue;
      ++prefetches;
      EXPECT_EQ(d.component().rfind("f/", 0), 0u) << d.component();
      EXPECT_NE(d.reason().find("pipeline 'f' waits next in the queue: copied while 'z' runs"), std::string::npos)
          << d.reason();
    }
    v1::GetPlacementResponse placement;
    ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
    EXPECT_EQ(placement.pipeline_prefetches(), prefetches);
    if (on) {
      EXPECT_GE(prefetches, 2);  // Its text encoders, transformer and VAE: not its image encoder, which it never ran.
      EXPECT_LT(placement.pipeline_prefetch_bytes(), f_weights);
      EXPECT_EQ(placement.pipeline_prefetches_used(), prefetches);  // "f" ran next: every one was used.
      EXPECT_EQ(placement.pipeline_prefetches_unused(), 0);
      // "f" itself copied its inputs only (64x64 latents and prompt tensors: kilobytes).
      EXPECT_LE(f_reply.stats().host_to_device_bytes(), int64_t{64} << 10);
      const std::string metrics = HttpGet(server_->server().metrics_address(), "/metrics");
      EXPECT_NE(metrics.find(absl::StrCat("stowage_placement_pipeline_prefetches_total{device=\"sim:0\",outcome=\"used\"} ",
                                          prefetches)),
                std::string::npos);
    } else {
      EXPECT_EQ(prefetches, 0);
      EXPECT_GE(f_reply.stats().host_to_device_bytes(), f_weights / 2);  // It onloaded its weights itself.
    }
    server_.reset();
  }
  ASSERT_EQ(f_images.size(), 2u);
  EXPECT_FALSE(f_images[0].empty());
  EXPECT_EQ(f_images[0], f_images[1]) << "a prefetched pipeline made another image";
}

// The next request's first streamed component (here "f"'s T5, group-offloaded) gets its first
// groups copied into its slots while "z" runs; "f"'s run uses them (counted used) and its image is
// the one it gets with the prefetch off.
TEST_F(SchedulingTest, TheNextPipelinesStreamedEncoderStartsAhead) {
  std::vector<std::string> f_images;
  for (const bool on : {true, false}) {
    SCOPED_TRACE(on ? "prefetch on" : "prefetch off");
    StartZAndF(on);
    v1::EnableGroupOffloadRequest enable;
    enable.set_component_id("f/text_encoder_2");
    enable.mutable_options()->set_use_stream(true);
    v1::EnableGroupOffloadResponse enabled;
    const grpc::Status streamed = server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled);
    ASSERT_TRUE(streamed.ok()) << streamed.error_message();
    // First requests teach the server the order each pipeline runs its components (and T5 its groups) in.
    ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("f", 1)).ok());
    ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("z", 1)).ok());
    f_images.push_back(FQueuedBehindLongZ().image());
    const v1::GetPlacementLogResponse log = PlacementLog();
    int first_groups = 0;
    for (const auto& d : log.decisions()) {
      EXPECT_NE(d.action(), "prefetch_failed") << d.reason();
      if (d.action() == "prefetch_pipeline" && d.component() == "f/text_encoder_2") {
        EXPECT_NE(d.reason().find("its first groups"), std::string::npos) << d.reason();
        EXPECT_GT(d.bytes(), 0);
        ++first_groups;
      }
    }
    v1::GetPlacementResponse placement;
    ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
    if (on) {
      EXPECT_EQ(first_groups, 1);
      EXPECT_EQ(placement.pipeline_prefetches_used(), placement.pipeline_prefetches());  // "f" ran next.
      EXPECT_GE(placement.pipeline_prefetches_used(), 1);
      EXPECT_EQ(placement.pipeline_prefetches_unused(), 0);
    } else {
      EXPECT_EQ(first_groups, 0);
      EXPECT_EQ(placement.pipeline_prefetches(), 0);
    }
    EXPECT_TRUE(HealthServing(server_->channel()));
    server_.reset();
  }
  ASSERT_EQ(f_images.size(), 2u);
  EXPECT_FALSE(f_images[0].empty());
  EXPECT_EQ(f_images[0], f_images[1]) << "a prefetched encoder made another image";
}

// Preemption between steps (SchedulerConfig.preemption: PREEMPTION_PRIORITY): a higher-priority
// request that arrives while a long one runs runs between two of its steps and replies while the
// long one is still running; the long one then goes on from its step and its reply counts the
// pause (preemptions, preempted_time: in its run time, not in its denoise stage). The placement
// log records the decision, the metrics count it.
TEST_F(SchedulingTest, AHigherPriorityRequestRunsBetweenTheStepsOfARunningOne) {
  Start(R"pb(
    device { kind: KIND_SIMULATED }
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" }
    scheduler { preemption: PREEMPTION_PRIORITY }
  )pb");
  // The long request has a deadline (120 s): it is paused only once the device knows how long the
  // pipeline's requests take (its first request here).
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("zimage-tiny", 1)).ok());
  StartLong("zimage-tiny");
  v1::GenerateRequest urgent = E2eServer::SmallRequest("zimage-tiny", 2);
  urgent.set_priority(5);
  urgent.set_request_id("urgent");
  v1::GenerateResponse urgent_reply;
  ASSERT_TRUE(server_->Generate(urgent, &urgent_reply, milliseconds(120000)).ok());
  ASSERT_TRUE(long_->Finish());
  const v1::RequestStats& paused = long_->result().stats();
  EXPECT_EQ(paused.preemptions(), 1);
  // Its stream said so: a "paused" event, then its denoise steps again.
  const std::vector<std::string>& stages = long_->stages();
  const auto pause = std::find(stages.begin(), stages.end(), "paused");
  ASSERT_NE(pause, stages.end());
  EXPECT_NE(std::find(pause, stages.end(), "denoise"), stages.end());
  const double preempted = paused.preempted_time().seconds() + paused.preempted_time().nanos() * 1e-9;
  const double run = paused.run_time().seconds() + paused.run_time().nanos() * 1e-9;
  EXPECT_GT(preempted, 0);
  EXPECT_LT(preempted, run);
  for (const v1::StageTiming& stage : paused.stages()) {
    if (stage.stage() != "denoise") continue;
    const double denoise = stage.duration().seconds() + stage.duration().nanos() * 1e-9;
    EXPECT_LE(denoise + preempted, run) << "the pause is not in the denoise stage";
  }
  // The urgent request did not wait for the long one's 100 steps.
  const double urgent_waited = urgent_reply.stats().queue_wait().seconds() + urgent_reply.stats().queue_wait().nanos() * 1e-9;
  EXPECT_LT(urgent_waited, run - preempted);
  EXPECT_EQ(urgent_reply.stats().preemptions(), 0);
  const v1::GetPlacementLogResponse log = PlacementLog();
  int preempts = 0;
  for (const auto& d : log.decisions()) {
    if (d.action() != "preempt") continue;
    ++preempts;
    EXPECT_EQ(d.request_id(), "urgent");
    EXPECT_EQ(d.component(), "zimage-tiny");
    EXPECT_NE(d.reason().find("priority 5 preempts the running request of pipeline 'zimage-tiny' (priority 0)"),
              std::string::npos)
        << d.reason();
  }
  EXPECT_EQ(preempts, 1);
  const std::string page = HttpGet(server_->server().metrics_address(), "/metrics");
  EXPECT_NE(page.find("stowage_preemptions_total{device=\"sim:0\"} 1"), std::string::npos);
  // No allocator out-of-memory error here: the worker never went on on a fresh thread (the series
  // exists from the start).
  EXPECT_NE(page.find("stowage_device_thread_renewals_total{device=\"sim:0\"} 0"), std::string::npos);
  // The same request again at priority 0 waits for the next long one (no preemption).
  StartLong("zimage-tiny");
  std::thread same = Send(E2eServer::SmallRequest("zimage-tiny", 3), "same priority");
  ASSERT_TRUE(WaitForQueueDepth(1));
  FinishLong();
  same.join();
  EXPECT_EQ(long_->result().stats().preemptions(), 0);
}

// PREEMPTION_RESIDENT: a short request of a pipeline whose weights are on the device runs between
// the steps of a long request of another pipeline (same priority), and the decision says why (by
// the run times the device learned from the requests before).
TEST_F(SchedulingTest, AShortRequestOfAResidentPipelineRunsBetweenTheStepsOfALongOne) {
  Start(R"pb(
    device { kind: KIND_SIMULATED }
    pipelines { name: "z" builtin: "zimage-tiny" }
    pipelines { name: "f" builtin: "flux-tiny" }
    scheduler { preemption: PREEMPTION_RESIDENT max_reorder_delay_ms: 60000 }
  )pb");
  // Both run once first, so that each one's weights are on the device and the scheduler knows it.
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("z", 1)).ok());
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("f", 1)).ok());
  StartLong("f");
  v1::GenerateRequest hot = E2eServer::SmallRequest("z", 2);
  hot.set_request_id("hot");
  v1::GenerateResponse hot_reply;
  ASSERT_TRUE(server_->Generate(hot, &hot_reply, milliseconds(120000)).ok());
  ASSERT_TRUE(long_->Finish());
  EXPECT_EQ(long_->result().stats().preemptions(), 1);
  const v1::GetPlacementLogResponse log = PlacementLog();
  std::string reason;
  for (const auto& d : log.decisions()) {
    if (d.action() == "preempt" && d.request_id() == "hot") reason = d.reason();
  }
  // Both pipelines ran before: their run times decide which is shorter.
  EXPECT_NE(reason.find("pipeline 'z' moves nothing and its run ("), std::string::npos) << reason;
  EXPECT_NE(reason.find(" s expected) is shorter than the running request of pipeline 'f' has left ("),
            std::string::npos)
      << reason;
}

TEST_F(SchedulingTest, HostilePrioritiesAndTenantsGetClearStatuses) {
  Start(R"pb(
    device { kind: KIND_SIMULATED }
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" }
  )pb");
  struct Case {
    int priority;
    std::string tenant;
    std::string needle;
  };
  for (const Case& c : std::vector<Case>{
           {-1, "", "priority is -1; allowed: 0 (the default) ..9"},
           {10, "", "priority is 10; allowed: 0 (the default) ..9"},
           {2147483647, "", "priority is 2147483647"},
           {0, "two words", "tenant two words is not at most 64 characters of [A-Za-z0-9._-]"},
           {0, std::string(5000, 't'), "(5000 bytes)"},
           {0, std::string("nul\0byte", 8), "tenant nul?byte is not"},
       }) {
    v1::GenerateRequest request = E2eServer::SmallRequest("zimage-tiny");
    request.set_priority(c.priority);
    request.set_tenant(c.tenant);
    v1::GenerateResponse ignored;
    const grpc::Status status = server_->Generate(request, &ignored);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << c.needle;
    EXPECT_NE(status.error_message().find(c.needle), std::string::npos) << status.error_message();
  }
  // The longest valid tenant, the highest priority: served.
  v1::GenerateRequest ok = E2eServer::SmallRequest("zimage-tiny");
  ok.set_priority(9);
  ok.set_tenant(std::string(64, 'x'));
  EXPECT_TRUE(server_->Generate(ok).ok());
}

}  // namespace
}  // namespace stowage
