// Split pipelines on two simulated devices (issue 13, part 3): a pipeline's components on different
// devices (PipelineConfig.component_devices), run by each device's own worker; exact peaks per
// device; the same images as the unsplit pipeline; two pipelines split in opposite directions at
// once; admin MoveComponent; hostile configs and requests; shutting down with split requests in
// flight. The simulated devices count placed bytes exactly, so the peaks below are sums of weights.
#include <atomic>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "google/protobuf/text_format.h"
#include "server/server.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"
#include "tests/runtime/runtime_state.h"

namespace stowage {
namespace {

using std::chrono::milliseconds;

v1::ServerConfig Config(const std::string& text) {
  v1::ServerConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(
      R"pb(
        devices { kind: KIND_SIMULATED index: 0 }
        devices { kind: KIND_SIMULATED index: 1 }
      )pb" + text,
      &config))
      << text;
  return config;
}

// "split" (home sim:0, text encoder on sim:1), "rsplit" (home sim:1, text encoder and VAE on sim:0)
// and "whole" (sim:0, not split), all zimage-tiny with the same weights.
constexpr char kPipelines[] = R"pb(
  pipelines {
    name: "split"
    builtin: "zimage-tiny"
    devices: "sim:0"
    component_devices { component: "text_encoder" device: "sim:1" }
  }
  pipelines {
    name: "rsplit"
    builtin: "zimage-tiny"
    devices: "sim:1"
    component_devices { component: "text_encoder" device: "sim:0" }
    component_devices { component: "vae" device: "sim:0" }
  }
  pipelines { name: "whole" builtin: "zimage-tiny" devices: "sim:0" }
)pb";

class SplitPipelineTest : public ::testing::Test {
 protected:
  void Start(const std::string& pipelines) {
    v1::ServerConfig config = Config(pipelines);
    config.set_metrics_address("127.0.0.1:0");
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
  }
  void TearDown() override {
    if (server_ != nullptr && server_->ok()) EXPECT_TRUE(HealthServing(server_->channel()));
  }
  v1::GetPlacementResponse Placement(const std::string& device) {
    v1::GetPlacementRequest request;
    request.set_device(device);
    v1::GetPlacementResponse response;
    EXPECT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), request, &response).ok());
    return response;
  }
  // Component id → device bytes on `device`.
  std::map<std::string, int64_t> DeviceBytes(const std::string& device) {
    std::map<std::string, int64_t> out;
    const v1::GetPlacementResponse placement = Placement(device);  // Not a temporary: iterated below.
    for (const auto& c : placement.components()) out[c.id()] = c.device_bytes();
    return out;
  }
  // Component name → weight bytes (and device) of `pipeline`, from ListPipelines.
  std::map<std::string, int64_t> Weights(const std::string& pipeline, std::map<std::string, std::string>* devices = nullptr) {
    v1::ListPipelinesResponse list;
    EXPECT_TRUE(server_->Pipelines(&list).ok());
    std::map<std::string, int64_t> out;
    for (const auto& p : list.pipelines()) {
      if (p.name() != pipeline) continue;
      for (const auto& c : p.components()) {
        out[c.name()] = c.weight_bytes();
        if (devices != nullptr) (*devices)[c.name()] = c.device();
      }
    }
    return out;
  }
  grpc::Status Move(const std::string& pipeline, const std::string& component, const std::string& device,
                    v1::MoveComponentResponse* out = nullptr) {
    v1::MoveComponentRequest request;
    request.set_pipeline(pipeline);
    request.set_component(component);
    request.set_device(device);
    v1::MoveComponentResponse ignored;
    return server_->admin().MoveComponent(E2eServer::Authed().get(), request, out != nullptr ? out : &ignored);
  }
  std::unique_ptr<E2eServer> server_;
};

std::map<std::string, const v1::DeviceUsage*> UsageByDevice(const v1::GenerateResponse& response) {
  std::map<std::string, const v1::DeviceUsage*> out;
  for (const auto& u : response.stats().devices()) out[u.device()] = &u;
  return out;
}

TEST_F(SplitPipelineTest, EachComponentRunsOnItsDeviceWithExactPeaksAndTheSameImage) {
  ASSERT_NO_FATAL_FAILURE(Start(kPipelines));
  std::map<std::string, std::string> where;
  const std::map<std::string, int64_t> w = Weights("split", &where);
  ASSERT_EQ(w.size(), 4u);
  EXPECT_EQ(where["text_encoder"], "sim:1");
  EXPECT_EQ(where["vae_encoder"], "sim:0");  // With the pipeline (component_devices does not name it).
  EXPECT_EQ(where["transformer"], "sim:0");
  EXPECT_EQ(where["vae"], "sim:0");
  // Each device's registry holds the split pipeline's components that live there.
  std::map<std::string, int64_t> on0 = DeviceBytes("sim:0"), on1 = DeviceBytes("sim:1");
  EXPECT_EQ(on0.count("split/text_encoder"), 0u);
  EXPECT_EQ(on0.count("split/transformer"), 1u);
  EXPECT_EQ(on0.count("split/vae"), 1u);
  EXPECT_EQ(on1.count("split/text_encoder"), 1u);
  EXPECT_EQ(on1.count("split/transformer"), 0u);

  const int64_t runs0 = Placement("sim:0").runs_begun(), runs1 = Placement("sim:1").runs_begun();
  v1::GenerateResponse split;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 7), &split).ok());
  EXPECT_EQ(split.stats().device(), "sim:0");
  ASSERT_EQ(split.stats().devices_size(), 2);
  EXPECT_EQ(split.stats().devices(0).device(), "sim:0");
  EXPECT_EQ(split.stats().devices(1).device(), "sim:1");
  // Exact per-device peaks: the text encoder's bytes on sim:1, the transformer's and VAE's on sim:0.
  auto usage = UsageByDevice(split);
  EXPECT_EQ(usage["sim:1"]->peak_device_memory_bytes(), w.at("text_encoder"));
  EXPECT_EQ(usage["sim:1"]->host_to_device_bytes(), w.at("text_encoder"));
  EXPECT_EQ(usage["sim:0"]->peak_device_memory_bytes(), w.at("transformer") + w.at("vae"));
  EXPECT_EQ(split.stats().peak_device_memory_bytes(), w.at("transformer") + w.at("vae"));  // The home's.
  on0 = DeviceBytes("sim:0");
  on1 = DeviceBytes("sim:1");
  EXPECT_EQ(on1["split/text_encoder"], w.at("text_encoder"));
  EXPECT_EQ(on0["split/transformer"], w.at("transformer"));
  EXPECT_EQ(on0["split/vae"], w.at("vae"));

  // Resident now: a second request copies nothing to either device.
  v1::GenerateResponse again;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 7), &again).ok());
  usage = UsageByDevice(again);
  EXPECT_EQ(usage["sim:1"]->host_to_device_bytes(), 0);
  EXPECT_EQ(usage["sim:0"]->host_to_device_bytes(), 0);
  EXPECT_EQ(again.image(), split.image());
  // Each device counted each request once: the home its own runs, the peer the runs of its text
  // encoder for them (one request however many calls it made there).
  EXPECT_EQ(Placement("sim:0").runs_begun(), runs0 + 2);
  EXPECT_EQ(Placement("sim:1").runs_begun(), runs1 + 2);

  // The same weights unsplit draw the same image; so does the pipeline split the other way.
  v1::GenerateResponse whole, reverse;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("whole", 7), &whole).ok());
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("rsplit", 7), &reverse).ok());
  EXPECT_EQ(whole.stats().devices_size(), 1);
  EXPECT_EQ(split.image(), whole.image());
  EXPECT_EQ(reverse.image(), whole.image());
  EXPECT_EQ(reverse.stats().device(), "sim:1");
  usage = UsageByDevice(reverse);
  const std::map<std::string, int64_t> rw = Weights("rsplit");
  EXPECT_EQ(usage["sim:1"]->host_to_device_bytes(), rw.at("transformer"));
  EXPECT_EQ(usage["sim:0"]->host_to_device_bytes(), rw.at("text_encoder") + rw.at("vae"));

  // Metrics show each component on the device that holds it.
  const std::string page = HttpGet(server_->server().metrics_address(), "/metrics");
  EXPECT_NE(page.find("stowage_component_state{component=\"split/text_encoder\",state=\"resident\",device=\"sim:1\"} 1"),
            std::string::npos);
  EXPECT_NE(page.find("stowage_component_state{component=\"split/transformer\",state=\"resident\",device=\"sim:0\"} 1"),
            std::string::npos);
  EXPECT_EQ(page.find("component=\"split/text_encoder\",state=\"resident\",device=\"sim:0\""), std::string::npos);

  // The placement log of the peer names the request that placed the component.
  v1::GetPlacementLogRequest log_request;
  log_request.set_device("sim:1");
  v1::GetPlacementLogResponse log;
  ASSERT_TRUE(server_->admin().GetPlacementLog(E2eServer::Authed().get(), log_request, &log).ok());
  bool found = false;
  for (const auto& d : log.decisions()) {
    found = found || (d.component() == "split/text_encoder" && d.action() == "onload" &&
                      d.request_id() == split.request_id());
  }
  EXPECT_TRUE(found) << log.DebugString();
}

// Two pipelines split in opposite directions, requested at once from many threads: each worker
// waits on the other while serving the other's calls, so nothing deadlocks, and every image is
// the one the request gets alone.
TEST_F(SplitPipelineTest, OppositeSplitsAtOnceDoNotDeadlockAndDrawTheSameImages) {
  ASSERT_NO_FATAL_FAILURE(Start(kPipelines));
  v1::GenerateResponse reference;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("whole", 3), &reference).ok());
  constexpr int kPerPipeline = 6;
  std::vector<std::thread> threads;
  std::atomic<int> failures{0}, mismatches{0};
  for (int i = 0; i < 2 * kPerPipeline; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest request = E2eServer::SmallRequest(i % 2 == 0 ? "split" : "rsplit", 3);
      request.set_num_inference_steps(2 + i % 3);
      v1::GenerateResponse response;
      const grpc::Status status = server_->Generate(request, &response, milliseconds(180000));
      if (!status.ok()) {
        ++failures;
        ADD_FAILURE() << status.error_code() << " " << status.error_message();
      } else if (request.num_inference_steps() == 2 && response.image() != reference.image()) {
        ++mismatches;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(mismatches.load(), 0);
}

TEST_F(SplitPipelineTest, AdminMoveComponentMovesItsBytesBetweenDevices) {
  ASSERT_NO_FATAL_FAILURE(Start(kPipelines));
  const std::map<std::string, int64_t> w = Weights("split");
  v1::GenerateResponse before;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 5), &before).ok());
  EXPECT_EQ(DeviceBytes("sim:0")["split/vae"], w.at("vae"));

  v1::MoveComponentResponse moved;
  grpc::Status status = Move("split", "vae", "sim:1", &moved);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (const auto& c : moved.pipeline().components()) {
    if (c.name() == "vae") EXPECT_EQ(c.device(), "sim:1");
    if (c.name() == "transformer") EXPECT_EQ(c.device(), "sim:0");
  }
  // Gone from sim:0 at once (its bytes with it); registered on sim:1, onloaded at its next run.
  EXPECT_EQ(DeviceBytes("sim:0").count("split/vae"), 0u);
  EXPECT_EQ(Placement("sim:0").allocated_bytes(), DeviceBytes("sim:0")["split/transformer"]);
  EXPECT_EQ(DeviceBytes("sim:1")["split/vae"], 0);

  v1::GenerateResponse after;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 5), &after).ok());
  EXPECT_EQ(after.image(), before.image());
  EXPECT_EQ(DeviceBytes("sim:1")["split/vae"], w.at("vae"));
  auto usage = UsageByDevice(after);
  EXPECT_EQ(usage["sim:1"]->host_to_device_bytes(), w.at("vae"));
  EXPECT_EQ(usage["sim:1"]->peak_device_memory_bytes(), w.at("text_encoder") + w.at("vae"));
  EXPECT_EQ(usage["sim:0"]->host_to_device_bytes(), 0);
  EXPECT_EQ(usage["sim:0"]->peak_device_memory_bytes(), w.at("transformer"));

  // And home again; a component of an unsplit pipeline moves the same way.
  ASSERT_TRUE(Move("split", "vae", "sim:0").ok());
  ASSERT_TRUE(Move("whole", "text_encoder", "sim:1").ok());
  v1::GenerateResponse back, whole;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 5), &back).ok());
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("whole", 5), &whole).ok());
  EXPECT_EQ(back.image(), before.image());
  EXPECT_EQ(whole.image(), before.image());
  EXPECT_EQ(back.stats().devices_size(), 2);
  EXPECT_EQ(whole.stats().devices_size(), 2);
  EXPECT_EQ(DeviceBytes("sim:1")["whole/text_encoder"], w.at("text_encoder"));
}

// Draining reports the components that run on the device for pipelines homed elsewhere: draining
// stops requests homed there, not those guests (they move with MoveComponent).
TEST_F(SplitPipelineTest, DrainListsTheGuestComponentsThatKeepRunningThere) {
  Start(kPipelines);
  v1::DrainDeviceRequest drain;
  drain.set_device("sim:1");
  drain.set_drain(true);
  v1::DrainDeviceResponse drained;
  ASSERT_TRUE(server_->admin().DrainDevice(E2eServer::Authed().get(), drain, &drained).ok());
  std::map<std::string, std::vector<std::string>> guests;
  for (const auto& d : drained.devices()) guests[d.device()] = {d.guest_components().begin(), d.guest_components().end()};
  EXPECT_EQ(guests["sim:1"], (std::vector<std::string>{"split/text_encoder"}));
  EXPECT_EQ(guests["sim:0"], (std::vector<std::string>{"rsplit/text_encoder", "rsplit/vae"}));
  // The split pipeline homed on sim:0 still runs, its text encoder on the drained sim:1.
  v1::GenerateResponse response;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 1), &response).ok());
  ASSERT_EQ(response.stats().devices_size(), 2);
  EXPECT_EQ(response.stats().devices(1).device(), "sim:1");
  // Once moved home, sim:1 has no guests left.
  ASSERT_TRUE(Move("split", "text_encoder", "sim:0").ok());
  drain.set_drain(false);
  ASSERT_TRUE(server_->admin().DrainDevice(E2eServer::Authed().get(), drain, &drained).ok());
  for (const auto& d : drained.devices()) {
    if (d.device() == "sim:1") EXPECT_EQ(d.guest_components_size(), 0) << d.DebugString();
  }
}

TEST_F(SplitPipelineTest, HostileMovesGetClearStatuses) {
  ASSERT_NO_FATAL_FAILURE(Start(std::string(kPipelines) +
                                R"pb(pipelines { name: "replicated" builtin: "tiny" devices: "sim:0" devices: "sim:1" })pb"));
  auto expect = [&](const grpc::Status& status, grpc::StatusCode code, const std::string& text) {
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), text)) << status.error_message();
  };
  expect(Move("", "vae", "sim:1"), grpc::INVALID_ARGUMENT, "pipeline is required");
  expect(Move("split", "", "sim:1"), grpc::INVALID_ARGUMENT, "component is required");
  expect(Move("split", "vae", ""), grpc::INVALID_ARGUMENT, "device is required");
  expect(Move("nope", "vae", "sim:1"), grpc::NOT_FOUND, "no pipeline named 'nope'");
  expect(Move("split", "unet", "sim:1"), grpc::NOT_FOUND,
         "pipeline 'split' has no component 'unet'; its components: text_encoder, vae_encoder, transformer, vae");
  expect(Move("split", "vae", "sim:7"), grpc::NOT_FOUND, "device 'sim:7' is not one of this server's: sim:0, sim:1");
  expect(Move("split", "vae", "sim:0"), grpc::FAILED_PRECONDITION, "is already on sim:0");
  expect(Move("split", "text_encoder", "sim:1"), grpc::FAILED_PRECONDITION, "is already on sim:1");
  expect(Move("replicated", "vae", "sim:1"), grpc::FAILED_PRECONDITION, "has replicas on sim:0, sim:1");
  // Without the token: refused before anything else.
  v1::MoveComponentRequest request;
  request.set_pipeline("split");
  request.set_component("vae");
  request.set_device("sim:1");
  grpc::ClientContext anonymous;
  v1::MoveComponentResponse ignored;
  expect(server_->admin().MoveComponent(&anonymous, request, &ignored), grpc::UNAUTHENTICATED, "");

  // Moving during an unload: a long request holds the unload open; the move is refused.
  std::thread running([&] {
    v1::GenerateRequest slow = E2eServer::SmallRequest("whole", 1);
    slow.set_width(512);
    slow.set_height(512);
    slow.set_num_inference_steps(60);
    (void)server_->Generate(slow, nullptr, milliseconds(300000));
  });
  EXPECT_TRUE(AwaitState([&] { return RunningRequests(server_->server().devices()) == 1; }));
  grpc::Status unloaded;
  std::thread unloading([&] {
    v1::UnloadPipelineRequest unload;
    unload.set_name("whole");
    v1::UnloadPipelineResponse out;
    unloaded = server_->admin().UnloadPipeline(E2eServer::Authed(milliseconds(300000)).get(), unload, &out);
  });
  bool saw_unloading = false;
  for (int i = 0; i < 200 && !saw_unloading; ++i) {
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(server_->Pipelines(&list).ok());
    for (const auto& p : list.pipelines()) saw_unloading = saw_unloading || (p.name() == "whole" && p.state() == v1::PIPELINE_UNLOADING);
    if (!saw_unloading) absl::SleepFor(absl::Milliseconds(10));
  }
  if (saw_unloading) {
    expect(Move("whole", "vae", "sim:1"), grpc::FAILED_PRECONDITION, "a component moves only while its pipeline is READY");
  } else {
    ADD_FAILURE() << "the unload finished before the test saw it (the request was too fast)";
  }
  running.join();
  unloading.join();
  EXPECT_TRUE(unloaded.ok()) << unloaded.error_message();
  // Every pipeline left still serves.
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 2)).ok());
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("rsplit", 2)).ok());
}

TEST_F(SplitPipelineTest, UnloadingASplitPipelineEmptiesBothDevicesAndItLoadsAgainOverAdmin) {
  ASSERT_NO_FATAL_FAILURE(Start(kPipelines));
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 2)).ok());
  v1::UnloadPipelineRequest unload;
  unload.set_name("split");
  v1::UnloadPipelineResponse unloaded;
  ASSERT_TRUE(server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded).ok());
  for (const std::string device : {"sim:0", "sim:1"}) {
    for (const auto& entry : DeviceBytes(device)) EXPECT_FALSE(absl::StartsWith(entry.first, "split/")) << entry.first;
  }
  v1::LoadPipelineRequest load;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(pipeline {
             name: "split"
             builtin: "zimage-tiny"
             component_devices { component: "transformer" device: "sim:1" }
           })pb",
      &load));
  v1::LoadPipelineResponse loaded;
  grpc::Status status = server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded);
  ASSERT_TRUE(status.ok()) << status.error_message();
  for (const auto& c : loaded.pipeline().components()) EXPECT_EQ(c.device(), c.name() == "transformer" ? "sim:1" : "sim:0");
  v1::GenerateResponse response;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("split", 2), &response).ok());
  EXPECT_EQ(response.stats().device(), "sim:0");
  EXPECT_EQ(DeviceBytes("sim:1")["split/transformer"], Weights("split").at("transformer"));

  // Hostile loads over admin: each refused with the field named; nothing remains.
  auto refused = [&](const std::string& text, grpc::StatusCode code, const std::string& message) {
    v1::LoadPipelineRequest bad;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(text, &bad)) << text;
    v1::LoadPipelineResponse out;
    const grpc::Status s = server_->admin().LoadPipeline(E2eServer::Authed().get(), bad, &out);
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_TRUE(absl::StrContains(s.error_message(), message)) << s.error_message();
  };
  refused(R"pb(pipeline { name: "x" builtin: "zimage-tiny" component_devices { component: "vae" device: "sim:9" } })pb",
          grpc::INVALID_ARGUMENT,
          "pipeline.component_devices[0].device: 'sim:9' is not a device of this server; devices: sim:0, sim:1");
  refused(R"pb(pipeline { name: "x" builtin: "zimage-tiny" component_devices { component: "vae" device: "sim:0" } })pb",
          grpc::INVALID_ARGUMENT, "pipeline.component_devices[0].device: sim:0 is the pipeline's home device");
  refused(R"pb(pipeline { name: "x" builtin: "zimage-tiny" component_devices { component: "unet" device: "sim:1" } })pb",
          grpc::INVALID_ARGUMENT,
          "pipeline.component_devices: 'unet' is not a component of pipeline 'x'; its components: text_encoder, "
          "vae_encoder, transformer, vae");
  refused(R"pb(pipeline {
                 name: "x"
                 builtin: "zimage-tiny"
                 devices: "sim:0"
                 devices: "sim:1"
                 component_devices { component: "vae" device: "sim:1" }
               })pb",
          grpc::INVALID_ARGUMENT, "a split pipeline has one home device");
  refused(R"pb(pipeline {
                 name: "x"
                 builtin: "zimage-tiny"
                 component_devices { component: "vae" device: "sim:1" }
                 component_devices { component: "vae" device: "sim:1" }
               })pb",
          grpc::INVALID_ARGUMENT, "pipeline.component_devices[1].component: 'vae' is listed twice");
  refused(R"pb(pipeline { name: "split" builtin: "zimage-tiny" component_devices { component: "vae" device: "sim:1" } })pb",
          grpc::ALREADY_EXISTS, "pipeline 'split' is already on sim:0");
  for (const std::string device : {"sim:0", "sim:1"}) {
    for (const auto& entry : DeviceBytes(device)) EXPECT_FALSE(absl::StartsWith(entry.first, "x/")) << entry.first;
  }
}

// Peer eviction (DeviceConfig.peer_bandwidth_bytes_per_second): sim:0's budget holds the
// transformer and the VAE, not the text encoder too, so the transformer's first run evicts the text
// encoder. With a fast peer link and a slow host link it moves to sim:1 (device to device) and runs
// there from then on; with the links the other way round it goes to the host. Both costs are in the
// decision log either way.
std::map<std::string, int64_t> ZImageTinyWeights() {
  E2eServer probe(Config(R"pb(pipelines { name: "p" builtin: "zimage-tiny" })pb"));
  v1::ListPipelinesResponse list;
  EXPECT_TRUE(probe.Pipelines(&list).ok());
  std::map<std::string, int64_t> out;
  for (const auto& c : list.pipelines(0).components()) out[c.name()] = c.weight_bytes();
  return out;
}

v1::ServerConfig PeerConfig(int64_t peer_bandwidth, int64_t host_bandwidth) {
  const std::map<std::string, int64_t> w = ZImageTinyWeights();
  v1::ServerConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(
      absl::StrCat(R"pb(
    devices { kind: KIND_SIMULATED index: 0 memory_budget_bytes: )pb", w.at("transformer") + w.at("vae"),
                   R"pb( peer_bandwidth_bytes_per_second: )pb", peer_bandwidth,
                   R"pb( host_to_device_bandwidth_bytes_per_second: )pb", host_bandwidth, R"pb( }
    devices { kind: KIND_SIMULATED index: 1 }
    pipelines { name: "p" builtin: "zimage-tiny" devices: "sim:0" }
    pipelines { name: "q" builtin: "zimage-tiny" devices: "sim:1" weight_seed: 9 }
  )pb"),
      &config));
  return config;
}

std::vector<v1::PlacementDecision> Log(E2eServer& server, const std::string& device) {
  v1::GetPlacementLogRequest request;
  request.set_device(device);
  request.set_limit(4096);
  v1::GetPlacementLogResponse response;
  EXPECT_TRUE(server.admin().GetPlacementLog(E2eServer::Authed().get(), request, &response).ok());
  return {response.decisions().begin(), response.decisions().end()};
}

TEST_F(SplitPipelineTest, PeerEvictionMovesToThePeerWhenThatIsCheaperWithBothCostsLogged) {
  server_ = std::make_unique<E2eServer>(PeerConfig(/*peer=*/100000000000, /*host=*/1000000000));
  ASSERT_TRUE(server_->ok());
  const std::map<std::string, int64_t> w = Weights("p");
  v1::GenerateResponse first;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("p", 4), &first).ok());
  // Evicted for the transformer: moved to sim:1, resident there, gone from sim:0.
  EXPECT_EQ(DeviceBytes("sim:0").count("p/text_encoder"), 0u);
  EXPECT_EQ(DeviceBytes("sim:1")["p/text_encoder"], w.at("text_encoder"));
  EXPECT_EQ(Placement("sim:0").allocated_bytes(), w.at("transformer") + w.at("vae"));
  std::optional<v1::PlacementDecision> moved;
  for (const auto& d : Log(*server_, "sim:0")) {
    if (d.component() == "p/text_encoder" && d.action() == "offload_to_peer") moved = d;
  }
  ASSERT_TRUE(moved.has_value());
  EXPECT_EQ(moved->to_device(), "sim:1");
  EXPECT_EQ(moved->bytes(), w.at("text_encoder"));
  EXPECT_DOUBLE_EQ(moved->d2d_seconds(), static_cast<double>(w.at("text_encoder")) / 1e11);
  EXPECT_DOUBLE_EQ(moved->h2d_seconds(), static_cast<double>(w.at("text_encoder")) / 1e9);
  EXPECT_EQ(moved->request_id(), first.request_id());
  bool adopted = false;
  for (const auto& d : Log(*server_, "sim:1")) adopted = adopted || (d.component() == "p/text_encoder" && d.action() == "onload_from_peer");
  EXPECT_TRUE(adopted);
  std::map<std::string, std::string> where;
  Weights("p", &where);
  EXPECT_EQ(where["text_encoder"], "sim:1");

  // The next request runs it on sim:1 (no host copy needed: it is resident there) and draws the
  // same image.
  v1::GenerateResponse second;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("p", 4), &second).ok());
  EXPECT_EQ(second.image(), first.image());
  auto usage = UsageByDevice(second);
  ASSERT_EQ(usage.count("sim:1"), 1u);
  EXPECT_EQ(usage["sim:1"]->host_to_device_bytes(), 0);
  EXPECT_EQ(usage["sim:1"]->peak_device_memory_bytes(), DeviceBytes("sim:1")["q/transformer"] + w.at("text_encoder") +
                                                            DeviceBytes("sim:1")["q/vae"]);
  // It stays the pipeline's: unloading removes it from sim:1 too.
  v1::UnloadPipelineRequest unload;
  unload.set_name("p");
  v1::UnloadPipelineResponse out;
  ASSERT_TRUE(server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &out).ok());
  EXPECT_EQ(DeviceBytes("sim:1").count("p/text_encoder"), 0u);
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("q", 4)).ok());
}

TEST_F(SplitPipelineTest, PeerEvictionChoosesTheHostWhenThatIsCheaperWithBothCostsLogged) {
  server_ = std::make_unique<E2eServer>(PeerConfig(/*peer=*/1000000000, /*host=*/100000000000));
  ASSERT_TRUE(server_->ok());
  const std::map<std::string, int64_t> w = Weights("p");
  v1::GenerateResponse first, second;
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("p", 4), &first).ok());
  EXPECT_EQ(DeviceBytes("sim:0")["p/text_encoder"], 0);  // Offloaded to the host, still registered here.
  EXPECT_EQ(Placement("sim:0").allocated_bytes(), w.at("transformer") + w.at("vae"));
  EXPECT_EQ(DeviceBytes("sim:1").count("p/text_encoder"), 0u);
  const std::vector<v1::PlacementDecision> log = Log(*server_, "sim:0");
  int declined = -1, offloaded = -1;
  for (int i = 0; i < static_cast<int>(log.size()); ++i) {
    if (log[i].component() != "p/text_encoder") continue;
    if (log[i].action() == "peer_declined" && declined < 0) declined = i;
    if (log[i].action() == "offload" && offloaded < 0) offloaded = i;
  }
  ASSERT_GE(declined, 0);
  ASSERT_GT(offloaded, declined);
  EXPECT_EQ(log[declined].to_device(), "");
  EXPECT_DOUBLE_EQ(log[declined].d2d_seconds(), static_cast<double>(w.at("text_encoder")) / 1e9);
  EXPECT_DOUBLE_EQ(log[declined].h2d_seconds(), static_cast<double>(w.at("text_encoder")) / 1e11);
  EXPECT_TRUE(absl::StrContains(log[declined].reason(), "the host is cheaper than sim:1")) << log[declined].reason();
  ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("p", 4), &second).ok());
  EXPECT_EQ(second.image(), first.image());
  EXPECT_EQ(second.stats().devices_size(), 1);
}

TEST(SplitPipelineConfigTest, BadSplitConfigsFailAtStartNamingTheField) {
  auto start_error = [](const std::string& pipelines) {
    v1::ServerConfig config = Config(pipelines);
    config.set_grpc_address("127.0.0.1:0");
    config.set_metrics_address("none");
    absl::StatusOr<std::unique_ptr<StowageServer>> server = StowageServer::Start(config);
    return server.ok() ? absl::OkStatus() : server.status();
  };
  absl::Status s = start_error(
      R"pb(pipelines { name: "p" builtin: "tiny" component_devices { component: "vae" device: "sim:4" } })pb");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "pipelines[0].component_devices[0].device: 'sim:4' is not a device of "
                                             "this server; devices: sim:0, sim:1"))
      << s;
  s = start_error(R"pb(pipelines { name: "p" builtin: "tiny" component_devices { component: "decoder" device: "sim:1" } })pb");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "'decoder' is not a component of pipeline 'p'; its components: "
                                             "text_encoder, transformer, vae"))
      << s;
  s = start_error(R"pb(pipelines { name: "p" builtin: "tiny" component_devices { component: "" device: "sim:1" } })pb");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "pipelines[0].component_devices[0].component: required")) << s;
}

// Shutting down while split requests wait on a busy peer: every request returns (served, or
// refused with UNAVAILABLE or CANCELLED) and the server stops; nothing hangs.
TEST(SplitPipelineShutdownTest, StoppingTheServerWhileRemoteCallsWaitAnswersEveryRequest) {
  auto server = std::make_unique<E2eServer>(Config(std::string(kPipelines) +
                                                   R"pb(pipelines { name: "busy" builtin: "zimage-tiny" devices: "sim:1" })pb"));
  ASSERT_TRUE(server->ok());
  std::vector<std::thread> threads;
  std::atomic<int> answered{0}, unexpected{0};
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest request = E2eServer::SmallRequest(i % 2 == 0 ? "busy" : "split", static_cast<uint64_t>(i));
      if (i % 2 == 0) {
        request.set_width(256);
        request.set_height(256);
        request.set_num_inference_steps(20);
      }
      const grpc::Status status = server->Generate(request, nullptr, milliseconds(120000));
      ++answered;
      if (!status.ok() && status.error_code() != grpc::UNAVAILABLE && status.error_code() != grpc::CANCELLED) {
        ++unexpected;
        ADD_FAILURE() << status.error_code() << " " << status.error_message();
      }
    });
  }
  // Shutdown while requests run.
  EXPECT_TRUE(AwaitState([&] { return RunningRequests(server->server().devices()) >= 1; }));
  const absl::Time start = absl::Now();
  server->server().Shutdown();
  for (std::thread& t : threads) t.join();
  server.reset();  // Releases both devices (the split pipelines' peers last) and stops the workers.
  EXPECT_LT(absl::Now() - start, absl::Seconds(90));
  EXPECT_EQ(answered.load(), 8);
  EXPECT_EQ(unexpected.load(), 0);
}

}  // namespace
}  // namespace stowage
