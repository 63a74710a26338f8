// LoRA adapters end to end on a real in-process server over loopback: AdminService.LoadAdapter
// reads a PEFT-layout safetensors file for zimage-tiny's transformer, ListPipelines lists it, a
// request naming it (gRPC loras, HTTP "loras") changes the image, scale 0 and no adapter give the
// base image, the same request gives the same image, UnloadAdapter removes it; files and requests
// that do not fit are refused naming what was wrong, and the server stays healthy.
#include <algorithm>
#include <cmath>
#include <map>
#include <thread>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "google/protobuf/text_format.h"
#include "models/core/layers.h"
#include "models/pipelines/zimage_pipeline.h"
#include "offload/safetensors.h"
#include "runtime/config.h"
#include "tests/e2e/http_client.h"
#include "tests/e2e/queued_together.h"
#include "tests/e2e/same_image.h"

namespace stowage {
namespace {

// The Linear layers of zimage-tiny's transformer: path → (in, out).
std::map<std::string, std::pair<int64_t, int64_t>> TransformerLinears() {
  std::map<std::string, std::pair<int64_t, int64_t>> out;
  auto pipeline = CreateTinyZImagePipeline(ZImagePipelineOptions{});
  EXPECT_TRUE(pipeline.ok()) << pipeline.status();
  for (Component* c : (*pipeline)->components()) {
    if (c->name() != "transformer") continue;
    c->module().ForEachModule([&](Module& m) {
      if (auto* l = dynamic_cast<Linear*>(&m)) out[m.path()] = {l->in_features(), l->out_features()};
    });
  }
  return out;
}

// A layer's key prefix and A / B suffixes in the PEFT / diffusers layout, or in kohya's
// ("lora_unet_" and the path with '_' for '.', lora_down / lora_up).
struct KeyNames {
  std::string prefix, a, b;
};
KeyNames Keys(const std::string& path, bool kohya) {
  if (!kohya) return {"transformer." + path, ".lora_A.weight", ".lora_B.weight"};
  std::string flat = path;
  std::replace(flat.begin(), flat.end(), '.', '_');
  return {"lora_unet_" + flat, ".lora_down.weight", ".lora_up.weight"};
}

// A rank-4 LoRA on every attention projection ("attention." in the path), random but fixed (the
// same matrices in either layout).
std::string WriteAdapter(const std::string& name, double magnitude, bool wrong_shape = false,
                         const std::string& bogus_layer = "", bool kohya = false) {
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  at::Generator gen = at::detail::createCPUGenerator(17);
  for (const auto& [path, dims] : TransformerLinears()) {
    if (path.find("attention.") == std::string::npos) continue;
    const KeyNames k = Keys(path, kohya);
    tensors.emplace_back(k.prefix + k.a, at::randn({4, dims.first + (wrong_shape ? 1 : 0)}, gen) * magnitude);
    tensors.emplace_back(k.prefix + k.b, at::randn({dims.second, 4}, gen) * magnitude);
    tensors.emplace_back(k.prefix + ".alpha", at::full({}, 4.0));
  }
  if (!bogus_layer.empty()) {
    const KeyNames k = Keys(bogus_layer, kohya);
    tensors.emplace_back(k.prefix + k.a, at::ones({4, 8}));
    tensors.emplace_back(k.prefix + k.b, at::ones({8, 4}));
  }
  EXPECT_FALSE(tensors.empty());
  const std::string path = std::string(::testing::TempDir()) + "/" + name + ".safetensors";
  EXPECT_TRUE(WriteSafetensors(path, tensors).ok());
  return path;
}

class LoraE2eTest : public HttpTest {
 protected:
  // Starts the server with `config` (text format) added to the defaults, a metrics endpoint on.
  void StartWith(const std::string& text) {
    v1::ServerConfig config;
    config.set_metrics_address("127.0.0.1:0");
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(text, &config)) << text;
    Start(config);
  }
  grpc::Status Load(const std::string& name, const std::string& path, v1::LoadAdapterResponse* response = nullptr) {
    v1::LoadAdapterRequest request;
    request.set_pipeline("zimage-tiny");
    request.set_name(name);
    request.set_path(path);
    v1::LoadAdapterResponse ignored;
    return server_->admin().LoadAdapter(E2eServer::Authed().get(), request, response != nullptr ? response : &ignored);
  }
  grpc::Status Unload(const std::string& name) {
    v1::UnloadAdapterRequest request;
    request.set_pipeline("zimage-tiny");
    request.set_name(name);
    v1::UnloadAdapterResponse ignored;
    return server_->admin().UnloadAdapter(E2eServer::Authed().get(), request, &ignored);
  }
  std::string Image(const std::vector<std::pair<std::string, float>>& loras, grpc::Status* status = nullptr) {
    v1::GenerateRequest request = E2eServer::SmallRequest("zimage-tiny", 7);
    for (const auto& [name, scale] : loras) {
      v1::LoraRef* ref = request.add_loras();
      ref->set_name(name);
      ref->set_scale(scale);
    }
    v1::GenerateResponse response;
    const grpc::Status s = server_->Generate(request, &response);
    if (status != nullptr) *status = s;
    EXPECT_TRUE(status != nullptr || s.ok()) << s.error_message();
    return response.image();
  }
};

TEST_F(LoraE2eTest, AnAdapterChangesTheImageOnlyWhereARequestNamesIt) {
  Start();
  const std::string base = Image({});
  v1::LoadAdapterResponse loaded;
  ASSERT_TRUE(Load("style", WriteAdapter("style", 0.5), &loaded).ok());
  EXPECT_EQ(loaded.adapter().rank(), 4);
  EXPECT_GT(loaded.adapter().layers(), 0);
  EXPECT_GT(loaded.adapter().bytes(), 0);
  EXPECT_EQ(loaded.adapter().components(0), "transformer");
  v1::ListPipelinesResponse list;
  ASSERT_TRUE(server_->Pipelines(&list).ok());
  bool listed = false;
  for (const v1::Pipeline& p : list.pipelines()) {
    for (const v1::Adapter& a : p.adapters()) listed = listed || (p.name() == "zimage-tiny" && a.name() == "style");
  }
  EXPECT_TRUE(listed);
  // GetPlacement lists it too, with its pipeline and its bytes on the device.
  auto placement_adapters = [&] {
    v1::GetPlacementResponse placement;
    EXPECT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &placement).ok());
    return placement;
  };
  const v1::GetPlacementResponse with = placement_adapters();
  ASSERT_EQ(with.adapters_size(), 1);
  EXPECT_EQ(with.adapters(0).name(), "style");
  EXPECT_EQ(with.adapters(0).pipeline(), "zimage-tiny");
  EXPECT_EQ(with.adapters(0).bytes(), loaded.adapter().bytes());

  const std::string styled = Image({{"style", 1.0f}});
  EXPECT_NE(styled, base) << "the adapter changed nothing";
  EXPECT_EQ(Image({{"style", 1.0f}}), styled) << "the same request gave another image";
  EXPECT_EQ(Image({{"style", 0.0f}}), base) << "scale 0 is no adapter";
  EXPECT_NE(Image({{"style", 0.5f}}), styled);
  EXPECT_EQ(Image({}), base) << "a request without adapters saw one";

  // The same through the HTTP API's "loras".
  const HttpResponse http = Post(http_, R"({"model": "zimage-tiny", "prompt": "a small red square", "size": "64x64",
      "num_inference_steps": 2, "seed": 7, "loras": [{"name": "style", "scale": 1.0}]})");
  ASSERT_EQ(http.status, 200) << http.body.substr(0, 300);
  std::string png;
  ASSERT_TRUE(absl::Base64Unescape(
      Field(Json(http.body).fields().at("data").list_value().values(0).struct_value(), "b64_json"), &png));
  EXPECT_EQ(png, styled);

  ASSERT_TRUE(Unload("style").ok());
  EXPECT_EQ(placement_adapters().adapters_size(), 0);
  grpc::Status status;
  Image({{"style", 1.0f}}, &status);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("has no adapter"), std::string::npos) << status.error_message();
  EXPECT_EQ(Image({}), base);
}

// Adapters are placed like components: each loaded adapter is a component of its pipeline in
// GetPlacement ("<pipeline>/lora:<name>", its bytes, off the device until used), moved onto the
// device by placement when a request uses it (logged, with why), counted in the device budget with
// everything else, never group-offloaded, and gone from placement when unloaded.
TEST_F(LoraE2eTest, AnAdapterIsAPlacementComponentCountedInTheBudget) {
  // Room for the pipeline's largest component, the adapter and activations, not for everything:
  // components move, and the adapter stays while its request runs.
  StartWith(R"pb(device { kind: KIND_SIMULATED memory_budget_bytes: 4000000 }
                 pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true })pb");
  v1::LoadAdapterResponse loaded;
  ASSERT_TRUE(Load("style", WriteAdapter("placed_style", 0.5), &loaded).ok());
  auto placement = [&] {
    v1::GetPlacementResponse p;
    EXPECT_TRUE(server_->admin().GetPlacement(E2eServer::Authed().get(), v1::GetPlacementRequest(), &p).ok());
    return p;
  };
  auto find = [](const v1::GetPlacementResponse& p) -> const v1::ComponentPlacement* {
    for (const v1::ComponentPlacement& c : p.components()) {
      if (c.id() == "zimage-tiny/lora:style") return &c;
    }
    return nullptr;
  };
  v1::GetPlacementResponse before = placement();
  const v1::ComponentPlacement* adapter = find(before);
  ASSERT_NE(adapter, nullptr);
  EXPECT_EQ(adapter->weight_bytes(), loaded.adapter().bytes());
  EXPECT_EQ(adapter->kind(), "LoraAdapter");
  EXPECT_EQ(adapter->state(), v1::ComponentPlacement::OFFLOADED);

  const std::string base = Image({});
  const std::string styled = Image({{"style", 1.0f}});
  EXPECT_NE(styled, base);
  v1::GetPlacementLogRequest log_request;
  log_request.set_limit(500);
  v1::GetPlacementLogResponse log;
  ASSERT_TRUE(server_->admin().GetPlacementLog(E2eServer::Authed().get(), log_request, &log).ok());
  bool onloaded = false;
  for (const auto& d : log.decisions()) {
    if (d.component() == "zimage-tiny/lora:style" && d.action() == "onload") {
      onloaded = true;
      EXPECT_NE(d.reason().find("adapter 'style' used by req-"), std::string::npos) << d.reason();
    }
  }
  EXPECT_TRUE(onloaded) << log.DebugString().substr(0, 3000);
  const v1::GetPlacementResponse after = placement();
  EXPECT_LE(after.allocated_bytes(), 4000000);

  v1::EnableGroupOffloadRequest offload;
  offload.set_component_id("zimage-tiny/lora:style");
  v1::EnableGroupOffloadResponse offloaded;
  const grpc::Status refused = server_->admin().EnableGroupOffload(E2eServer::Authed().get(), offload, &offloaded);
  EXPECT_EQ(refused.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("is a LoRA adapter"), std::string::npos) << refused.error_message();
  // A whole-pipeline call leaves the adapter as it is (and succeeds).
  v1::EnableGroupOffloadRequest whole;
  whole.set_pipeline("zimage-tiny");
  EXPECT_TRUE(server_->admin().EnableGroupOffload(E2eServer::Authed().get(), whole, &offloaded).ok());
  EXPECT_EQ(Image({{"style", 1.0f}}), styled);

  ASSERT_TRUE(Unload("style").ok());
  EXPECT_EQ(find(placement()), nullptr);
}

// Requests naming different adapters (one, another with guidance: two batch rows, both at other
// scales, none) queued together run as ONE batch, each row with its own adapters, and each image
// is the image the request gets alone (byte for byte on the simulated device).
TEST_F(LoraE2eTest, RequestsWithDifferentAdaptersShareABatchAndEachGetsItsImageAlone) {
  StartWith(R"pb(pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true
                       batching { max_batch_size: 4 max_queue_delay_ms: 5000 } })pb");
  ASSERT_TRUE(Load("ink", WriteAdapter("mixed_ink", 0.5)).ok());
  ASSERT_TRUE(Load("gold", WriteAdapter("mixed_gold", 0.3, false, "", /*kohya=*/true)).ok());
  std::vector<v1::GenerateRequest> requests;
  const std::vector<std::vector<std::pair<std::string, float>>> loras = {
      {{"ink", 1.0f}}, {{"gold", 1.0f}}, {{"ink", 0.5f}, {"gold", -0.7f}}, {}};
  for (size_t i = 0; i < loras.size(); ++i) {
    v1::GenerateRequest r = E2eServer::SmallRequest("zimage-tiny", static_cast<uint64_t>(20 + i));
    r.set_output_format(v1::IMAGE_FORMAT_RGB);
    if (i == 1) {  // Guided: two rows of the batch carry its adapter.
      r.set_guidance_scale(2.0f);
      r.set_negative_prompt("blurry");
    }
    for (const auto& [name, scale] : loras[i]) {
      v1::LoraRef* ref = r.add_loras();
      ref->set_name(name);
      ref->set_scale(scale);
    }
    requests.push_back(r);
  }
  std::vector<grpc::Status> statuses(requests.size());
  std::vector<v1::GenerateResponse> batched(requests.size());
  {
    LongRequest holder(server_->generation(), "zimage-tiny");
    ASSERT_TRUE(holder.running());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < requests.size(); ++i) {
      threads.emplace_back([&, i] { statuses[i] = server_->Generate(requests[i], &batched[i]); });
    }
    EXPECT_TRUE(WaitForQueueDepth(server_->server().metrics_address(), DeviceNameOf(v1::DeviceConfig()),
                                  static_cast<int>(requests.size())));
    EXPECT_TRUE(holder.Finish());
    for (std::thread& t : threads) t.join();
  }
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << i << ": " << statuses[i].error_message();
    EXPECT_EQ(batched[i].stats().batch_size(), 4) << i;
  }
  // Alone (a lone client's request runs at once, a batch of one).
  std::vector<v1::GenerateResponse> alone(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(server_->Generate(requests[i], &alone[i]).ok()) << i;
    EXPECT_EQ(alone[i].stats().batch_size(), 1) << i;
    ExpectSameImage(batched[i], alone[i], "request " + std::to_string(i));
  }
  // The adapters did act: the first request without its adapter draws another image.
  v1::GenerateRequest plain = requests[0];
  plain.clear_loras();
  v1::GenerateResponse base;
  ASSERT_TRUE(server_->Generate(plain, &base).ok());
  EXPECT_NE(base.image(), alone[0].image());
  ExpectHealthy();
}

// The same adapter in kohya's layout, loaded over admin: its underscored names are matched onto
// the pipeline's layers and it draws exactly what the PEFT-layout file draws; a kohya name that
// matches no layer is refused naming it, nothing stays attached, and the server keeps serving.
TEST_F(LoraE2eTest, AKohyaLayoutFileDrawsWhatThePeftLayoutDraws) {
  Start();
  v1::LoadAdapterResponse peft, kohya;
  ASSERT_TRUE(Load("peft", WriteAdapter("peft", 0.5), &peft).ok());
  ASSERT_TRUE(Load("kohya", WriteAdapter("kohya", 0.5, false, "", /*kohya=*/true), &kohya).ok());
  EXPECT_EQ(kohya.adapter().layers(), peft.adapter().layers());
  EXPECT_EQ(kohya.adapter().bytes(), peft.adapter().bytes());
  const std::string with_peft = Image({{"peft", 1.0f}});
  EXPECT_NE(with_peft, Image({}));
  EXPECT_EQ(Image({{"kohya", 1.0f}}), with_peft);
  const grpc::Status bogus = Load("bogus", WriteAdapter("bogus", 0.5, false, "layers.0.attention.to_z", true));
  EXPECT_EQ(bogus.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(bogus.error_message().find("kohya layer 'transformer.layers_0_attention_to_z' matches no Linear"),
            std::string::npos)
      << bogus.error_message();
  grpc::Status status;
  Image({{"bogus", 1.0f}}, &status);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);  // Not loaded.
  EXPECT_TRUE(HealthServing(server_->channel()));
}

TEST_F(LoraE2eTest, FilesAndRequestsThatDoNotFitAreRefusedNamingWhatWasWrong) {
  Start();
  ASSERT_TRUE(Load("ok", WriteAdapter("ok", 0.1)).ok());
  struct Case {
    std::string name, path;
    grpc::StatusCode code;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"shape", WriteAdapter("shape", 0.1, /*wrong_shape=*/true), grpc::INVALID_ARGUMENT, "the pipeline's is"},
      {"bogus", WriteAdapter("bogus", 0.1, false, "layers.99.nothing"), grpc::INVALID_ARGUMENT,
       "'transformer.layers.99.nothing' is no Linear layer"},
      {"missing", "/nonexistent/adapter.safetensors", grpc::NOT_FOUND, "adapter.safetensors"},
      {"ok", WriteAdapter("again", 0.1), grpc::ALREADY_EXISTS, "already has an adapter named 'ok'"},
      {"bad name!", WriteAdapter("named", 0.1), grpc::INVALID_ARGUMENT, "is not 1..64 characters"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const grpc::Status status = Load(c.name, c.path);
    EXPECT_EQ(status.error_code(), c.code) << status.error_message();
    EXPECT_NE(status.error_message().find(c.needle), std::string::npos) << status.error_message();
  }
  // Nothing of a refused file stays attached: the base image is unchanged by "ok" at scale 0 and
  // the refused names are unknown.
  grpc::Status status;
  Image({{"shape", 1.0f}}, &status);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  for (const auto& [loras, needle] : std::vector<std::pair<std::vector<std::pair<std::string, float>>, std::string>>{
           {{{"ok", 11.0f}}, "loras[0].scale is 11"},
           {{{"ok", 1.0f}, {"ok", 1.0f}}, "named twice"},
           {{{"ok", 0.0f}, {"ok", 1.0f}}, "named twice"},
           {{{"ok", NAN}}, "scale is nan"},
       }) {
    Image(loras, &status);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << needle;
    EXPECT_NE(status.error_message().find(needle), std::string::npos) << status.error_message();
  }
  EXPECT_EQ(Unload("nope").error_code(), grpc::NOT_FOUND);
  for (const std::string& body : {std::string(R"({"prompt": "x", "loras": "ok"})"),
                                  std::string(R"({"prompt": "x", "loras": [{"name": "ok", "scale": "1"}]})"),
                                  std::string(R"({"prompt": "x", "loras": [{"name": "ok", "weight": 1}]})"),
                                  std::string(R"({"prompt": "x", "loras": [{"scale": 1}]})")}) {
    SCOPED_TRACE(body);
    const HttpResponse r = Post(http_, body);
    EXPECT_EQ(r.status, 400);
    EXPECT_EQ(Field(ErrorOf(r), "param"), "loras");
  }
  ExpectHealthy();
}

// Unloading a pipeline takes its adapters with it: loaded again, it has none, and a request naming
// one is refused.
TEST_F(LoraE2eTest, AnUnloadedPipelinesAdaptersGoWithIt) {
  Start();
  ASSERT_TRUE(Load("style", WriteAdapter("style_unload", 0.5)).ok());
  {
    v1::UnloadPipelineRequest unload;
    unload.set_name("zimage-tiny");
    v1::UnloadPipelineResponse ignored;
    ASSERT_TRUE(server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &ignored).ok());
  }
  {
    v1::LoadPipelineRequest load;
    load.mutable_pipeline()->set_name("zimage-tiny");
    load.mutable_pipeline()->set_builtin("zimage-tiny");
    v1::LoadPipelineResponse loaded;
    ASSERT_TRUE(server_->admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded).ok());
    EXPECT_EQ(loaded.pipeline().adapters_size(), 0);
  }
  grpc::Status status;
  Image({{"style", 1.0f}}, &status);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << status.error_message();
  EXPECT_NE(status.error_message().find("has no adapter"), std::string::npos) << status.error_message();
  // The same name loads again, fresh.
  EXPECT_TRUE(Load("style", WriteAdapter("style_unload", 0.5)).ok());
  ExpectHealthy();
}

// An adapter unloaded while requests naming it wait in the queue: they fail saying so (the unload
// runs at the worker's next boundary, before them), nothing else does, and the server stays healthy.
TEST_F(LoraE2eTest, UnloadingAnAdapterWhileRequestsNamingItQueueFailsThemCleanly) {
  v1::ServerConfig config;
  config.set_metrics_address("127.0.0.1:0");
  Start(config);
  ASSERT_TRUE(Load("style", WriteAdapter("style_queued", 0.5)).ok());
  LongRequest long_request(server_->generation(), "zimage-tiny");
  ASSERT_TRUE(long_request.running());
  std::vector<grpc::Status> statuses(2);
  std::vector<std::thread> queued;
  for (int i = 0; i < 2; ++i) queued.emplace_back([&, i] { Image({{"style", 1.0f}}, &statuses[i]); });
  ASSERT_TRUE(WaitForQueueDepth(server_->server().metrics_address(), DeviceNameOf(v1::DeviceConfig()), 2));
  // Returns once the worker ran it: after the long request, before the two queued ones.
  ASSERT_TRUE(Unload("style").ok());
  EXPECT_TRUE(long_request.Finish());
  for (std::thread& t : queued) t.join();
  for (const grpc::Status& status : statuses) {
    EXPECT_EQ(status.error_code(), grpc::FAILED_PRECONDITION) << status.error_message();
    EXPECT_NE(status.error_message().find("adapter 'style' was unloaded"), std::string::npos) << status.error_message();
  }
  ExpectHealthy();
}

// The same with batching on: requests with and without the adapter queue together as one mixed
// batch; the unload runs before it, so the members naming the adapter fail saying so and the
// member without it still gets its image (its image alone), in the same batch.
TEST_F(LoraE2eTest, UnloadingAnAdapterUnderAMixedBatchFailsOnlyTheMembersNamingIt) {
  StartWith(R"pb(pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true
                       batching { max_batch_size: 3 max_queue_delay_ms: 5000 } })pb");
  ASSERT_TRUE(Load("style", WriteAdapter("style_mixed_unload", 0.5)).ok());
  const std::vector<std::vector<std::pair<std::string, float>>> loras = {{{"style", 1.0f}}, {}, {{"style", 0.5f}}};
  std::vector<grpc::Status> statuses(loras.size());
  std::vector<v1::GenerateResponse> responses(loras.size());
  {
    LongRequest holder(server_->generation(), "zimage-tiny");
    ASSERT_TRUE(holder.running());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < loras.size(); ++i) {
      threads.emplace_back([&, i] {
        v1::GenerateRequest request = E2eServer::SmallRequest("zimage-tiny", 7);
        request.set_output_format(v1::IMAGE_FORMAT_RGB);
        for (const auto& [name, scale] : loras[i]) {
          v1::LoraRef* ref = request.add_loras();
          ref->set_name(name);
          ref->set_scale(scale);
        }
        statuses[i] = server_->Generate(request, &responses[i]);
      });
    }
    ASSERT_TRUE(WaitForQueueDepth(server_->server().metrics_address(), DeviceNameOf(v1::DeviceConfig()),
                                  static_cast<int>(loras.size())));
    ASSERT_TRUE(Unload("style").ok());  // Runs at the worker's next boundary: before the batch.
    EXPECT_TRUE(holder.Finish());
    for (std::thread& t : threads) t.join();
  }
  for (size_t i : {size_t{0}, size_t{2}}) {
    EXPECT_EQ(statuses[i].error_code(), grpc::FAILED_PRECONDITION) << i << ": " << statuses[i].error_message();
    EXPECT_NE(statuses[i].error_message().find("adapter 'style' was unloaded"), std::string::npos)
        << statuses[i].error_message();
  }
  ASSERT_TRUE(statuses[1].ok()) << statuses[1].error_message();
  EXPECT_EQ(responses[1].stats().batch_size(), 3);
  v1::GenerateRequest plain = E2eServer::SmallRequest("zimage-tiny", 7);
  plain.set_output_format(v1::IMAGE_FORMAT_RGB);
  v1::GenerateResponse alone;
  ASSERT_TRUE(server_->Generate(plain, &alone).ok());
  ExpectSameImage(responses[1], alone, "the member without the adapter");
  ExpectHealthy();
}

TEST_F(LoraE2eTest, HostileAdapterCallsAndRequestsAreRefusedNamingTheField) {
  Start();
  ASSERT_TRUE(Load("ok", WriteAdapter("hostile_ok", 0.1)).ok());
  grpc::Status status;
  std::vector<std::pair<std::string, float>> nine;
  for (int i = 0; i < 9; ++i) nine.emplace_back("ok", 1.0f);
  Image(nine, &status);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(status.error_message().find("at most 8"), std::string::npos) << status.error_message();
  Image({{std::string(100000, 'n'), 1.0f}}, &status);
  EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_LT(status.error_message().size(), 600u) << "a huge name is echoed whole";
  for (const float alpha : {-1.0f, NAN, INFINITY}) {
    v1::LoadAdapterRequest request;
    request.set_pipeline("zimage-tiny");
    request.set_name("a");
    request.set_path(WriteAdapter("hostile_alpha", 0.1));
    request.set_alpha(alpha);
    v1::LoadAdapterResponse ignored;
    status = server_->admin().LoadAdapter(E2eServer::Authed().get(), request, &ignored);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << alpha;
    EXPECT_NE(status.error_message().find("alpha"), std::string::npos) << status.error_message();
  }
  {
    v1::LoadAdapterRequest request;  // No pipeline, no path.
    request.set_name("a");
    v1::LoadAdapterResponse ignored;
    status = server_->admin().LoadAdapter(E2eServer::Authed().get(), request, &ignored);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT);
    EXPECT_NE(status.error_message().find("pipeline"), std::string::npos) << status.error_message();
  }
  const HttpResponse many = Post(http_, R"({"prompt": "x", "loras": [)" + [] {
    std::string items;
    for (int i = 0; i < 9; ++i) items += std::string(i ? "," : "") + R"({"name": "ok"})";
    return items;
  }() + "]}");
  EXPECT_EQ(many.status, 400);
  EXPECT_EQ(Field(ErrorOf(many), "param"), "loras");
  ExpectHealthy();
}

}  // namespace
}  // namespace stowage
