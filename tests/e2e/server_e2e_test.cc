// End to end over real gRPC on loopback: the assembled server on port 0, called through generated
// stubs, its /metrics scraped over HTTP.
#include <algorithm>
#include <chrono>
#include <memory>
#include <regex>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "models/core/image.h"
#include "runtime/config.h"
#include "server/server.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"
#include "tests/offload/spill_dir.h"
#include "tests/e2e/http_get.h"

namespace stowage {
namespace {

using v1::GenerateRequest;
using v1::GenerateResponse;

class ServerE2ETest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    v1::ServerConfig config;
    config.set_grpc_address("127.0.0.1:0");
    config.set_metrics_address("127.0.0.1:0");
    config.set_queue_depth(1);
    auto server = StowageServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = server->release();
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
  }
  void SetUp() override {
    ASSERT_NE(server_, nullptr);
    stub_ = v1::GenerationService::NewStub(
        grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials()));
  }

  static GenerateRequest Small() {
    GenerateRequest request;
    request.set_prompt("a small red boat");
    request.set_width(64);
    request.set_height(64);
    request.set_num_inference_steps(2);
    request.set_seed(11);
    return request;
  }

  grpc::Status Call(const GenerateRequest& request, GenerateResponse* response,
                    std::chrono::milliseconds deadline = std::chrono::milliseconds(60000)) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + deadline);
    return stub_->Generate(&context, request, response);
  }

  static StowageServer* server_;
  std::unique_ptr<v1::GenerationService::Stub> stub_;
};

StowageServer* ServerE2ETest::server_ = nullptr;

TEST_F(ServerE2ETest, ListPipelinesDescribesTheBuiltInPipeline) {
  grpc::ClientContext context;
  v1::ListPipelinesResponse response;
  ASSERT_TRUE(stub_->ListPipelines(&context, {}, &response).ok());
  ASSERT_EQ(response.pipelines_size(), 1);
  const v1::Pipeline& p = response.pipelines(0);
  EXPECT_EQ(p.name(), "zimage-tiny");  // Z-Image's architecture at a tiny size.
  EXPECT_TRUE(p.is_default());
  EXPECT_EQ(p.size_multiple(), 16);
  ASSERT_EQ(p.components_size(), 4);
  EXPECT_EQ(p.components(0).name(), "text_encoder");
  EXPECT_EQ(p.components(1).name(), "vae_encoder");  // Runs only for images in (image to image).
  EXPECT_EQ(p.components(2).name(), "transformer");
  EXPECT_EQ(p.components(3).name(), "vae");
  EXPECT_TRUE(p.accepts_images());
  for (const auto& c : p.components()) {
    EXPECT_GT(c.weight_bytes(), 0);
    EXPECT_EQ(c.dtype(), "float32");
    EXPECT_EQ(c.weight_bytes(), c.parameter_count() * 4);
  }
}

TEST_F(ServerE2ETest, GenerateReturnsAPngAndMeasuredStats) {
  GenerateRequest request = Small();
  request.set_request_id("e2e-1");
  request.set_width(96);
  GenerateResponse response;
  const grpc::Status status = Call(request, &response);
  ASSERT_TRUE(status.ok()) << status.error_message();
  auto image = DecodePng(response.image());
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->width, 96);
  EXPECT_EQ(image->height, 64);
  EXPECT_EQ(response.width(), 96);
  EXPECT_EQ(response.seed(), 11u);
  EXPECT_EQ(response.pipeline(), "zimage-tiny");
  EXPECT_EQ(response.request_id(), "e2e-1");
  const v1::RequestStats& stats = response.stats();
  EXPECT_EQ(stats.device(), server_->device_name());
  // The weights a text-to-image request runs (all but the VAE's encoder) are on the device while it runs.
  int64_t weights = 0;
  {
    grpc::ClientContext context;
    v1::ListPipelinesResponse pipelines;
    ASSERT_TRUE(stub_->ListPipelines(&context, {}, &pipelines).ok());
    for (const auto& c : pipelines.pipelines(0).components()) {
      if (c.name() != "vae_encoder") weights += c.weight_bytes();
    }
  }
  EXPECT_GE(stats.peak_device_memory_bytes(), weights);
  EXPECT_GT(stats.peak_cpu_rss_bytes(), 10 << 20);
  EXPECT_GT(stats.run_time().nanos() + stats.run_time().seconds(), 0);
  std::vector<std::string> stages;
  for (const auto& s : stats.stages()) stages.push_back(s.stage());
  EXPECT_EQ(stages, (std::vector<std::string>{"tokenize", "encode_prompt", "denoise", "decode",
                                               "encode_image"}));

  // Same seed, same image.
  GenerateResponse again;
  ASSERT_TRUE(Call(request, &again).ok());
  EXPECT_EQ(again.image(), response.image());
  EXPECT_EQ(again.format(), v1::IMAGE_FORMAT_PNG);

  // The fast formats carry the same pixels: an uncompressed PNG (larger) and raw RGB rows.
  request.set_output_format(v1::IMAGE_FORMAT_PNG_FAST);
  GenerateResponse fast;
  ASSERT_TRUE(Call(request, &fast).ok());
  EXPECT_EQ(fast.format(), v1::IMAGE_FORMAT_PNG_FAST);
  auto fast_image = DecodePng(fast.image());
  ASSERT_TRUE(fast_image.ok()) << fast_image.status();
  EXPECT_EQ(fast_image->rgb, image->rgb);
  EXPECT_GE(fast.image().size(), 96u * 64u * 3u);
  request.set_output_format(v1::IMAGE_FORMAT_RGB);
  GenerateResponse raw;
  ASSERT_TRUE(Call(request, &raw).ok());
  EXPECT_EQ(raw.format(), v1::IMAGE_FORMAT_RGB);
  EXPECT_EQ(raw.image(), std::string(image->rgb.begin(), image->rgb.end()));
}

TEST_F(ServerE2ETest, BadInputIsRejectedWithAClearMessageAndServingContinues) {
  struct Case {
    std::string name;
    std::function<void(GenerateRequest&)> mutate;
    grpc::StatusCode code;
    std::string message;
  };
  const Case cases[] = {
      {"empty prompt", [](GenerateRequest& r) { r.clear_prompt(); }, grpc::INVALID_ARGUMENT, "prompt is required"},
      {"long prompt", [](GenerateRequest& r) { r.set_prompt(std::string(5000, 'x')); }, grpc::INVALID_ARGUMENT, "at most 4096 bytes"},
      {"long negative", [](GenerateRequest& r) { r.set_negative_prompt(std::string(5000, 'x')); }, grpc::INVALID_ARGUMENT, "negative_prompt"},
      {"width not multiple", [](GenerateRequest& r) { r.set_width(100); }, grpc::INVALID_ARGUMENT, "width is 100; allowed: 64 to 2048 in multiples of 16"},
      {"height too large", [](GenerateRequest& r) { r.set_height(4096); }, grpc::INVALID_ARGUMENT, "height is 4096"},
      {"negative width", [](GenerateRequest& r) { r.set_width(-16); }, grpc::INVALID_ARGUMENT, "width is -16"},
      {"negative steps", [](GenerateRequest& r) { r.set_num_inference_steps(-1); }, grpc::INVALID_ARGUMENT, "num_inference_steps is -1"},
      {"too many steps", [](GenerateRequest& r) { r.set_num_inference_steps(1000); }, grpc::INVALID_ARGUMENT, "allowed: 1 to 100"},
      {"unknown pipeline", [](GenerateRequest& r) { r.set_pipeline("sdxl"); }, grpc::NOT_FOUND, "pipeline 'sdxl' not found; available: zimage-tiny"},
      {"nan guidance", [](GenerateRequest& r) { r.set_guidance_scale(std::nanf("")); }, grpc::INVALID_ARGUMENT, "guidance_scale"},
      {"inf guidance", [](GenerateRequest& r) { r.set_guidance_scale(INFINITY); }, grpc::INVALID_ARGUMENT, "must be finite"},
      {"unknown format", [](GenerateRequest& r) { r.set_output_format(static_cast<v1::ImageFormat>(7)); }, grpc::INVALID_ARGUMENT, "output_format 7 is not supported"},
      {"bad request id", [](GenerateRequest& r) { r.set_request_id("a\nb"); }, grpc::INVALID_ARGUMENT, "request_id"},
  };
  for (const Case& c : cases) {
    GenerateRequest request = Small();
    c.mutate(request);
    GenerateResponse response;
    const grpc::Status status = Call(request, &response);
    EXPECT_EQ(status.error_code(), c.code) << c.name << ": " << status.error_message();
    EXPECT_NE(status.error_message().find(c.message), std::string::npos)
        << c.name << ": " << status.error_message();
  }
  GenerateResponse response;
  EXPECT_TRUE(Call(Small(), &response).ok());
}

TEST_F(ServerE2ETest, DeadlineStopsALongRequestAndTheServerKeepsServing) {
  GenerateRequest request = Small();
  // Long enough on any device (512², guided, 100 steps) to outlast a 150 ms deadline.
  request.set_width(512);
  request.set_height(512);
  request.set_num_inference_steps(100);
  request.set_guidance_scale(5.0f);
  GenerateResponse response;
  const auto start = std::chrono::steady_clock::now();
  const grpc::Status status = Call(request, &response, std::chrono::milliseconds(150));
  EXPECT_EQ(status.error_code(), grpc::DEADLINE_EXCEEDED) << status.error_message();
  // The server stops between steps: the next request runs promptly.
  GenerateResponse next;
  ASSERT_TRUE(Call(Small(), &next).ok());
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

TEST_F(ServerE2ETest, StreamReportsProgressThenTheResult) {
  grpc::ClientContext context;
  GenerateRequest request = Small();
  request.set_num_inference_steps(3);
  auto reader = stub_->GenerateStream(&context, request);
  v1::GenerateStreamResponse message;
  std::vector<int> denoise_steps;
  std::vector<std::string> stages;
  int results = 0;
  bool result_last = false;
  while (reader->Read(&message)) {
    result_last = message.has_result();
    if (message.has_progress()) {
      if (stages.empty() || stages.back() != message.progress().stage()) stages.push_back(message.progress().stage());
      if (message.progress().stage() == "denoise") denoise_steps.push_back(message.progress().step());
      EXPECT_EQ(message.progress().total_steps() == 3 || message.progress().stage() != "denoise", true);
    } else {
      ++results;
      EXPECT_TRUE(DecodePng(message.result().image()).ok());
    }
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(results, 1);
  EXPECT_TRUE(result_last);
  EXPECT_EQ(denoise_steps, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(stages, (std::vector<std::string>{"tokenize", "encode_prompt", "denoise", "decode", "encode_image"}));
}

TEST_F(ServerE2ETest, StreamSendsPreviewsBeforeTheResultAndGenerateRefusesThem) {
  GenerateRequest request = Small();
  request.set_num_inference_steps(6);
  request.set_partial_images(2);
  grpc::ClientContext context;
  auto reader = stub_->GenerateStream(&context, request);
  v1::GenerateStreamResponse message;
  std::vector<std::pair<int, int>> previews;  // (index, step)
  std::string result_png;
  while (reader->Read(&message)) {
    if (message.has_partial_image()) {
      EXPECT_TRUE(result_png.empty()) << "a preview after the result";
      previews.emplace_back(message.partial_image().index(), message.partial_image().step());
      auto image = DecodePng(message.partial_image().image());
      ASSERT_TRUE(image.ok());
      EXPECT_EQ(image->width, message.partial_image().width());
    }
    if (message.has_result()) result_png = message.result().image();
  }
  ASSERT_TRUE(reader->Finish().ok());
  EXPECT_EQ(previews, (std::vector<std::pair<int, int>>{{0, 2}, {1, 4}}));
  // The image is the one the request gives without previews.
  GenerateRequest plain = request;
  plain.set_partial_images(0);
  GenerateResponse unstreamed;
  ASSERT_TRUE(Call(plain, &unstreamed).ok());
  EXPECT_EQ(unstreamed.image(), result_png);
  // Generate has nowhere to send previews; out-of-range counts are refused by both.
  GenerateResponse refused;
  grpc::Status status = Call(request, &refused);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("GenerateStream"), std::string::npos) << status.error_message();
  request.set_partial_images(4);
  grpc::ClientContext too_many_context;
  auto too_many = stub_->GenerateStream(&too_many_context, request);
  while (too_many->Read(&message)) {
  }
  status = too_many->Finish();
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("partial_images"), std::string::npos) << status.error_message();
}

TEST_F(ServerE2ETest, CancelledStreamStopsAndAFullQueueIsRejected) {
  GenerateRequest slow = Small();
  slow.set_width(256);
  slow.set_height(256);
  slow.set_num_inference_steps(100);
  // A: running (we see its progress). B: waiting in the queue (depth 1). C: rejected.
  grpc::ClientContext context_a;
  auto reader_a = stub_->GenerateStream(&context_a, slow);
  v1::GenerateStreamResponse message;
  bool saw_denoise = false;
  while (!saw_denoise && reader_a->Read(&message)) {
    saw_denoise = message.has_progress() && message.progress().stage() == "denoise";
  }
  ASSERT_TRUE(saw_denoise);
  grpc::ClientContext context_b;
  GenerateResponse response_b;
  grpc::Status status_b;
  std::thread b([&] { status_b = stub_->Generate(&context_b, slow, &response_b); });
  // Wait until B sits in the queue, as the queue-depth gauge reports it.
  const std::regex depth_one("\nstowage_queue_depth\\{device=\"" + server_->device_name() + "\"\\} 1\n");
  bool queued = false;
  for (int attempt = 0; attempt < 500 && !queued; ++attempt) {
    queued = std::regex_search(HttpGet(server_->metrics_address(), "/metrics"), depth_one);
    if (!queued) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(queued);  // Not ASSERT: B's thread must still be joined below.
  GenerateResponse response_c;
  const grpc::Status status_c = Call(slow, &response_c, std::chrono::milliseconds(5000));
  EXPECT_EQ(status_c.error_code(), grpc::RESOURCE_EXHAUSTED);
  EXPECT_NE(status_c.error_message().find("queue"), std::string::npos) << status_c.error_message();
  context_a.TryCancel();
  context_b.TryCancel();
  while (reader_a->Read(&message)) {
  }
  EXPECT_EQ(reader_a->Finish().error_code(), grpc::CANCELLED);
  b.join();
  EXPECT_EQ(status_b.error_code(), grpc::CANCELLED);
  GenerateResponse ok;
  EXPECT_TRUE(Call(Small(), &ok).ok());
}

// Before any request, every counter an alert or a rate reads is already there, at 0.
TEST(MetricsFromStartTest, EveryCounterIsExportedAtZeroBeforeTheFirstRequest) {
  v1::ServerConfig config;
  config.set_grpc_address("127.0.0.1:0");
  config.set_metrics_address("127.0.0.1:0");
  auto server = StowageServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string page = HttpGet((*server)->metrics_address(), "/metrics");
  const std::string device = (*server)->device_name();
  for (const std::string& series :
       {std::string(R"(stowage_requests_total{code="ok",pipeline="zimage-tiny"} 0)"),
        std::string(R"(stowage_requests_total{code="resource_exhausted",pipeline="zimage-tiny"} 0)"),
        std::string(R"(stowage_requests_total{code="internal",pipeline="zimage-tiny"} 0)"),
        std::string(R"(stowage_request_duration_seconds_count{pipeline="zimage-tiny"} 0)"),
        std::string(R"(stowage_tenant_requests_total{code="ok",priority="0",tenant="default"} 0)"),
        "stowage_host_to_device_bytes_total{device=\"" + device + "\"} 0",
        "stowage_queue_depth{device=\"" + device + "\"} 0",
        "stowage_placement_oom_recoveries_total{device=\"" + device + "\"} 0"}) {
    EXPECT_NE(page.find("\n" + series + "\n"), std::string::npos) << series;
  }
}

TEST_F(ServerE2ETest, MetricsPageHoldsTheRequestsValues) {
  GenerateResponse good;
  ASSERT_TRUE(Call(Small(), &good).ok());
  GenerateResponse response = good;
  GenerateRequest bad = Small();
  bad.set_width(3);
  ASSERT_EQ(Call(bad, &response).error_code(), grpc::INVALID_ARGUMENT);
  const std::string page = HttpGet(server_->metrics_address(), "/metrics");
  ASSERT_FALSE(page.empty());
  auto value = [&](const std::string& series) -> double {
    const std::regex re("\n" + series + " ([0-9.e+-]+)");
    std::smatch match;
    if (!std::regex_search(page, match, re)) return -1;
    return std::stod(match[1]);
  };
  EXPECT_GE(value(R"(stowage_requests_total\{code="ok",pipeline="zimage-tiny"\})"), 1);
  EXPECT_GE(value(R"(stowage_requests_total\{code="invalid_argument",pipeline="zimage-tiny"\})"), 1);
  EXPECT_GE(value(R"(stowage_request_peak_device_memory_bytes_count\{pipeline="zimage-tiny"\})"), 1);
  // The histogram's sum holds the replies' peaks: at least this reply's.
  EXPECT_GE(value(R"(stowage_request_peak_device_memory_bytes_sum\{pipeline="zimage-tiny"\})"),
            static_cast<double>(response.stats().peak_device_memory_bytes()));
  EXPECT_GE(value(R"(stowage_request_peak_cpu_rss_bytes_sum\{pipeline="zimage-tiny"\})"),
            static_cast<double>(response.stats().peak_cpu_rss_bytes()));
  EXPECT_GE(value(R"(stowage_request_duration_seconds_count\{pipeline="zimage-tiny"\})"), 2);
  // Every stage the successful reply timed is a series of its own (the failed request has none).
  ASSERT_GE(good.stats().stages_size(), 4);
  for (const v1::StageTiming& stage : good.stats().stages()) {
    const std::string labels = R"(\{pipeline="zimage-tiny",stage=")" + stage.stage() + R"("\})";
    const double seconds = static_cast<double>(stage.duration().seconds()) + stage.duration().nanos() * 1e-9;
    EXPECT_GE(value("stowage_request_stage_seconds_count" + labels), 1) << stage.stage();
    EXPECT_GE(value("stowage_request_stage_seconds_sum" + labels), seconds * 0.999) << stage.stage();
  }
  EXPECT_EQ(value("stowage_queue_depth\\{device=\"" + server_->device_name() + "\"\\}"), 0);
  EXPECT_GT(value("stowage_process_resident_memory_bytes"), 1 << 20);
}

// Starts a server with `config`, sends the same 64x64 3-step request `requests` times and returns the
// last reply; `while_serving` runs before the server stops.
GenerateResponse GenerateLantern(const v1::ServerConfig& config, int requests,
                                 const std::function<void()>& while_serving = nullptr) {
  auto server = StowageServer::Start(config);
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return GenerateResponse();
  auto stub = v1::GenerationService::NewStub(
      grpc::CreateChannel((*server)->grpc_address(), grpc::InsecureChannelCredentials()));
  GenerateRequest request;
  request.set_prompt("a lantern");
  request.set_width(64);
  request.set_height(64);
  request.set_num_inference_steps(3);
  request.set_seed(4);
  GenerateResponse response;
  for (int i = 0; i < requests; ++i) {
    grpc::ClientContext context;
    EXPECT_TRUE(stub->Generate(&context, request, &response).ok());
  }
  if (while_serving) while_serving();
  return response;
}

TEST(ServerGroupOffloadE2ETest, ConfiguredGroupOffloadKeepsTheImageAndLowersPeakDeviceMemory) {
  // The second request sees the steady state.
  auto generate = [](const v1::ServerConfig& config) { return GenerateLantern(config, 2); };
  v1::ServerConfig plain;
  plain.set_grpc_address("127.0.0.1:0");
  plain.set_metrics_address("none");
  v1::ServerConfig offloaded = plain;
  v1::PipelineConfig* pipeline = offloaded.add_pipelines();
  pipeline->set_name(kDefaultPipelineName);  // The same pipeline as the default one.
  pipeline->set_builtin(kDefaultPipelineName);
  pipeline->mutable_group_offload()->set_enabled(true);
  pipeline->mutable_group_offload()->mutable_defaults()->set_use_stream(true);
  pipeline->mutable_group_offload()->add_exclude("text_encoder");
  pipeline->mutable_group_offload()->add_exclude("vae");
  const GenerateResponse a = generate(plain);
  const GenerateResponse b = generate(offloaded);
  EXPECT_EQ(a.image(), b.image());
  EXPECT_LT(b.stats().peak_device_memory_bytes(), a.stats().peak_device_memory_bytes());
  EXPECT_GT(b.stats().host_to_device_bytes(), 0);  // Groups stream in on every request.
}

// PipelineConfig.host_spill_dir on a real server: the random weights live in a removed, mapped file and
// the image is the same; a directory that does not exist stops the start with the field named.
TEST(ServerSpillE2ETest, SpilledHostCopiesServeTheSameImageAndABadDirectoryIsRefused) {
  // Also counts this process's mappings of spill files (the server runs in it).
  auto generate = [](const v1::ServerConfig& config, const std::string& dir, int* spill_mappings) {
    return GenerateLantern(config, 1, [&] { *spill_mappings = CountSpillMappings(dir); });
  };
  v1::ServerConfig plain;
  plain.set_grpc_address("127.0.0.1:0");
  plain.set_metrics_address("none");
  v1::ServerConfig spilled = plain;
  v1::PipelineConfig* pipeline = spilled.add_pipelines();
  pipeline->set_name(kDefaultPipelineName);
  pipeline->set_builtin(kDefaultPipelineName);
  const std::string dir = MakeSpillTestDir();
  ASSERT_FALSE(dir.empty());
  pipeline->set_host_spill_dir(dir);
  int plain_mappings = -1, spill_mappings = -1;
  const GenerateResponse a = generate(plain, dir, &plain_mappings);
  const GenerateResponse b = generate(spilled, dir, &spill_mappings);
  EXPECT_EQ(plain_mappings, 0);
  EXPECT_GE(spill_mappings, 3) << "each component's weights are views of its own spill file";
  EXPECT_FALSE(a.image().empty());
  EXPECT_EQ(a.image(), b.image());
  EXPECT_EQ(std::system(("test -z \"$(ls -A '" + dir + "')\"").c_str()), 0) << "nothing is left in " << dir;

  pipeline->set_host_spill_dir(dir + "/gone");
  auto refused = StowageServer::Start(spilled);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(std::string(refused.status().message()).find("host_spill_dir"), std::string::npos) << refused.status();
}

// The budget covers what the GPU would see: the device's context counts against it, the reply's
// reserved peak includes it, and placement makes room accordingly (exact bytes on the simulator).
TEST(ServerDeviceMemoryE2ETest, TheContextCountsInTheBudgetAndInTheReportedPeak) {
  auto run = [](int64_t context_bytes, int64_t budget_bytes, GenerateResponse* response,
                v1::GetPlacementResponse* placement) {
    v1::ServerConfig config;
    config.set_grpc_address("127.0.0.1:0");
    config.set_metrics_address("none");
    config.mutable_auth()->set_admin_token("t");
    config.mutable_device()->set_kind(v1::DeviceConfig::KIND_SIMULATED);
    config.mutable_device()->set_simulated_context_bytes(context_bytes);
    config.mutable_device()->set_memory_budget_bytes(budget_bytes);
    auto server = StowageServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    auto channel = grpc::CreateChannel((*server)->grpc_address(), grpc::InsecureChannelCredentials());
    GenerateRequest request;
    request.set_prompt("a lantern");
    request.set_width(64);
    request.set_height(64);
    request.set_num_inference_steps(2);
    request.set_seed(4);
    grpc::ClientContext context;
    ASSERT_TRUE(v1::GenerationService::NewStub(channel)->Generate(&context, request, response).ok());
    grpc::ClientContext admin;
    admin.AddMetadata("authorization", "Bearer t");
    ASSERT_TRUE(v1::AdminService::NewStub(channel)->GetPlacement(&admin, {}, placement).ok());
  };
  // Unbudgeted: every component the request ran stays resident (the VAE's encoder, which a
  // text-to-image request does not run, stays where it was loaded); the reserved peak is the placed
  // peak plus context.
  GenerateResponse free_run;
  v1::GetPlacementResponse free_placement;
  constexpr int64_t kContext = 3 << 20;
  run(kContext, 0, &free_run, &free_placement);
  EXPECT_EQ(free_placement.context_bytes(), kContext);
  EXPECT_EQ(free_run.stats().peak_device_reserved_bytes(), free_run.stats().peak_device_memory_bytes() + kContext);
  int64_t weights = 0;
  for (const auto& c : free_placement.components()) {
    if (absl::EndsWith(c.id(), "/vae_encoder")) continue;
    EXPECT_EQ(c.state(), v1::ComponentPlacement::RESIDENT) << c.id();
    weights += c.weight_bytes();
  }
  // A budget that holds all the weights but not the weights and the context: something must move.
  GenerateResponse tight_run;
  v1::GetPlacementResponse tight_placement;
  run(kContext, weights + kContext - 1, &tight_run, &tight_placement);
  EXPECT_EQ(tight_run.image(), free_run.image());
  EXPECT_LE(tight_run.stats().peak_device_reserved_bytes(), weights + kContext - 1);
  int resident = 0, ran = 0;
  for (const auto& c : tight_placement.components()) {
    if (absl::EndsWith(c.id(), "/vae_encoder")) continue;
    ++ran;
    resident += c.state() == v1::ComponentPlacement::RESIDENT ? 1 : 0;
  }
  EXPECT_EQ(ran, 3);
  EXPECT_LT(resident, ran);
}

}  // namespace
}  // namespace stowage
