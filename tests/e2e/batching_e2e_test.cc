// Dynamic batching through a real server over loopback: requests queued together run as one batch,
// each gets the image it gets alone, a member that leaves does not disturb the others, the admin
// API switches batching at run time and refuses what is out of range, and Prometheus shows the
// batch histograms.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>
#include <grpcpp/grpcpp.h>

#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/text_format.h"
#include "runtime/config.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"
#include "tests/e2e/queued_together.h"
#include "tests/e2e/same_image.h"

namespace stowage {
namespace {

using std::chrono::milliseconds;

// Requests that differ in everything a batch allows to differ: prompt (and so caption length),
// seed, guidance and negative prompt. Same size and step count; raw RGB images (compared pixel by
// pixel).
std::vector<v1::GenerateRequest> MixedRequests() {
  std::vector<v1::GenerateRequest> requests;
  const std::vector<std::string> prompts = {"a red circle", "a much longer prompt about a blue boat on a calm lake",
                                            "a red circle", "green"};
  for (size_t i = 0; i < prompts.size(); ++i) {
    v1::GenerateRequest r = E2eServer::SmallRequest("zimage-tiny", 10 + i);
    r.set_prompt(prompts[i]);
    r.set_num_inference_steps(3);
    r.set_output_format(v1::IMAGE_FORMAT_RGB);
    if (i == 2) {
      r.set_guidance_scale(2.0f);
      r.set_negative_prompt("blurry");
    }
    requests.push_back(r);
  }
  return requests;
}

class BatchingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
      metrics_address: "127.0.0.1:0"
      pipelines {
        name: "zimage-tiny" builtin: "zimage-tiny" default: true
        batching { max_batch_size: 4 max_queue_delay_ms: 5000 }
      })pb", &config));
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
  }

  // Sends `requests` concurrently; returns the statuses and responses in order.
  void SendConcurrently(const std::vector<v1::GenerateRequest>& requests, std::vector<grpc::Status>& statuses,
                        std::vector<v1::GenerateResponse>& responses) {
    statuses.assign(requests.size(), grpc::Status());
    responses.assign(requests.size(), v1::GenerateResponse());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { statuses[i] = server_->Generate(requests[i], &responses[i], milliseconds(120000)); });
    }
    for (std::thread& t : threads) t.join();
  }

  // Holds the device with a long request (another image size: its own batch key) until the
  // queue-depth gauge shows `depth` requests waiting, then lets it finish, so that those requests
  // reach the worker together whatever the timing of the threads that sent them. `send` sends them
  // (and returns when they are answered).
  void WithRequestsQueuedTogether(int depth, const std::function<void()>& send) {
    LongRequest holder(server_->generation(), "zimage-tiny");
    ASSERT_TRUE(holder.running());
    std::thread sender(send);
    const bool queued =
        WaitForQueueDepth(server_->server().metrics_address(), DeviceNameOf(v1::DeviceConfig()), depth);
    EXPECT_TRUE(holder.Finish());
    sender.join();
    EXPECT_TRUE(queued) << depth << " requests never waited together";
  }

  grpc::Status SetBatching(int size, int delay_ms, const std::string& pipeline = "zimage-tiny",
                           v1::SetBatchingResponse* out = nullptr) {
    v1::SetBatchingRequest request;
    request.set_pipeline(pipeline);
    request.mutable_batching()->set_max_batch_size(size);
    request.mutable_batching()->set_max_queue_delay_ms(delay_ms);
    v1::SetBatchingResponse ignored;
    return server_->admin().SetBatching(E2eServer::Authed().get(), request, out != nullptr ? out : &ignored);
  }

  std::unique_ptr<E2eServer> server_;
};

TEST_F(BatchingTest, QueuedRequestsRunAsOneBatchAndEachGetsItsImageAlone) {
  const std::vector<v1::GenerateRequest> requests = MixedRequests();
  std::vector<grpc::Status> statuses;
  std::vector<v1::GenerateResponse> batched;
  // Four requests queued together, a batch of four: it starts full.
  WithRequestsQueuedTogether(4, [&] { SendConcurrently(requests, statuses, batched); });
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    const v1::RequestStats& stats = batched[i].stats();
    EXPECT_EQ(stats.batch_size(), 4) << i;
    EXPECT_EQ(batched[i].seed(), 10 + i);
    // The denoising stage ran once for all; PNG encoding is each request's own.
    bool denoise_shared = false, encode_own = false;
    for (const v1::StageTiming& stage : stats.stages()) {
      if (stage.stage() == "denoise") denoise_shared = stage.shared();
      if (stage.stage() == "encode_image") encode_own = !stage.shared();
    }
    EXPECT_TRUE(denoise_shared && encode_own) << stats.DebugString();
  }
  // Batching off: each alone gives the same image (ExpectSameImage says how close).
  ASSERT_TRUE(SetBatching(1, 0).ok());
  for (size_t i = 0; i < requests.size(); ++i) {
    v1::GenerateResponse alone;
    ASSERT_TRUE(server_->Generate(requests[i], &alone, milliseconds(60000)).ok());
    EXPECT_EQ(alone.stats().batch_size(), 1);
    ExpectSameImage(batched[i], alone, "request " + std::to_string(i));
  }
  EXPECT_EQ(batched[0].image() != batched[2].image(), true);  // Guidance changes the picture.

  const std::string metrics = HttpGet(server_->server().metrics_address(), "/metrics");
  // While batching was on: the long request that held the device (a batch of one), then one batch
  // of four; runs with batching off are no batches.
  EXPECT_NE(metrics.find("stowage_batch_size_count{pipeline=\"zimage-tiny\"} 2\n"), std::string::npos)
      << metrics.substr(metrics.find("stowage_batch"), 1500);
  EXPECT_NE(metrics.find("stowage_batch_size_sum{pipeline=\"zimage-tiny\"} 5\n"), std::string::npos)
      << metrics.substr(metrics.find("stowage_batch"), 1500);
  EXPECT_NE(metrics.find("stowage_batch_queue_delay_seconds_count{pipeline=\"zimage-tiny\"}"), std::string::npos);
  EXPECT_TRUE(HealthServing(server_->channel()));
}

// A lone client pays no batching delay, not even for its first request of each new size (the
// fixture's batching may hold a batch open 5 s): a key with no history does not hold.
TEST_F(BatchingTest, ALoneClientsFirstRequestOfEachNewSizeDoesNotWait) {
  for (const int size : {64, 96, 128, 64}) {
    v1::GenerateRequest request = E2eServer::SmallRequest("zimage-tiny", 5);
    request.set_width(size);
    request.set_height(size);
    v1::GenerateResponse response;
    ASSERT_TRUE(server_->Generate(request, &response, milliseconds(60000)).ok());
    EXPECT_EQ(response.stats().batch_size(), 1) << size;
    const google::protobuf::Duration& wait = response.stats().batch_wait();
    EXPECT_LT(wait.seconds() + wait.nanos() * 1e-9, 1.0) << size << "x" << size << " waited for company";
  }
}

TEST_F(BatchingTest, OnlyRequestsOfOneSizeAndStepCountShareABatch) {
  ASSERT_TRUE(SetBatching(4, 1500).ok());
  std::vector<v1::GenerateRequest> requests = MixedRequests();
  requests[1].set_width(80);
  requests[3].set_num_inference_steps(2);
  std::vector<grpc::Status> statuses;
  std::vector<v1::GenerateResponse> responses;
  WithRequestsQueuedTogether(4, [&] { SendConcurrently(requests, statuses, responses); });
  for (size_t i = 0; i < requests.size(); ++i) ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
  EXPECT_EQ(responses[0].stats().batch_size(), 2);
  EXPECT_EQ(responses[2].stats().batch_size(), 2);
  EXPECT_EQ(responses[1].stats().batch_size(), 1);
  EXPECT_EQ(responses[3].stats().batch_size(), 1);
  EXPECT_EQ(responses[1].width(), 80);
}

// A member whose client cancels leaves at the next step boundary; the rest finish with their own
// images.
TEST_F(BatchingTest, ACancelledMemberLeavesWithoutDisturbingTheOthers) {
  ASSERT_TRUE(SetBatching(3, 5000).ok());
  std::vector<v1::GenerateRequest> requests = MixedRequests();
  requests.resize(3);
  for (auto& r : requests) r.set_num_inference_steps(40);
  // The member that leaves streams progress and cancels after its first denoising step.
  grpc::ClientContext leaving_context;
  leaving_context.set_deadline(In(milliseconds(120000)));
  grpc::Status leaving_status;
  std::vector<v1::GenerateResponse> stayed(2);
  std::vector<grpc::Status> stayed_status(2);
  // The three queue together behind a long request: one batch of three, full at once.
  WithRequestsQueuedTogether(3, [&] {
    std::thread leaving([&] {
      auto reader = server_->generation().GenerateStream(&leaving_context, requests[1]);
      v1::GenerateStreamResponse message;
      while (reader->Read(&message)) {
        if (message.has_progress() && message.progress().stage() == "denoise" && message.progress().step() >= 1) {
          leaving_context.TryCancel();
        }
      }
      leaving_status = reader->Finish();
    });
    std::thread a([&] { stayed_status[0] = server_->Generate(requests[0], &stayed[0], milliseconds(120000)); });
    std::thread b([&] { stayed_status[1] = server_->Generate(requests[2], &stayed[1], milliseconds(120000)); });
    leaving.join();
    a.join();
    b.join();
  });
  EXPECT_EQ(leaving_status.error_code(), grpc::CANCELLED) << leaving_status.error_message();
  ASSERT_TRUE(stayed_status[0].ok() && stayed_status[1].ok());
  EXPECT_EQ(stayed[0].stats().batch_size(), 3);
  ASSERT_TRUE(SetBatching(1, 0).ok());
  v1::GenerateResponse alone0, alone2;
  ASSERT_TRUE(server_->Generate(requests[0], &alone0, milliseconds(60000)).ok());
  ASSERT_TRUE(server_->Generate(requests[2], &alone2, milliseconds(60000)).ok());
  ExpectSameImage(stayed[0], alone0, "request 0");
  ExpectSameImage(stayed[1], alone2, "request 2");
  EXPECT_TRUE(HealthServing(server_->channel()));
}

TEST_F(BatchingTest, AdminSetBatchingReportsAndRefusesWhatIsOutOfRange) {
  v1::SetBatchingResponse response;
  ASSERT_TRUE(SetBatching(8, 20, "zimage-tiny", &response).ok());
  EXPECT_EQ(response.pipeline().max_batch_size(), 8);
  EXPECT_EQ(response.pipeline().max_queue_delay_ms(), 20);
  v1::ListPipelinesResponse list;
  ASSERT_TRUE(server_->Pipelines(&list).ok());
  EXPECT_EQ(list.pipelines(0).max_batch_size(), 8);

  struct Case {
    int size, delay;
    std::string pipeline;
    grpc::StatusCode code;
    std::string needle;
  };
  for (const Case& c : std::vector<Case>{{65, 0, "zimage-tiny", grpc::INVALID_ARGUMENT, "batching.max_batch_size: 65"},
                                         {-1, 0, "zimage-tiny", grpc::INVALID_ARGUMENT, "max_batch_size: -1"},
                                         {4, -5, "zimage-tiny", grpc::INVALID_ARGUMENT, "max_queue_delay_ms: -5"},
                                         {4, 60001, "zimage-tiny", grpc::INVALID_ARGUMENT, "allowed: 0..60000"},
                                         {4, 0, "nope", grpc::NOT_FOUND, "no READY pipeline named 'nope'"},
                                         {4, 0, std::string(5000, 'x'), grpc::NOT_FOUND, "(5000 bytes)"}}) {
    const grpc::Status status = SetBatching(c.size, c.delay, c.pipeline);
    EXPECT_EQ(status.error_code(), c.code) << c.needle << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.needle), std::string::npos) << status.error_message();
  }
  // Refused changes changed nothing.
  grpc::ClientContext again;
  ASSERT_TRUE(server_->generation().ListPipelines(&again, v1::ListPipelinesRequest(), &list).ok());
  EXPECT_EQ(list.pipelines(0).max_batch_size(), 8);
  // Without the token: refused.
  grpc::ClientContext anonymous;
  v1::SetBatchingRequest request;
  request.set_pipeline("zimage-tiny");
  v1::SetBatchingResponse ignored;
  EXPECT_EQ(server_->admin().SetBatching(&anonymous, request, &ignored).error_code(), grpc::UNAUTHENTICATED);
  EXPECT_TRUE(HealthServing(server_->channel()));
}

// Batching settings changed, and a batching pipeline unloaded and loaded again, while batched
// requests run and queue: every request ends OK or with a clear status, none hangs, and the server
// still serves afterwards.
TEST_F(BatchingTest, SettingsAndLifecycleChangesUnderBatchedLoad) {
  std::atomic<bool> stop{false};
  absl::Mutex mu;
  std::map<grpc::StatusCode, int> codes;
  std::vector<std::thread> clients;
  for (int c = 0; c < 6; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 4; ++i) {
        v1::GenerateRequest r = E2eServer::SmallRequest(c % 2 == 0 ? "zimage-tiny" : "extra", 10 * c + i);
        r.set_num_inference_steps(2);
        const grpc::Status status = server_->Generate(r, nullptr, milliseconds(60000));
        absl::MutexLock lock(&mu);
        ++codes[status.error_code()];
      }
    });
  }
  std::thread admin([&] {
    for (int round = 0; !stop.load() && round < 40; ++round) {
      (void)SetBatching(1 + round % 4, (round * 7) % 60);
      (void)SetBatching(1 + (round + 1) % 4, 0, "extra");
      if (round % 5 == 0) {
        v1::UnloadPipelineRequest unload;
        unload.set_name("extra");
        v1::UnloadPipelineResponse unloaded;
        (void)server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded);
      } else if (round % 5 == 2) {
        v1::LoadPipelineRequest load;
        load.mutable_pipeline()->set_name("extra");
        load.mutable_pipeline()->set_builtin("zimage-tiny");
        load.mutable_pipeline()->mutable_batching()->set_max_batch_size(3);
        v1::LoadPipelineResponse loaded;
        (void)server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded);
      }
    }
  });
  for (std::thread& t : clients) t.join();
  stop = true;
  admin.join();
  int total = 0;
  for (const auto& [code, n] : codes) {
    total += n;
    // OK, or the pipeline was gone or going: never INTERNAL, never a deadline.
    EXPECT_TRUE(code == grpc::OK || code == grpc::NOT_FOUND || code == grpc::FAILED_PRECONDITION ||
                code == grpc::UNAVAILABLE)
        << "status code " << code;
  }
  EXPECT_EQ(total, 24);
  EXPECT_GT(codes[grpc::OK], 0);
  EXPECT_TRUE(HealthServing(server_->channel()));
  ASSERT_TRUE(SetBatching(2, 0).ok());
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("zimage-tiny")).ok());
}

// Warm-up at load (PipelineConfig.warmup; off by default on the simulated device, on for CUDA): the pipeline's
// components are placed before it turns READY, so the first request moves nothing; the placement
// log names the warm-up.
TEST(WarmupE2eTest, WarmUpAtLoadPlacesComponentsBeforeTheFirstRequest) {
  int64_t first_request_h2d[2] = {-1, -1};
  for (const bool warmup : {false, true}) {
    SCOPED_TRACE(warmup);
    v1::ServerConfig config;
    v1::PipelineConfig* p = config.add_pipelines();
    p->set_name("zimage-tiny");
    p->set_builtin("zimage-tiny");
    p->set_warmup(warmup);  // Explicit: the default is on for CUDA devices.
    E2eServer server(config);
    ASSERT_TRUE(server.ok());
    v1::GenerateResponse response;
    ASSERT_TRUE(server.Generate(E2eServer::SmallRequest(), &response).ok());
    first_request_h2d[warmup ? 1 : 0] = response.stats().host_to_device_bytes();
    v1::GetPlacementLogRequest request;
    v1::GetPlacementLogResponse log;
    ASSERT_TRUE(server.admin().GetPlacementLog(E2eServer::Authed().get(), request, &log).ok());
    bool warmup_decisions = false;
    for (const auto& d : log.decisions()) warmup_decisions |= d.request_id() == "warmup-zimage-tiny";
    EXPECT_EQ(warmup_decisions, warmup);
  }
  EXPECT_GT(first_request_h2d[0], 0);   // Cold: the components arrive with the first request.
  EXPECT_EQ(first_request_h2d[1], 0);   // Warmed: they are already there.
}

// A config whose batching is out of range fails start-up naming the field path.
TEST(BatchingConfigTest, OutOfRangeBatchingFailsStartUpNamingTheField) {
  v1::ServerConfig config;
  ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
    grpc_address: "127.0.0.1:0" metrics_address: "none"
    pipelines { name: "a" builtin: "zimage-tiny" batching { max_batch_size: 1000 } })pb", &config));
  auto server = StowageServer::Start(config);
  ASSERT_FALSE(server.ok());
  EXPECT_NE(server.status().message().find("pipelines[0].batching.max_batch_size: 1000 is out of range"),
            std::string::npos)
      << server.status();
}

}  // namespace
}  // namespace stowage
