// Hostile input against a real server over loopback gRPC, in groups: generation fields, protocol
// garbage and oversized messages, queue floods, cancellation and deadlines, admin authentication,
// strategy and offload abuse, and lifecycle races. After every case the server must still answer
// a health check (checked in TearDown) and every refusal must carry a clear status.
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "google/protobuf/text_format.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/runtime/runtime_state.h"

namespace stowage {
namespace {

using std::chrono::milliseconds;

class AdversarialTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::ServerConfig config;
    config.set_queue_depth(4);
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
      pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true }
      pipelines { name: "tiny" builtin: "tiny" })pb", &config));
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
  }
  void TearDown() override {
    if (server_ != nullptr && server_->ok()) {
      EXPECT_TRUE(HealthServing(server_->channel())) << "the server stopped answering health checks";
    }
  }

  // Expects `status` to be `code` with a message that contains `needle` and stays short.
  static void ExpectRefused(const grpc::Status& status, grpc::StatusCode code, const std::string& needle) {
    EXPECT_EQ(status.error_code(), code) << status.error_message();
    EXPECT_NE(status.error_message().find(needle), std::string::npos) << status.error_message();
    EXPECT_LT(status.error_message().size(), 600u) << "messages must not echo unbounded input";
  }

  // Two clients generate the same small request (seed `seed`) again and again while `admin` runs;
  // every run must succeed (or be refused for room) with the image it has when nothing changes, and
  // at least one must run.
  void ExpectSameImagesWhile(int seed, const std::string& what, const std::function<void()>& admin) {
    v1::GenerateResponse reference;
    ASSERT_TRUE(server_->Generate(E2eServer::SmallRequest("", seed), &reference).ok());
    std::atomic<bool> stop{false};
    std::atomic<int> failures{0}, runs{0};
    std::vector<std::thread> clients;
    for (int i = 0; i < 2; ++i) {
      clients.emplace_back([&] {
        while (!stop) {
          v1::GenerateResponse response;
          const grpc::Status s = server_->Generate(E2eServer::SmallRequest("", seed), &response);
          if (!s.ok() && s.error_code() != grpc::RESOURCE_EXHAUSTED) {
            ++failures;
            ADD_FAILURE() << s.error_code() << ": " << s.error_message();
          } else if (s.ok()) {
            ++runs;
            if (response.image() != reference.image()) {
              ++failures;
              ADD_FAILURE() << "image changed under " << what;
            }
          }
        }
      });
    }
    admin();
    stop = true;
    for (auto& t : clients) t.join();
    EXPECT_EQ(failures.load(), 0);
    EXPECT_GT(runs.load(), 0);
  }

  std::unique_ptr<E2eServer> server_;
};

// Lifecycle races need a worker that is predictably busy: a simulated device whose host-to-device
// bandwidth is limited, with the "tiny" pipeline's transformer streamed on every step (2.8 MiB per
// forward at 56 MB/s: about 0.1 s per step), whatever the machine's speed.
class LifecycleTest : public AdversarialTest {
 protected:
  void SetUp() override {
    v1::ServerConfig config;
    config.set_queue_depth(8);
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
      device { kind: KIND_SIMULATED simulated_bandwidth_bytes_per_second: 56000000 }
      pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true }
      pipelines {
        name: "tiny" builtin: "tiny"
        group_offload { enabled: true exclude: "text_encoder" exclude: "vae" defaults { use_stream: true } }
      })pb", &config));
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
  }
  // About a second of streaming on the worker.
  static v1::GenerateRequest Slow() {
    v1::GenerateRequest request = E2eServer::SmallRequest("tiny");
    request.set_num_inference_steps(10);
    return request;
  }
};

// --- Generation fields ------------------------------------------------------------------------

TEST_F(AdversarialTest, GenerationFieldsOutOfRangeAreInvalidArgumentNamingTheField) {
  struct Case {
    std::string name;
    std::function<void(v1::GenerateRequest&)> mutate;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"empty prompt", [](auto& r) { r.set_prompt(""); }, "prompt is required"},
      {"huge prompt", [](auto& r) { r.set_prompt(std::string(100000, 'a')); }, "prompt is 100000 bytes"},
      {"huge negative", [](auto& r) { r.set_negative_prompt(std::string(100000, 'a')); }, "negative_prompt"},
      {"zero-ish width", [](auto& r) { r.set_width(-64); }, "width is -64"},
      {"huge width", [](auto& r) { r.set_width(1 << 30); }, "width is"},
      {"odd height", [](auto& r) { r.set_height(65); }, "height is 65"},
      {"negative steps", [](auto& r) { r.set_num_inference_steps(-1); }, "num_inference_steps"},
      {"huge steps", [](auto& r) { r.set_num_inference_steps(1 << 30); }, "num_inference_steps"},
      {"NaN guidance", [](auto& r) { r.set_guidance_scale(std::nanf("")); }, "guidance_scale"},
      {"inf guidance", [](auto& r) { r.set_guidance_scale(std::numeric_limits<float>::infinity()); }, "guidance_scale"},
      {"negative guidance", [](auto& r) { r.set_guidance_scale(-1); }, "guidance_scale"},
      {"bad format", [](auto& r) { r.set_output_format(static_cast<v1::ImageFormat>(77)); }, "output_format 77"},
      {"long request id", [](auto& r) { r.set_request_id(std::string(1000, 'x')); }, "request_id"},
      {"control chars in id", [](auto& r) { r.set_request_id("a\nb"); }, "request_id"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    v1::GenerateRequest request = E2eServer::SmallRequest();
    c.mutate(request);
    ExpectRefused(server_->Generate(request), grpc::INVALID_ARGUMENT, c.needle);
  }
}

TEST_F(AdversarialTest, AHugePipelineNameIsNotEchoedWhole) {
  v1::GenerateRequest request = E2eServer::SmallRequest(std::string(1 << 20, 'p'));
  ExpectRefused(server_->Generate(request), grpc::NOT_FOUND, "(1048576 bytes)");
}

TEST_F(AdversarialTest, InvalidUtf8InAStringFieldIsInvalidArgumentNamingTheField) {
  // Built by hand: the C++ protobuf serializer would only log about invalid UTF-8, but a hostile
  // client sends whatever bytes it likes. Field 2 of GenerateRequest is the prompt.
  const std::string prompt = "\xff\xfe bad";
  std::string wire;
  wire.push_back(static_cast<char>((2 << 3) | 2));
  wire.push_back(static_cast<char>(prompt.size()));
  wire += prompt;
  grpc::GenericStub stub(server_->channel());
  for (const std::string method : {"/stowage.v1.GenerationService/Generate",
                                   "/stowage.v1.GenerationService/GenerateStream"}) {
    SCOPED_TRACE(method);
    grpc::ClientContext context;
    context.set_deadline(In(milliseconds(10000)));
    grpc::Slice slice(wire);
    grpc::ByteBuffer request(&slice, 1), response;
    grpc::Status status;
    if (method.find("Stream") == std::string::npos) {
      status = GenericUnaryCall(server_->channel(), &context, method, request, &response);
    } else {
      grpc::CompletionQueue cq;
      auto call = stub.PrepareCall(&context, method, &cq);
      void* tag;
      bool ok;
      call->StartCall(reinterpret_cast<void*>(1));
      cq.Next(&tag, &ok);
      call->WriteLast(request, grpc::WriteOptions(), reinterpret_cast<void*>(2));
      cq.Next(&tag, &ok);
      call->Finish(&status, reinterpret_cast<void*>(3));
      while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(3)) {
      }
      cq.Shutdown();
      while (cq.Next(&tag, &ok)) {
      }
    }
    ExpectRefused(status, grpc::INVALID_ARGUMENT, "GenerateRequest.prompt is not valid UTF-8");
  }
}

TEST_F(AdversarialTest, MalformedWireBytesAreInvalidArgument) {
  grpc::ClientContext context;
  context.set_deadline(In(milliseconds(10000)));
  const std::string garbage("\x12\xff\xff\xff\xff\x0f", 6);  // A length far past the end.
  grpc::Slice slice(garbage);
  grpc::ByteBuffer request(&slice, 1), response;
  const grpc::Status status =
      GenericUnaryCall(server_->channel(), &context, "/stowage.v1.GenerationService/Generate", request, &response);
  ExpectRefused(status, grpc::INVALID_ARGUMENT, "not a well-formed stowage.v1.GenerateRequest");
}

// --- Protocol-level garbage and oversized messages --------------------------------------------

TEST_F(AdversarialTest, ProtocolGarbageDoesNotHurtTheServer) {
  const std::string address = server_->server().grpc_address();
  SendRawBytes(address, "GET / HTTP/1.1\r\nHost: x\r\n\r\n");
  SendRawBytes(address, std::string(100000, '\0'));
  SendRawBytes(address, std::string("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") + std::string(5000, '\xff'));
  std::string random(65536, '\0');
  uint32_t x = 12345;
  for (char& c : random) c = static_cast<char>((x = x * 1103515245 + 12345) >> 24);
  SendRawBytes(address, random);
  EXPECT_TRUE(HealthServing(server_->channel()));
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest()).ok());
}

TEST_F(AdversarialTest, AnOversizedMessageIsResourceExhausted) {
  v1::GenerateRequest request = E2eServer::SmallRequest();
  request.set_prompt(std::string(33 << 20, 'a'));  // Over the 32 MiB receive limit.
  EXPECT_EQ(server_->Generate(request).error_code(), grpc::RESOURCE_EXHAUSTED);
}

TEST_F(AdversarialTest, UnknownMethodIsUnimplemented) {
  grpc::ClientContext context;
  context.set_deadline(In(milliseconds(5000)));
  grpc::Slice slice("");
  grpc::ByteBuffer request(&slice, 1), response;
  const grpc::Status status = GenericUnaryCall(server_->channel(), &context,
                                               "/stowage.v1.GenerationService/NoSuchMethod", request, &response);
  EXPECT_EQ(status.error_code(), grpc::UNIMPLEMENTED);
}

// --- Queue floods ----------------------------------------------------------------------------

TEST_F(AdversarialTest, AFloodIsRefusedWithResourceExhaustedAndTheRestSucceed) {
  constexpr int kClients = 16;
  std::atomic<int> ok{0}, exhausted{0}, other{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < kClients; ++i) {
    threads.emplace_back([&, i] {
      const grpc::Status s = server_->Generate(E2eServer::SmallRequest("", static_cast<uint64_t>(i)));
      if (s.ok()) {
        ++ok;
      } else if (s.error_code() == grpc::RESOURCE_EXHAUSTED &&
                 s.error_message().find("queue") != std::string::npos) {
        ++exhausted;
      } else {
        ++other;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(other.load(), 0);
  EXPECT_GE(ok.load(), 1);
  EXPECT_EQ(ok.load() + exhausted.load(), kClients);
}

// --- Cancellation and deadlines --------------------------------------------------------------

TEST_F(AdversarialTest, DeadlinesAndCancellationStopRequestsCleanly) {
  v1::GenerateRequest slow = E2eServer::SmallRequest();
  slow.set_width(512);
  slow.set_height(512);
  slow.set_num_inference_steps(50);
  const grpc::Status expired = server_->Generate(slow, nullptr, milliseconds(50));
  EXPECT_EQ(expired.error_code(), grpc::DEADLINE_EXCEEDED);

  // Cancel a stream after its first progress message.
  grpc::ClientContext context;
  auto reader = server_->generation().GenerateStream(&context, slow);
  v1::GenerateStreamResponse message;
  ASSERT_TRUE(reader->Read(&message));
  context.TryCancel();
  while (reader->Read(&message)) {
  }
  EXPECT_EQ(reader->Finish().error_code(), grpc::CANCELLED);

  // The worker is free again: a normal request goes through promptly.
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest(), nullptr, milliseconds(30000)).ok());
}

// --- Admin authentication --------------------------------------------------------------------

TEST_F(AdversarialTest, AdminAuthenticationRefusesEveryWrongToken) {
  v1::GetPlacementResponse response;
  for (const std::string& header : {std::string(""), std::string("Bearer"), std::string("Bearer "),
                                    std::string("bearer ") + kE2eToken, std::string("Basic ") + kE2eToken,
                                    std::string("Bearer ") + kE2eToken + "x", std::string("Bearer ") + std::string(4000, 'x')}) {
    grpc::ClientContext context;
    context.AddMetadata("authorization", header);
    const grpc::Status status = server_->admin().GetPlacement(&context, {}, &response);
    EXPECT_TRUE(status.error_code() == grpc::UNAUTHENTICATED || status.error_code() == grpc::PERMISSION_DENIED)
        << header.substr(0, 20) << ": " << status.error_code() << " " << status.error_message();
    EXPECT_LT(status.error_message().size(), 200u);
  }
  // Metadata past gRPC's limit is refused by the transport before any handler runs.
  grpc::ClientContext huge;
  huge.AddMetadata("authorization", std::string("Bearer ") + std::string(1 << 20, 'x'));
  EXPECT_EQ(server_->admin().GetPlacement(&huge, {}, &response).error_code(), grpc::RESOURCE_EXHAUSTED);
}

// --- Strategy and offload abuse --------------------------------------------------------------

TEST_F(AdversarialTest, BadAdminChangesAreRefusedAndChangeNothing) {
  v1::GetPlacementResponse before;
  ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), {}, &before).ok());
  v1::EnableGroupOffloadRequest enable;
  v1::EnableGroupOffloadResponse enabled;
  // No target.
  ExpectRefused(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled),
                grpc::INVALID_ARGUMENT, "set component_id or pipeline");
  // Unknown component with a huge id: NOT_FOUND, not echoed whole.
  enable.set_component_id(std::string(1 << 20, 'c'));
  ExpectRefused(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled), grpc::NOT_FOUND,
                "(1048576 bytes)");
  // A whole-pipeline change whose override names a missing component changes nothing.
  enable.set_pipeline("zimage-tiny");
  (*enable.mutable_overrides())["no_such_component"].set_num_blocks_per_group(1);
  ExpectRefused(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled),
                grpc::INVALID_ARGUMENT, "no_such_component");
  // Disable on a component that is not group-offloaded.
  v1::DisableGroupOffloadRequest disable;
  disable.set_component_id("zimage-tiny/vae");
  v1::DisableGroupOffloadResponse disabled;
  ExpectRefused(server_->admin().DisableGroupOffload(E2eServer::Authed().get(), disable, &disabled),
                grpc::FAILED_PRECONDITION, "not group-offloaded");
  // Empty strategy.
  v1::SetOffloadStrategyRequest strategy;
  v1::SetOffloadStrategyResponse set;
  ExpectRefused(server_->admin().SetOffloadStrategy(E2eServer::Authed().get(), strategy, &set),
                grpc::INVALID_ARGUMENT, "strategy: empty");
  // footprint.keep_resident: an unknown id, an unknown name, a 1 MiB entry, an empty one, too many.
  for (const std::string& bad : {std::string("zimage-tiny/unet"), std::string("nope"), std::string(1 << 20, 'k'),
                                 std::string(), std::string("/")}) {
    v1::SetOffloadStrategyRequest keep;
    keep.mutable_strategy()->mutable_footprint()->add_keep_resident(bad);
    ExpectRefused(server_->admin().SetOffloadStrategy(E2eServer::Authed().get(), keep, &set),
                  grpc::INVALID_ARGUMENT, "strategy.footprint.keep_resident[0]");
  }
  v1::SetOffloadStrategyRequest many;
  for (int i = 0; i < 10000; ++i) many.mutable_strategy()->mutable_footprint()->add_keep_resident("vae");
  ExpectRefused(server_->admin().SetOffloadStrategy(E2eServer::Authed().get(), many, &set),
                grpc::INVALID_ARGUMENT, "at most 64");
  v1::GetPlacementResponse after;
  ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), {}, &after).ok());
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());
}

// The crash this issue started from: group offload switched on and off while requests run through
// the same component. Every request must succeed with the same image, every switch must land.
TEST_F(AdversarialTest, GroupOffloadSwitchedWhileRequestsRunNeverBreaksThem) {
  int switches = 0;
  ExpectSameImagesWhile(7, "group offload switching", [&] {
    for (int i = 0; i < 12; ++i) {
      v1::EnableGroupOffloadRequest enable;
      enable.set_component_id("zimage-tiny/transformer");
      v1::EnableGroupOffloadResponse enabled;
      ASSERT_TRUE(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled).ok());
      v1::DisableGroupOffloadRequest disable;
      disable.set_component_id("zimage-tiny/transformer");
      v1::DisableGroupOffloadResponse disabled;
      ASSERT_TRUE(server_->admin().DisableGroupOffload(E2eServer::Authed().get(), disable, &disabled).ok());
      switches += 2;
    }
  });
  EXPECT_EQ(switches, 24);
}

// The footprint strategy switched between keeping components resident and not while requests run:
// every request succeeds with the same image, every switch lands.
TEST_F(AdversarialTest, KeepResidentStrategySwitchedWhileRequestsRunNeverBreaksThem) {
  ExpectSameImagesWhile(9, "strategy switching", [&] {
    for (int i = 0; i < 10; ++i) {
      v1::SetOffloadStrategyRequest request;
      auto* footprint = request.mutable_strategy()->mutable_footprint();
      if (i % 2 == 0) {
        footprint->add_keep_resident("zimage-tiny/text_encoder");
        footprint->add_keep_resident("vae");
      }
      v1::SetOffloadStrategyResponse response;
      const grpc::Status s = server_->admin().SetOffloadStrategy(E2eServer::Authed().get(), request, &response);
      EXPECT_TRUE(s.ok()) << s.error_message();
      EXPECT_EQ(response.strategy(), "footprint");
    }
  });
}

// --- Lifecycle races -------------------------------------------------------------------------

int CountDefaults(E2eServer& server) {
  grpc::ClientContext context;
  v1::ListPipelinesResponse list;
  EXPECT_TRUE(server.generation().ListPipelines(&context, {}, &list).ok());
  int defaults = 0;
  for (const auto& p : list.pipelines()) defaults += p.is_default() ? 1 : 0;
  return defaults;
}

TEST_F(AdversarialTest, ConcurrentLoadsOfOneNameLetExactlyOneThrough) {
  constexpr int kLoaders = 6;
  std::atomic<int> ok{0}, exists{0}, other{0};
  std::vector<std::thread> loaders;
  for (int i = 0; i < kLoaders; ++i) {
    loaders.emplace_back([&] {
      v1::LoadPipelineRequest load;
      load.mutable_pipeline()->set_name("raced");
      load.mutable_pipeline()->set_builtin("tiny");
      v1::LoadPipelineResponse loaded;
      const grpc::Status s = server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded);
      if (s.ok()) {
        ++ok;
      } else if (s.error_code() == grpc::ALREADY_EXISTS) {
        ++exists;
      } else {
        ++other;
      }
    });
  }
  for (auto& t : loaders) t.join();
  EXPECT_EQ(ok.load(), 1);
  EXPECT_EQ(exists.load(), kLoaders - 1);
  EXPECT_EQ(other.load(), 0);
  v1::GetPlacementResponse placement;
  ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), {}, &placement).ok());
  int raced = 0;
  for (const auto& c : placement.components()) raced += c.id().rfind("raced/", 0) == 0 ? 1 : 0;
  EXPECT_EQ(raced, 3);  // One set of components, not one per attempt.
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("raced")).ok());
  EXPECT_EQ(CountDefaults(*server_), 1);
}

TEST_F(LifecycleTest, UnloadsAndLoadsRacingKeepExactlyOneDefault) {
  // A busy worker makes the unload wait; its deadline passes before it runs: it is withdrawn,
  // and the pipeline is READY again.
  std::thread busy([&] { EXPECT_TRUE(server_->Generate(Slow()).ok()); });
  EXPECT_TRUE(AwaitState([&] { return RunningRequests(server_->server().devices()) == 1; }));
  v1::UnloadPipelineRequest unload;
  unload.set_name("zimage-tiny");
  v1::UnloadPipelineResponse unloaded;
  const grpc::Status timed_out =
      server_->admin().UnloadPipeline(E2eServer::Authed(milliseconds(30)).get(), unload, &unloaded);
  busy.join();
  EXPECT_EQ(timed_out.error_code(), grpc::DEADLINE_EXCEEDED) << timed_out.error_message();
  EXPECT_EQ(CountDefaults(*server_), 1);
  // The client sees DEADLINE_EXCEEDED at its deadline; the server's handler puts the pipeline back
  // to READY only after it withdrew the task (it polls the deadline), which may be a moment later.
  EXPECT_TRUE(AwaitState(
      [&] { return StateOf(server_->server().devices(), "zimage-tiny") == v1::PIPELINE_READY; }, absl::Seconds(10)));
  const grpc::Status after_withdrawal = server_->Generate(E2eServer::SmallRequest("zimage-tiny"));
  EXPECT_TRUE(after_withdrawal.ok()) << after_withdrawal.error_code() << " " << after_withdrawal.error_message();

  // Load and unload of the same name from many threads: every answer is one of the documented
  // ones, and the default invariant holds throughout.
  std::atomic<int> unexpected{0};
  std::vector<std::thread> threads;
  for (int i = 0; i < 8; ++i) {
    threads.emplace_back([&, i] {
      for (int k = 0; k < 3; ++k) {
        grpc::Status s;
        if ((i + k) % 2 == 0) {
          v1::LoadPipelineRequest load;
          load.mutable_pipeline()->set_name("flip");
          load.mutable_pipeline()->set_builtin("tiny");
          v1::LoadPipelineResponse loaded;
          s = server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded);
          if (!s.ok() && s.error_code() != grpc::ALREADY_EXISTS && s.error_code() != grpc::FAILED_PRECONDITION) {
            ++unexpected;
            ADD_FAILURE() << "load: " << s.error_code() << " " << s.error_message();
          }
        } else {
          v1::UnloadPipelineRequest u;
          u.set_name("flip");
          v1::UnloadPipelineResponse r;
          s = server_->admin().UnloadPipeline(E2eServer::Authed().get(), u, &r);
          if (!s.ok() && s.error_code() != grpc::NOT_FOUND && s.error_code() != grpc::FAILED_PRECONDITION) {
            ++unexpected;
            ADD_FAILURE() << "unload: " << s.error_code() << " " << s.error_message();
          }
        }
        EXPECT_EQ(CountDefaults(*server_), 1);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(unexpected.load(), 0);
  // Unload everything: no default remains, requests for the default get UNAVAILABLE.
  for (const std::string name : {"flip", "tiny", "zimage-tiny"}) {
    v1::UnloadPipelineRequest u;
    u.set_name(name);
    v1::UnloadPipelineResponse r;
    const grpc::Status s = server_->admin().UnloadPipeline(E2eServer::Authed().get(), u, &r);
    EXPECT_TRUE(s.ok() || (name == "flip" && s.error_code() == grpc::NOT_FOUND)) << name << ": " << s.error_message();
  }
  EXPECT_EQ(CountDefaults(*server_), 0);
  EXPECT_EQ(server_->Generate(E2eServer::SmallRequest()).error_code(), grpc::UNAVAILABLE);
}

TEST_F(LifecycleTest, RequestsQueuedBeforeAnUnloadFinishAndLaterOnesAreRefused) {
  const v1::GenerateRequest slow = Slow();
  std::vector<std::thread> accepted;
  std::atomic<int> accepted_ok{0};
  for (int i = 0; i < 2; ++i) {
    accepted.emplace_back([&] { accepted_ok += server_->Generate(slow).ok() ? 1 : 0; });
  }
  // One runs, the other waits behind it.
  EXPECT_TRUE(AwaitState([&] {
    const DeviceSet& devices = server_->server().devices();
    return RunningRequests(devices) == 1 && QueuedRequests(devices) == 1;
  }));
  v1::UnloadPipelineRequest unload;
  unload.set_name("tiny");
  v1::UnloadPipelineResponse unloaded;
  std::thread unloader([&] {
    EXPECT_TRUE(server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded).ok());
  });
  EXPECT_TRUE(AwaitState([&] { return StateOf(server_->server().devices(), "tiny") == v1::PIPELINE_UNLOADING; }));
  // While it waits for the accepted requests, its components say so (from the next step boundary
  // between requests on, where the worker marks them).
  int unloading = 0;
  for (int tries = 0; tries < 200 && unloading != 3; ++tries) {
    absl::SleepFor(absl::Milliseconds(20));
    v1::GetPlacementResponse placement;
    ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), {}, &placement).ok());
    unloading = 0;
    for (const auto& c : placement.components()) {
      if (c.lifecycle() == v1::ComponentPlacement::UNLOADING) {
        EXPECT_EQ(c.id().rfind("tiny/", 0), 0u) << c.id();
        ++unloading;
      }
    }
  }
  EXPECT_EQ(unloading, 3);
  const grpc::Status late = server_->Generate(E2eServer::SmallRequest("tiny"));
  EXPECT_TRUE(late.error_code() == grpc::FAILED_PRECONDITION || late.error_code() == grpc::NOT_FOUND)
      << late.error_message();
  for (auto& t : accepted) t.join();
  unloader.join();
  EXPECT_EQ(accepted_ok.load(), 2);
  EXPECT_EQ(server_->Generate(E2eServer::SmallRequest("tiny")).error_code(), grpc::NOT_FOUND);
}

}  // namespace
}  // namespace stowage
