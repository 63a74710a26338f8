// The OpenAI-compatible HTTP front of a real in-process server over loopback: generation through
// HTTP and gRPC on the same core (same images, same metrics), the models list, API keys, a full
// queue (429) and shutdown (503). Hostile clients: http_hostile_e2e_test.cc.

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "runtime/config.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_client.h"
#include "tests/e2e/http_get.h"
#include "tests/runtime/runtime_state.h"

namespace stowage {
namespace {

// --- Generation --------------------------------------------------------------------------------

TEST_F(HttpTest, GeneratesPngsWithSeedsAndStatsOnTheSameCoreAsGrpc) {
  v1::ServerConfig config;
  config.set_metrics_address("127.0.0.1:0");
  Start(config);
  HttpResponse r = Post(http_, R"({"prompt": "a small red square", "size": "64x64", "num_inference_steps": 2,
                                         "seed": 7, "n": 2, "response_format": "b64_json"})");
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 500);
  EXPECT_EQ(r.headers["content-type"], "application/json");
  EXPECT_EQ(r.headers["x-stowage-seed"], "7,8");
  EXPECT_EQ(r.headers["x-stowage-pipeline"], "zimage-tiny");
  EXPECT_EQ(r.headers["x-stowage-device"], DeviceNameOf(v1::DeviceConfig()));
  int64_t peak = 0;
  EXPECT_TRUE(absl::SimpleAtoi(r.headers["x-stowage-peak-device-memory-bytes"], &peak));
  EXPECT_GT(peak, 0);
  EXPECT_TRUE(r.headers.count("x-stowage-peak-cpu-rss-bytes"));
  EXPECT_TRUE(r.headers.count("x-stowage-queue-wait-seconds"));

  const google::protobuf::Struct body = Json(r.body);
  EXPECT_GT(body.fields().at("created").number_value(), 1.6e9);
  const auto& data = body.fields().at("data").list_value().values();
  ASSERT_EQ(data.size(), 2);
  std::vector<std::string> pngs;
  for (int i = 0; i < 2; ++i) {
    const auto& item = data[i].struct_value().fields();
    std::string png;
    ASSERT_TRUE(absl::Base64Unescape(item.at("b64_json").string_value(), &png));
    int width = 0, height = 0;
    ASSERT_TRUE(PngSize(png, &width, &height)) << "not a PNG";
    EXPECT_EQ(width, 64);
    EXPECT_EQ(height, 64);
    EXPECT_EQ(item.at("seed").number_value(), 7 + i);
    EXPECT_EQ(item.at("stats").struct_value().fields().at("device").string_value(), DeviceNameOf(v1::DeviceConfig()));
    pngs.push_back(png);
  }
  EXPECT_NE(pngs[0], pngs[1]) << "seeds 7 and 8 drew the same image";

  // The same request over gRPC draws the same image: one core behind both fronts.
  v1::GenerateRequest request;
  request.set_prompt("a small red square");
  request.set_width(64);
  request.set_height(64);
  request.set_num_inference_steps(2);
  request.set_seed(7);
  v1::GenerateResponse grpc_response;
  ASSERT_TRUE(server_->Generate(request, &grpc_response).ok());
  EXPECT_EQ(grpc_response.image(), pngs[0]);

  // Both fronts count in the same metrics: 2 HTTP images + 1 gRPC request.
  const std::string metrics = HttpGet(server_->server().metrics_address(), "/metrics");
  EXPECT_NE(metrics.find("stowage_requests_total{code=\"ok\",pipeline=\"zimage-tiny\"} 3"), std::string::npos)
      << metrics.substr(0, 2000);
  EXPECT_NE(metrics.find("stowage_request_peak_device_memory_bytes_count{pipeline=\"zimage-tiny\"} 3"),
            std::string::npos);

  // A request the core refuses is counted too, under its code.
  EXPECT_EQ(Post(http_, R"({"prompt": "x", "size": "64x72"})").status, 400);
  EXPECT_NE(HttpGet(server_->server().metrics_address(), "/metrics")
                .find("stowage_requests_total{code=\"invalid_argument\",pipeline=\"zimage-tiny\"} 1"),
            std::string::npos);
}

TEST_F(HttpTest, ModelsListsThePipelinesAndRetrievesOne) {
  Start(SlowConfig(4));
  const HttpResponse list = Get(http_, "/v1/models");
  ASSERT_EQ(list.status, 200) << list.body;
  const google::protobuf::Struct body = Json(list.body);
  EXPECT_EQ(Field(body, "object"), "list");
  std::vector<std::string> ids;
  for (const auto& model : body.fields().at("data").list_value().values()) {
    EXPECT_EQ(Field(model.struct_value(), "object"), "model");
    ids.push_back(Field(model.struct_value(), "id"));
  }
  EXPECT_EQ(ids, (std::vector<std::string>{"zimage-tiny", "tiny"}));
  const HttpResponse one = Get(http_, "/v1/models/tiny");
  ASSERT_EQ(one.status, 200);
  EXPECT_EQ(Field(Json(one.body).fields().at("stowage").struct_value(), "state"), "PIPELINE_READY");
  // A name too long for the 16 KiB request head: refused or the connection closed.
  const HttpResponse missing = Get(http_, "/v1/models/" + std::string(100000, 'm'));
  EXPECT_TRUE(missing.status == 0 || (missing.status >= 400 && missing.status < 500)) << missing.status;
  EXPECT_EQ(Field(ErrorOf(Get(http_, "/v1/models/" + std::string(10000, 'm'))), "code"), "model_not_found");
  const HttpResponse unknown = Get(http_, "/v1/models/nope");
  EXPECT_EQ(unknown.status, 404);
  EXPECT_EQ(Field(ErrorOf(unknown), "code"), "model_not_found");
}

// --- API key ------------------------------------------------------------------------------------

TEST_F(HttpTest, AnApiKeyGuardsTheApiButNotHealth) {
  v1::ServerConfig config;
  config.mutable_auth()->set_api_key("sk-stowage-test");
  Start(config);
  struct Case {
    std::string name, header;
    int status;
  };
  const std::vector<Case> cases = {
      {"none", "", 401},
      {"wrong", "Authorization: Bearer sk-stowage-tesT\r\n", 401},
      {"prefix", "Authorization: Bearer sk-stowage\r\n", 401},
      {"longer", "Authorization: Bearer sk-stowage-test-and-more\r\n", 401},
      {"not bearer", "Authorization: Basic c2stc3Rvd2FnZS10ZXN0\r\n", 401},
      {"bare key", "Authorization: sk-stowage-test\r\n", 401},
      {"huge", "Authorization: Bearer " + std::string(10000, 'k') + "\r\n", 401},
      {"right", "Authorization: Bearer sk-stowage-test\r\n", 200},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    HttpResponse generated = Post(http_, kSmall, c.header);
    EXPECT_EQ(generated.status, c.status) << generated.body.substr(0, 300);
    const HttpResponse models = Get(http_, "/v1/models", c.header);
    EXPECT_EQ(models.status, c.status);
    EXPECT_EQ(Get(http_, "/v1/placement", c.header).status, c.status);
    if (c.status == 401) {
      EXPECT_EQ(Field(ErrorOf(generated), "code"), "invalid_api_key");
      EXPECT_EQ(generated.headers["www-authenticate"], "Bearer");
    }
  }
  EXPECT_EQ(Get(http_, "/health").status, 200);
  // The placement page holds no data: it is served without the key (its data endpoint needs it).
  EXPECT_EQ(Get(http_, "/placement").status, 200);
}

// --- Placement ------------------------------------------------------------------------------------

// GET /v1/placement is every device's GetPlacement (what the admin API answers), as JSON; GET
// /placement is the page that draws it.
TEST_F(HttpTest, PlacementIsEveryDevicesGetPlacement) {
  Start(SlowConfig(4));
  ASSERT_EQ(Post(http_, kSmall).status, 200);  // Something placed on the device.
  const HttpResponse r = Get(http_, "/v1/placement");
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 300);
  const google::protobuf::Struct body = Json(r.body);
  const auto& devices = body.fields().at("devices").list_value().values();
  ASSERT_EQ(devices.size(), 1u);
  const auto& device = devices[0].struct_value();
  v1::GetPlacementResponse placement;
  ASSERT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
  EXPECT_EQ(Field(device, "device"), placement.device());
  EXPECT_EQ(Field(device, "budget_bytes"), std::to_string(placement.budget_bytes()));
  EXPECT_EQ(Field(device, "strategy"), placement.strategy());
  const auto& components = device.fields().at("components").list_value().values();
  ASSERT_EQ(components.size(), static_cast<size_t>(placement.components_size()));
  int64_t on_device = 0;
  for (int i = 0; i < placement.components_size(); ++i) {
    const auto& c = components[i].struct_value();
    EXPECT_EQ(Field(c, "id"), placement.components(i).id());
    EXPECT_EQ(Field(c, "weight_bytes"), std::to_string(placement.components(i).weight_bytes()));
    EXPECT_EQ(Field(c, "state"), v1::ComponentPlacement::State_Name(placement.components(i).state()));
    on_device += placement.components(i).device_bytes();
  }
  EXPECT_GT(on_device, 0);

  const HttpResponse page = Get(http_, "/placement");
  ASSERT_EQ(page.status, 200);
  EXPECT_EQ(page.headers.at("content-type"), "text/html; charset=utf-8");
  EXPECT_NE(page.headers.at("content-security-policy").find("default-src 'none'"), std::string::npos);
  EXPECT_NE(page.body.find("fetch(\"/v1/placement\""), std::string::npos);
  EXPECT_EQ(Post(http_, kSmall, "", milliseconds(30000)).status, 200);
  EXPECT_EQ(Exchange(http_, "POST /v1/placement HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").status, 405);
}

// --- Queue, shutdown -----------------------------------------------------------------------------

TEST_F(HttpTest, AFullQueueAnswers429ButARequestsOwnImagesNeverOverflowIt) {
  Start(SlowConfig(1));
  // Three images on a queue that holds one beside the running one: the request's own images wait
  // for each other instead of failing.
  const HttpResponse three = Post(http_, SlowBody(2, 3));
  ASSERT_EQ(three.status, 200) << three.body.substr(0, 300);
  EXPECT_EQ(Json(three.body).fields().at("data").list_value().values_size(), 3);
  EXPECT_EQ(three.headers.at("x-stowage-seed"), "1,2,3");

  // Other requests fill it: one running (about 3 s), one waiting, and the next is refused.
  HttpResponse running, waiting;
  const DeviceSet& devices = server_->server().devices();
  std::thread a([&] { running = Post(http_, SlowBody(30)); });
  EXPECT_TRUE(AwaitState([&] { return RunningRequests(devices) == 1; }));
  std::thread b([&] { waiting = Post(http_, SlowBody(2)); });
  EXPECT_TRUE(AwaitState([&] { return QueuedRequests(devices) == 1; }));
  const HttpResponse refused = Post(http_, SlowBody(2));
  a.join();
  b.join();
  ASSERT_EQ(refused.status, 429) << refused.body.substr(0, 300);
  EXPECT_EQ(refused.headers.count("retry-after") ? refused.headers.at("retry-after") : "", "1");  // Busy: retry.
  const google::protobuf::Struct error = ErrorOf(refused);
  EXPECT_EQ(Field(error, "type"), "rate_limit_error");
  EXPECT_EQ(Field(error, "code"), "queue_full");
  EXPECT_EQ(running.status, 200);
  EXPECT_EQ(waiting.status, 200);
  EXPECT_TRUE(HealthServing(server_->channel()));
}

TEST_F(HttpTest, ShutdownLetsRunningRequestsFinishAndRefusesNewOnes) {
  Start(SlowConfig(4));
  // `quick` (about a second) finishes within the 5 s grace; `long_one` (four images of 100 slow
  // steps, queued behind it) cannot, and is stopped when the grace ends.
  HttpResponse quick, long_one;
  const DeviceSet& devices = server_->server().devices();
  std::thread a([&] { quick = Post(http_, SlowBody(10)); });
  EXPECT_TRUE(AwaitState([&] { return RunningRequests(devices) == 1; }));
  std::thread b([&] { long_one = Post(http_, SlowBody(100, 4)); });
  EXPECT_TRUE(AwaitState([&] { return QueuedRequests(devices) >= 1; }));
  const auto start = steady_clock::now();
  std::thread stopper([&] { server_->server().Shutdown(); });
  // Shutdown has begun once health says so.
  EXPECT_TRUE(AwaitState([&] { return Get(http_, "/health").status == 503; }));
  const HttpResponse refused = Post(http_, kSmall);
  EXPECT_EQ(refused.status, 503) << refused.body;
  EXPECT_EQ(Field(ErrorOf(refused), "code"), "shutting_down");
  EXPECT_EQ(Get(http_, "/health").status, 503);
  stopper.join();
  a.join();
  b.join();
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(9));
  EXPECT_EQ(quick.status, 200) << quick.body.substr(0, 300);
  EXPECT_EQ(long_one.status, 503) << long_one.body.substr(0, 300);
  EXPECT_NE(Field(ErrorOf(long_one), "message").find("shutting down"), std::string::npos);
  // Stopped: nothing listens any more.
  EXPECT_EQ(ConnectTo(http_) < 0 ? 0 : 1, 0);
}

}  // namespace
}  // namespace stowage
