// Two real architectures on one device budget: Z-Image and Flux.1 (their tiny built-ins) on a
// simulated device whose budget holds either pipeline but not both. Requests alternate between them
// and also arrive concurrently for both; every request succeeds with the image it gets on an
// unbudgeted device (placement moves weights, never changes results), the device peak of every
// request stays within the budget, and the placement log says why each move happened.
#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"

namespace stowage {
namespace {

v1::ServerConfig TwoPipelines(int64_t budget) {
  v1::ServerConfig config;
  EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(
      R"pb(
        device { kind: KIND_SIMULATED }
        pipelines { name: "z" builtin: "zimage-tiny" }
        pipelines { name: "f" builtin: "flux-tiny" }
      )pb",
      &config));
  config.mutable_device()->set_memory_budget_bytes(budget);
  return config;
}

v1::GenerateRequest Request(const std::string& pipeline, uint64_t seed) {
  v1::GenerateRequest request = E2eServer::SmallRequest(pipeline, seed);
  request.set_num_inference_steps(2);
  return request;
}

TEST(TwoPipelinesTest, AlternatingAndConcurrentRequestsShareOneBudgetWithUnchangedImages) {
  // Unbudgeted: the pipelines' weights and the images every request must get.
  std::map<std::string, int64_t> weights;
  std::map<std::pair<std::string, uint64_t>, std::string> reference;
  {
    E2eServer unbudgeted(TwoPipelines(0));
    ASSERT_TRUE(unbudgeted.ok());
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(unbudgeted.Pipelines(&list).ok());
    // What a text-to-image request runs: every component but the VAE's encoder (images in only).
    for (const auto& p : list.pipelines()) {
      for (const auto& c : p.components()) {
        if (c.name() != "vae_encoder") weights[p.name()] += c.weight_bytes();
      }
    }
    for (const std::string pipeline : {"z", "f"}) {
      for (uint64_t seed : {1, 2}) {
        v1::GenerateResponse response;
        ASSERT_TRUE(unbudgeted.Generate(Request(pipeline, seed), &response).ok());
        reference[{pipeline, seed}] = response.image();
      }
    }
  }
  ASSERT_EQ(weights.size(), 2u);
  const int64_t larger = std::max(weights["z"], weights["f"]);
  const int64_t smaller = std::min(weights["z"], weights["f"]);
  // Either pipeline fits with room for its activations; both together do not.
  const int64_t budget = larger + smaller / 2;
  ASSERT_LT(budget, weights["z"] + weights["f"]);

  E2eServer server(TwoPipelines(budget));
  ASSERT_TRUE(server.ok());
  auto check = [&](const std::string& pipeline, uint64_t seed) {
    v1::GenerateResponse response;
    const grpc::Status status = server.Generate(Request(pipeline, seed), &response);
    EXPECT_TRUE(status.ok()) << pipeline << ": " << status.error_message();
    EXPECT_EQ(response.image(), reference.at(std::make_pair(pipeline, seed))) << pipeline << " seed " << seed;
    EXPECT_GT(response.stats().peak_device_memory_bytes(), 0);
    EXPECT_LE(response.stats().peak_device_memory_bytes(), budget) << pipeline;
  };
  // Alternating: each request needs what the other pipeline holds.
  for (int round = 0; round < 3; ++round) {
    check("z", 1 + round % 2);
    check("f", 1 + round % 2);
  }
  // Concurrent: both pipelines at once, from two clients.
  std::thread zs([&] {
    for (uint64_t seed : {1, 2, 1}) check("z", seed);
  });
  std::thread fs([&] {
    for (uint64_t seed : {2, 1, 2}) check("f", seed);
  });
  zs.join();
  fs.join();

  // The log says why: components of both pipelines were moved out to make room, each with its
  // strategy and reason, and the device never went over its budget.
  v1::GetPlacementLogRequest request;
  request.set_limit(1000);
  v1::GetPlacementLogResponse log;
  ASSERT_TRUE(server.admin().GetPlacementLog(E2eServer::Authed().get(), request, &log).ok());
  std::map<std::string, int> offloads;
  std::set<std::string> pinned;
  for (const auto& d : log.decisions()) {
    EXPECT_FALSE(d.reason().empty()) << d.component() << " " << d.action();
    EXPECT_FALSE(d.strategy().empty()) << d.component();
    EXPECT_GE(d.free_after(), 0) << d.component() << " " << d.action();
    if (d.action() == "offload") ++offloads[d.component().substr(0, d.component().find('/'))];
    if (d.action() == "pin_host") pinned.insert(d.component());
    EXPECT_NE(d.action(), "pin_failed") << d.reason();
  }
  EXPECT_GT(offloads["z"], 0) << log.DebugString();
  EXPECT_GT(offloads["f"], 0) << log.DebugString();
  // With a budget the host copies are pinned in place by default (moves at the link's speed): every
  // component of both pipelines (3 + 4, and each one's VAE encoder).
  EXPECT_EQ(pinned.size(), 9u) << log.DebugString();
  EXPECT_TRUE(HealthServing(server.channel()));
}

// device.pin_host_copies: on by default with a budget, off without one; set, it wins either way.
TEST(TwoPipelinesTest, PinnedHostCopiesFollowTheConfig) {
  struct Case {
    int64_t budget;
    int pin;  // -1: unset.
    size_t pinned;
  };
  for (const Case& c : {Case{0, -1, 0}, Case{1 << 30, -1, 9}, Case{1 << 30, 0, 0}, Case{0, 1, 9}}) {
    v1::ServerConfig config = TwoPipelines(c.budget);
    if (c.pin >= 0) config.mutable_device()->set_pin_host_copies(c.pin == 1);
    E2eServer server(config);
    ASSERT_TRUE(server.ok());
    v1::GetPlacementLogRequest request;
    request.set_limit(1000);
    v1::GetPlacementLogResponse log;
    ASSERT_TRUE(server.admin().GetPlacementLog(E2eServer::Authed().get(), request, &log).ok());
    std::set<std::string> pinned;
    for (const auto& d : log.decisions()) {
      if (d.action() == "pin_host") pinned.insert(d.component());
      EXPECT_NE(d.action(), "pin_failed") << d.reason();
    }
    EXPECT_EQ(pinned.size(), c.pinned) << "budget " << c.budget << ", pin_host_copies " << c.pin;
    EXPECT_TRUE(HealthServing(server.channel()));
  }
}

// Exact peaks on the simulated device: with a workflow rule set that sends every component off the
// device right after it ran, each request of either pipeline peaks at exactly its largest
// component's bytes, however the requests of the two pipelines interleave, and the images are those
// of the unbudgeted server.
TEST(TwoPipelinesTest, AWorkflowRuleSetGivesExactPeaksPerPipeline) {
  std::map<std::string, int64_t> largest;
  std::map<std::pair<std::string, uint64_t>, std::string> reference;
  int64_t budget = 0;
  {
    E2eServer unbudgeted(TwoPipelines(0));
    ASSERT_TRUE(unbudgeted.ok());
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(unbudgeted.Pipelines(&list).ok());
    for (const auto& p : list.pipelines()) {
      for (const auto& c : p.components()) largest[p.name()] = std::max(largest[p.name()], c.weight_bytes());
    }
    for (const std::string pipeline : {"z", "f"}) {
      v1::GenerateResponse response;
      ASSERT_TRUE(unbudgeted.Generate(Request(pipeline, 1), &response).ok());
      reference[{pipeline, 1}] = response.image();
    }
  }
  ASSERT_EQ(largest.size(), 2u);
  budget = std::max(largest["z"], largest["f"]);  // Room for one component at a time, no more.
  v1::ServerConfig config = TwoPipelines(budget);
  ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(
      R"pb(
        strategy {
          workflow {
            rules { after { component: "text_encoder" offload: "text_encoder" } }
            rules { after { component: "text_encoder_2" offload: "text_encoder_2" } }
            rules { after { component: "transformer" offload: "transformer" } }
            rules { after { component: "vae" offload: "vae" } }
          }
        }
      )pb",
      &config));
  E2eServer server(config);
  ASSERT_TRUE(server.ok());
  for (const std::string pipeline : {"z", "f", "f", "z", "z", "f"}) {
    v1::GenerateResponse response;
    const grpc::Status status = server.Generate(Request(pipeline, 1), &response);
    ASSERT_TRUE(status.ok()) << pipeline << ": " << status.error_message();
    EXPECT_EQ(response.image(), reference.at(std::make_pair(pipeline, uint64_t{1}))) << pipeline;
    EXPECT_EQ(response.stats().peak_device_memory_bytes(), largest[pipeline]) << pipeline;
  }
  // Nothing stays on the device between requests.
  v1::GetPlacementResponse placement;
  ASSERT_TRUE(server.admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
  EXPECT_EQ(placement.allocated_bytes(), 0) << placement.DebugString();
}

// Group offloading every component of both pipelines with the default options (block level: the
// block lists nearest each root — Flux's T5 encoder.block and CLIP text_model.encoder.layers
// included) loads and gives the unbudgeted images.
TEST(TwoPipelinesTest, EveryComponentGroupOffloadedWithDefaultsGivesTheSameImages) {
  std::map<std::string, std::string> reference;
  {
    E2eServer plain(TwoPipelines(0));
    ASSERT_TRUE(plain.ok());
    for (const std::string pipeline : {"z", "f"}) {
      v1::GenerateResponse response;
      ASSERT_TRUE(plain.Generate(Request(pipeline, 1), &response).ok());
      reference[pipeline] = response.image();
    }
  }
  v1::ServerConfig config = TwoPipelines(0);
  for (auto& p : *config.mutable_pipelines()) {
    p.mutable_group_offload()->set_enabled(true);
    p.mutable_group_offload()->mutable_defaults()->set_use_stream(true);
  }
  E2eServer server(config);
  ASSERT_TRUE(server.ok());
  for (const std::string pipeline : {"z", "f", "z", "f"}) {
    v1::GenerateResponse response;
    const grpc::Status status = server.Generate(Request(pipeline, 1), &response);
    ASSERT_TRUE(status.ok()) << pipeline << ": " << status.error_message();
    EXPECT_EQ(response.image(), reference[pipeline]) << pipeline;
  }
  v1::GetPlacementResponse placement;
  ASSERT_TRUE(server.admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
  for (const auto& c : placement.components()) {
    EXPECT_NE(c.state(), v1::ComponentPlacement::OFFLOADED) << c.id();
    EXPECT_NE(c.state(), v1::ComponentPlacement::RESIDENT) << c.id();
  }
}

// The spare-room cache through the real server: both pipelines' transformers streamed under one
// budget with DeviceConfig.streamed_group_cache on; every image is the one an unbudgeted server draws,
// every request's peak stays within the budget, the requests copy fewer bytes in all than the same
// requests with the cache off (the cache only takes room nothing else holds: here the first Z-Image
// request's later steps), and GetPlacement reports the onloads it served.
TEST(TwoPipelinesTest, TheSpareRoomCacheCopiesLessWithinTheBudgetAndKeepsTheImages) {
  const auto request = [](const std::string& pipeline) {
    v1::GenerateRequest r = Request(pipeline, 1);
    r.set_num_inference_steps(4);
    return r;
  };
  std::map<std::string, std::string> reference;
  std::map<std::string, std::vector<std::string>> others;  // Pipeline → its components but the transformer.
  std::map<std::string, int64_t> weights;
  {
    E2eServer plain(TwoPipelines(0));
    ASSERT_TRUE(plain.ok());
    v1::ListPipelinesResponse list;
    ASSERT_TRUE(plain.Pipelines(&list).ok());
    for (const auto& p : list.pipelines()) {
      for (const auto& c : p.components()) {
        if (c.name() != "transformer") others[p.name()].push_back(c.name());
        weights[p.name()] += c.weight_bytes();
      }
    }
    for (const std::string pipeline : {"z", "f"}) {
      v1::GenerateResponse response;
      ASSERT_TRUE(plain.Generate(request(pipeline), &response).ok());
      reference[pipeline] = response.image();
    }
  }
  // Either pipeline's weights with room to spare, not both.
  const int64_t budget = std::max(weights["z"], weights["f"]) + std::min(weights["z"], weights["f"]) / 2;
  std::map<bool, int64_t> copied;  // Cache on or off → host-to-device bytes of all its requests.
  for (const bool cache : {false, true}) {
    SCOPED_TRACE(cache ? "cache on" : "cache off");
    v1::ServerConfig config = TwoPipelines(budget);
    for (auto& p : *config.mutable_pipelines()) {  // The transformers streamed, the rest placed whole.
      p.mutable_group_offload()->set_enabled(true);
      p.mutable_group_offload()->mutable_defaults()->set_use_stream(true);
      for (const std::string& name : others[p.name()]) p.mutable_group_offload()->add_exclude(name);
    }
    config.mutable_device()->mutable_streamed_group_cache()->set_enabled(cache);
    config.mutable_device()->mutable_streamed_group_cache()->set_margin_bytes(1 << 20);
    config.set_metrics_address("127.0.0.1:0");
    E2eServer server(config);
    ASSERT_TRUE(server.ok());
    for (const std::string pipeline : {"z", "f", "z", "f", "z"}) {
      v1::GenerateResponse response;
      const grpc::Status status = server.Generate(request(pipeline), &response);
      ASSERT_TRUE(status.ok()) << pipeline << ": " << status.error_message();
      EXPECT_EQ(response.image(), reference[pipeline]) << pipeline;
      EXPECT_LE(response.stats().peak_device_memory_bytes(), budget) << pipeline;
      copied[cache] += response.stats().host_to_device_bytes();
    }
    v1::GetPlacementResponse placement;
    ASSERT_TRUE(server.admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
    int64_t hits = 0;
    // Prometheus carries the same counts: onloads served by the cache, per component.
    const std::string page = HttpGet(server.server().metrics_address(), "/metrics");
    for (const auto& c : placement.components()) {
      if (!c.has_group_offload()) continue;
      hits += c.group_offload().cache_hits();
      const std::string line = "stowage_group_offload_onloads_total{component=\"" + c.id() + "\",how=\"cached\",device=\"sim:0\"} " +
                               std::to_string(c.group_offload().cache_hits());
      EXPECT_NE(page.find(line), std::string::npos) << line << "\n" << page;
    }
    if (cache) {
      EXPECT_GT(hits, 0);
    } else {
      EXPECT_EQ(hits, 0);
    }
  }
  EXPECT_LT(copied[true], copied[false]);
}

// What Flux refuses comes back as a clear status naming the field, and the server keeps serving both.
TEST(TwoPipelinesTest, FluxRequestsWithANegativePromptAreRefusedSayingWhy) {
  E2eServer server(TwoPipelines(0));
  ASSERT_TRUE(server.ok());
  v1::GenerateRequest request = Request("f", 1);
  request.set_negative_prompt("blur");
  const grpc::Status refused = server.Generate(request);
  EXPECT_EQ(refused.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("negative_prompt"), std::string::npos) << refused.error_message();
  EXPECT_TRUE(server.Generate(Request("f", 1)).ok());
  EXPECT_TRUE(server.Generate(Request("z", 1)).ok());
  EXPECT_TRUE(HealthServing(server.channel()));
}

}  // namespace
}  // namespace stowage
