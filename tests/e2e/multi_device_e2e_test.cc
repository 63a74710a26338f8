// Several devices in one server (two simulated devices): replicas, routing by expected wait, a
// pipeline on one device only, draining, per-device placement views, budgets and metrics, the
// admin API's device selection, and the config errors.
#include <atomic>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "google/protobuf/text_format.h"
#include "server/server.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"

namespace stowage {
namespace {

using std::chrono::milliseconds;

v1::ServerConfig TwoDevices(const std::string& extra = "") {
  v1::ServerConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(
      R"pb(
        metrics_address: "127.0.0.1:0"
        devices { kind: KIND_SIMULATED index: 0 }
        devices { kind: KIND_SIMULATED index: 1 }
        pipelines { name: "a" builtin: "zimage-tiny" devices: "sim:0" devices: "sim:1" default: true }
        pipelines { name: "b" builtin: "tiny" devices: "sim:1" }
      )pb" + extra,
      &config));
  return config;
}

class MultiDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<E2eServer>(TwoDevices());
    ASSERT_TRUE(server_->ok());
  }
  void TearDown() override {
    if (server_ != nullptr && server_->ok()) EXPECT_TRUE(HealthServing(server_->channel()));
  }
  // Sends `n` requests for `pipeline` at once; returns the device each ran on ("" for a failure).
  std::vector<std::string> Burst(const std::string& pipeline, int n, int steps = 6) {
    std::vector<std::string> devices(static_cast<size_t>(n));
    std::vector<std::thread> threads;
    for (int i = 0; i < n; ++i) {
      threads.emplace_back([&, i] {
        v1::GenerateRequest request = E2eServer::SmallRequest(pipeline, static_cast<uint64_t>(i));
        request.set_num_inference_steps(steps);
        v1::GenerateResponse response;
        if (server_->Generate(request, &response, milliseconds(120000)).ok()) {
          devices[static_cast<size_t>(i)] = response.stats().device();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    return devices;
  }
  grpc::Status Drain(const std::string& device, bool drain, v1::DrainDeviceResponse* out = nullptr) {
    v1::DrainDeviceRequest request;
    request.set_device(device);
    request.set_drain(drain);
    v1::DrainDeviceResponse ignored;
    return server_->admin().DrainDevice(E2eServer::Authed().get(), request, out != nullptr ? out : &ignored);
  }
  v1::GetPlacementResponse Placement(const std::string& device) {
    v1::GetPlacementRequest request;
    request.set_device(device);
    v1::GetPlacementResponse response;
    EXPECT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), request, &response).ok());
    return response;
  }
  std::unique_ptr<E2eServer> server_;
};

TEST_F(MultiDeviceTest, ReplicasShareTheLoadAndAOneDevicePipelineStaysOnItsDevice) {
  v1::ListPipelinesResponse list;
  ASSERT_TRUE(server_->Pipelines(&list).ok());
  ASSERT_EQ(list.pipelines_size(), 2);
  std::map<std::string, std::vector<std::string>> devices;
  for (const auto& p : list.pipelines()) devices[p.name()] = {p.devices().begin(), p.devices().end()};
  EXPECT_EQ(devices["a"], (std::vector<std::string>{"sim:0", "sim:1"}));
  EXPECT_EQ(devices["b"], (std::vector<std::string>{"sim:1"}));

  // Six requests for the replicated pipeline at once: both devices work.
  std::map<std::string, int> ran;
  for (const std::string& d : Burst("a", 6)) ++ran[d];
  EXPECT_EQ(ran.count(""), 0u) << "a request failed";
  EXPECT_GE(ran["sim:0"], 1);
  EXPECT_GE(ran["sim:1"], 1);
  // The default pipeline is "a"; the one-device pipeline runs where it lives.
  for (const std::string& d : Burst("b", 3)) EXPECT_EQ(d, "sim:1");
  v1::GenerateResponse by_default;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest(""), &by_default).ok());
  EXPECT_EQ(by_default.pipeline(), "a");

  // Each device has its own placement registry: "b" only on sim:1.
  auto ids = [](const v1::GetPlacementResponse& p) {
    std::vector<std::string> out;
    for (const auto& c : p.components()) out.push_back(c.id());
    return out;
  };
  EXPECT_EQ(Placement("sim:0").device(), "sim:0");
  EXPECT_EQ(ids(Placement("sim:0")),
            (std::vector<std::string>{"a/text_encoder", "a/vae_encoder", "a/transformer", "a/vae"}));
  EXPECT_EQ(ids(Placement("sim:1")).size(), 7u);  // "a" (4) and "b" (3).
  v1::GetPlacementRequest unknown;
  unknown.set_device("sim:7");
  v1::GetPlacementResponse ignored;
  const grpc::Status status = server_->admin().GetPlacement(E2eServer::Authed().get(), unknown, &ignored);
  EXPECT_EQ(status.error_code(), grpc::NOT_FOUND);
  EXPECT_NE(status.error_message().find("device 'sim:7' is not one of this server's: sim:0, sim:1"),
            std::string::npos)
      << status.error_message();

  // Metrics carry the device of every placement series.
  const std::string page = HttpGet(server_->server().metrics_address(), "/metrics");
  EXPECT_NE(page.find("stowage_component_state{component=\"b/transformer\",state=\"resident\",device=\"sim:1\"}"),
            std::string::npos);
  EXPECT_NE(page.find("stowage_pipeline_state{pipeline=\"a\",state=\"ready\",device=\"sim:0\"} 1"),
            std::string::npos);
  EXPECT_EQ(page.find("component=\"b/transformer\",state=\"resident\",device=\"sim:0\""), std::string::npos);
}

// Routing by expected wait: once one replica has run, a replica that has not run yet counts as
// being as fast as it (not as slow as the 1 s prior), so a second request arriving while the first
// is still running goes to the idle replica. The first request's first progress message says it is
// running (no sleep orders the two); its 100 steps keep it running while the second is routed.
TEST_F(MultiDeviceTest, AnUntriedReplicaIsNotTakenForSlow) {
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("a", 1)).ok());  // Measures sim:0 (fast).
  v1::GenerateRequest slow = E2eServer::SmallRequest("a", 2);
  slow.set_num_inference_steps(100);
  grpc::ClientContext context;
  context.set_deadline(In(milliseconds(120000)));
  auto reader = server_->generation().GenerateStream(&context, slow);
  v1::GenerateStreamResponse message;
  ASSERT_TRUE(reader->Read(&message));
  ASSERT_TRUE(message.has_progress());
  v1::GenerateResponse second_reply;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("a", 3), &second_reply).ok());
  std::string slow_device;
  while (reader->Read(&message)) {
    if (message.has_result()) slow_device = message.result().stats().device();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(slow_device, "sim:0");
  EXPECT_EQ(second_reply.stats().device(), "sim:1");
}

TEST_F(MultiDeviceTest, ADrainedDeviceTakesNoNewRequests) {
  v1::DrainDeviceResponse status;
  ASSERT_TRUE(Drain("sim:0", true, &status).ok());
  ASSERT_EQ(status.devices_size(), 2);
  EXPECT_TRUE(status.devices(0).draining());
  EXPECT_FALSE(status.devices(1).draining());
  for (const std::string& d : Burst("a", 4, 2)) EXPECT_EQ(d, "sim:1");
  // Every replica draining: refused, naming them.
  ASSERT_TRUE(Drain("sim:1", true).ok());
  v1::GenerateResponse ignored;
  const grpc::Status refused = server_->Generate(E2eServer::SmallRequest("a"), &ignored);
  EXPECT_EQ(refused.error_code(), grpc::UNAVAILABLE);
  EXPECT_NE(refused.error_message().find("served only by draining devices (sim:0, sim:1)"), std::string::npos)
      << refused.error_message();
  ASSERT_TRUE(Drain("sim:0", false).ok());
  ASSERT_TRUE(Drain("sim:1", false).ok());
  std::map<std::string, int> ran;
  for (const std::string& d : Burst("a", 6)) ++ran[d];
  EXPECT_GE(ran["sim:0"], 1);
  // Hostile drains: no device, an unknown one, no token.
  EXPECT_EQ(Drain("", true).error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_EQ(Drain("cuda:9", true).error_code(), grpc::NOT_FOUND);
  grpc::ClientContext anonymous;
  v1::DrainDeviceRequest request;
  request.set_device("sim:0");
  v1::DrainDeviceResponse out;
  EXPECT_EQ(server_->admin().DrainDevice(&anonymous, request, &out).error_code(), grpc::UNAUTHENTICATED);
}

// Drains toggled on both devices while requests run: each request ends OK or UNAVAILABLE (every
// replica draining at that moment), none hangs; hostile device names are refused, cut short.
TEST_F(MultiDeviceTest, DrainsUnderLoadAndHostileDeviceNames) {
  std::atomic<bool> stop{false};
  std::thread toggler([&] {
    for (int round = 0; !stop.load(); ++round) {
      (void)Drain(round % 2 == 0 ? "sim:0" : "sim:1", round % 3 != 0);
      absl::SleepFor(absl::Milliseconds(3));
    }
  });
  std::map<grpc::StatusCode, int> codes;
  absl::Mutex mu;
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 5; ++i) {
        const grpc::Status status =
            server_->Generate(E2eServer::SmallRequest("a", 10 * c + i), nullptr, milliseconds(60000));
        absl::MutexLock lock(&mu);
        ++codes[status.error_code()];
      }
    });
  }
  for (std::thread& t : clients) t.join();
  stop = true;
  toggler.join();
  for (const auto& [code, n] : codes) EXPECT_TRUE(code == grpc::OK || code == grpc::UNAVAILABLE) << code;
  ASSERT_TRUE(Drain("sim:0", false).ok());
  ASSERT_TRUE(Drain("sim:1", false).ok());
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("a")).ok());

  const std::string huge(100000, 'd');
  v1::GetPlacementRequest placement;
  placement.set_device(huge);
  v1::GetPlacementResponse ignored;
  const grpc::Status refused = server_->admin().GetPlacement(E2eServer::Authed().get(), placement, &ignored);
  EXPECT_EQ(refused.error_code(), grpc::NOT_FOUND);
  EXPECT_LT(refused.error_message().size(), 300u) << "the name must be cut, not echoed";
  EXPECT_EQ(Drain(huge, true).error_code(), grpc::NOT_FOUND);
  v1::GetPlacementLogRequest log;
  log.set_device("sim:0\n\x01");
  v1::GetPlacementLogResponse log_out;
  EXPECT_EQ(server_->admin().GetPlacementLog(E2eServer::Authed().get(), log, &log_out).error_code(), grpc::NOT_FOUND);
  v1::SetOffloadStrategyRequest strategy;
  strategy.set_device("cuda:0");
  strategy.mutable_strategy()->set_custom("lru");
  v1::SetOffloadStrategyResponse strategy_out;
  EXPECT_EQ(server_->admin().SetOffloadStrategy(E2eServer::Authed().get(), strategy, &strategy_out).error_code(),
            grpc::NOT_FOUND);
}

TEST_F(MultiDeviceTest, AdminLoadsOntoNamedDevicesAndActsOnTheNamedDevice) {
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("c");
  load.mutable_pipeline()->set_builtin("tiny");
  load.mutable_pipeline()->add_devices("sim:0");
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded).ok());
  EXPECT_EQ(std::vector<std::string>(loaded.pipeline().devices().begin(), loaded.pipeline().devices().end()),
            std::vector<std::string>{"sim:0"});
  for (const std::string& d : Burst("c", 2, 2)) EXPECT_EQ(d, "sim:0");
  // A second load of the name onto another device: it exists.
  load.mutable_pipeline()->set_devices(0, "sim:1");
  EXPECT_EQ(server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded).error_code(),
            grpc::ALREADY_EXISTS);
  // Unknown and repeated devices are refused, nothing loaded.
  v1::LoadPipelineRequest bad = load;
  bad.mutable_pipeline()->set_name("d");
  bad.mutable_pipeline()->set_devices(0, "sim:5");
  grpc::Status refused = server_->admin().LoadPipeline(E2eServer::Authed().get(), bad, &loaded);
  EXPECT_EQ(refused.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("pipeline.devices: device 'sim:5'"), std::string::npos)
      << refused.error_message();
  bad.mutable_pipeline()->set_devices(0, "sim:1");
  bad.mutable_pipeline()->add_devices("sim:1");
  EXPECT_EQ(server_->admin().LoadPipeline(E2eServer::Authed().get(), bad, &loaded).error_code(),
            grpc::INVALID_ARGUMENT);

  // Group offload on one device's replica leaves the other's alone.
  v1::EnableGroupOffloadRequest enable;
  enable.set_component_id("a/transformer");
  enable.set_device("sim:1");
  v1::EnableGroupOffloadResponse enabled;
  ASSERT_TRUE(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled).ok());
  auto state_of = [&](const std::string& device) {
    const v1::GetPlacementResponse placement = Placement(device);
    for (const auto& c : placement.components()) {
      if (c.id() == "a/transformer") return c.state();
    }
    return v1::ComponentPlacement::STATE_UNSPECIFIED;
  };
  EXPECT_EQ(state_of("sim:1"), v1::ComponentPlacement::GROUP_OFFLOADED);
  EXPECT_NE(state_of("sim:0"), v1::ComponentPlacement::GROUP_OFFLOADED);

  // Unloading removes every replica.
  v1::UnloadPipelineRequest unload;
  unload.set_name("a");
  v1::UnloadPipelineResponse unloaded;
  ASSERT_TRUE(server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded).ok());
  EXPECT_EQ(Placement("sim:0").components_size(), 3);  // "c" only.
  EXPECT_EQ(Placement("sim:1").components_size(), 3);  // "b" only.
  v1::GenerateResponse ignored;
  EXPECT_EQ(server_->Generate(E2eServer::SmallRequest("a"), &ignored).error_code(), grpc::NOT_FOUND);
}

// A device short of memory recovers on its own; the other device's placement never moves.
TEST(MultiDeviceBudgetTest, ADevicesMemoryPressureStaysOnThatDevice) {
  // The zimage-tiny pipeline's weights, from a plain server.
  int64_t weights = 0, transformer = 0;
  {
    E2eServer probe;
    ASSERT_TRUE(probe.ok());
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(probe.Pipelines(&list).ok());
    // What a text-to-image request runs: all but the VAE's encoder.
    for (const auto& c : list.pipelines(0).components()) {
      if (c.name() != "vae_encoder") weights += c.weight_bytes();
      if (c.name() == "transformer") transformer = c.weight_bytes();
    }
  }
  ASSERT_GT(weights, transformer);
  v1::ServerConfig config;
  ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(
      R"pb(
        metrics_address: "none"
        devices { kind: KIND_SIMULATED index: 0 }
        devices { kind: KIND_SIMULATED index: 1 }
        pipelines { name: "a" builtin: "zimage-tiny" devices: "sim:0" devices: "sim:1" }
      )pb",
      &config));
  // sim:0 cannot hold the whole pipeline at once; sim:1 can.
  config.mutable_devices(0)->set_memory_budget_bytes(weights - 1);
  E2eServer server(config);
  ASSERT_TRUE(server.ok());
  v1::DrainDeviceRequest drain;
  drain.set_device("sim:1");
  drain.set_drain(true);
  v1::DrainDeviceResponse drained;
  ASSERT_TRUE(server.admin().DrainDevice(E2eServer::Authed().get(), drain, &drained).ok());
  for (int i = 0; i < 2; ++i) {
    v1::GenerateResponse response;
    ASSERT_TRUE(server.Generate(E2eServer::SmallRequest("a", i), &response).ok());
    EXPECT_EQ(response.stats().device(), "sim:0");
    EXPECT_LE(response.stats().peak_device_memory_bytes(), weights - 1);
  }
  auto log_of = [&](const std::string& device) {
    v1::GetPlacementLogRequest request;
    request.set_device(device);
    request.set_limit(1000);
    v1::GetPlacementLogResponse log;
    EXPECT_TRUE(server.admin().GetPlacementLog(E2eServer::Authed().get(), request, &log).ok());
    int evictions = 0;
    for (const auto& d : log.decisions()) evictions += d.action() == "offload";
    return evictions;
  };
  EXPECT_GT(log_of("sim:0"), 0);   // It made room by moving components out.
  EXPECT_EQ(log_of("sim:1"), 0);   // Nothing happened on the other device.
  EXPECT_TRUE(HealthServing(server.channel()));
}

TEST(MultiDeviceConfigTest, BadDeviceListsFailStartUpNamingTheField) {
  struct Case {
    std::string text;
    std::string needle;
  };
  for (const Case& c : std::vector<Case>{
           {R"pb(devices { kind: KIND_SIMULATED index: 1 } devices { kind: KIND_SIMULATED index: 1 })pb",
            "devices[1]: device sim:1 is configured twice"},
           {R"pb(devices { kind: KIND_SIMULATED } pipelines { name: "x" builtin: "tiny" devices: "cuda:3" })pb",
            "pipelines[0].devices: 'cuda:3' is not a device of this server; devices: sim:0"},
           {R"pb(device { kind: KIND_SIMULATED } devices { kind: KIND_SIMULATED })pb", "device and devices"},
           {R"pb(devices { kind: KIND_SIMULATED index: 200 })pb", "devices[0].index: 200 is out of range"},
       }) {
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(c.text, &config)) << c.text;
    config.set_grpc_address("127.0.0.1:0");
    config.set_metrics_address("none");
    auto server = StowageServer::Start(config);
    ASSERT_FALSE(server.ok()) << c.text;
    EXPECT_NE(server.status().message().find(c.needle), std::string::npos) << server.status();
  }
}

}  // namespace
}  // namespace stowage
