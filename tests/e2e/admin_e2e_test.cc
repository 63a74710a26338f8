// The admin API end to end over loopback gRPC: authentication, placement inspection, strategies,
// group offloading, pipeline load/unload and the decision log.
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <memory>
#include <map>
#include <set>
#include <string>
#include <thread>

#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "models/core/fused_ops.h"
#include "google/protobuf/text_format.h"
#include "models/pipelines/tiny_pipeline.h"
#include "runtime/config.h"
#include "server/admin_service.h"
#include "server/server.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"
#include "tests/offload/spill_dir.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

namespace stowage {
namespace {

constexpr char kToken[] = "s3cret-admin-token";

class AdminE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::ServerConfig config;
    config.set_grpc_address("127.0.0.1:0");
    config.set_metrics_address("127.0.0.1:0");
    config.mutable_auth()->set_admin_token(kToken);
    auto server = StowageServer::Start(config);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto channel = grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials());
    admin_ = v1::AdminService::NewStub(channel);
    generation_ = v1::GenerationService::NewStub(channel);
  }

  std::unique_ptr<grpc::ClientContext> Authed(const std::string& token = kToken) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->AddMetadata("authorization", "Bearer " + token);
    return context;
  }

  grpc::Status Generate(const std::string& pipeline, v1::GenerateResponse* response) {
    v1::GenerateRequest request;
    request.set_pipeline(pipeline);
    request.set_prompt("a windmill");
    request.set_width(64);
    request.set_height(64);
    request.set_num_inference_steps(2);
    request.set_seed(8);
    request.set_request_id("admin-e2e");
    grpc::ClientContext context;
    return generation_->Generate(&context, request, response);
  }

  // EnableGroupOffload of one component, streamed (with `compress`, if any).
  grpc::Status StreamComponent(const std::string& component_id, v1::EnableGroupOffloadResponse* response,
                               v1::GroupOffloadConfig::Compress compress = v1::GroupOffloadConfig::COMPRESS_NONE) {
    v1::EnableGroupOffloadRequest enable;
    enable.set_component_id(component_id);
    enable.mutable_options()->set_use_stream(true);
    enable.mutable_options()->set_compress(compress);
    return admin_->EnableGroupOffload(Authed().get(), enable, response);
  }

  v1::GetPlacementResponse Placement() {
    v1::GetPlacementResponse response;
    EXPECT_TRUE(admin_->GetPlacement(Authed().get(), {}, &response).ok());
    return response;
  }

  std::unique_ptr<StowageServer> server_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
  std::unique_ptr<v1::GenerationService::Stub> generation_;
};

TEST_F(AdminE2ETest, RequiresTheBearerToken) {
  v1::GetPlacementResponse response;
  grpc::ClientContext none;
  EXPECT_EQ(admin_->GetPlacement(&none, {}, &response).error_code(), grpc::UNAUTHENTICATED);
  grpc::ClientContext malformed;
  malformed.AddMetadata("authorization", kToken);
  EXPECT_EQ(admin_->GetPlacement(&malformed, {}, &response).error_code(), grpc::UNAUTHENTICATED);
  EXPECT_EQ(admin_->GetPlacement(Authed("wrong").get(), {}, &response).error_code(), grpc::PERMISSION_DENIED);
  EXPECT_EQ(admin_->GetPlacement(Authed(std::string(kToken) + "x").get(), {}, &response).error_code(),
            grpc::PERMISSION_DENIED);
  EXPECT_TRUE(admin_->GetPlacement(Authed().get(), {}, &response).ok());
}

TEST_F(AdminE2ETest, PlacementStrategiesAndGroupOffload) {
  v1::GenerateResponse before;
  ASSERT_TRUE(Generate("", &before).ok());
  v1::GetPlacementResponse placement = Placement();
  EXPECT_EQ(placement.device(), server_->device_name());
  EXPECT_EQ(placement.strategy(), "footprint");
  ASSERT_EQ(placement.components_size(), 4);
  for (const auto& c : placement.components()) {
    if (c.name() == "vae_encoder") continue;  // Runs only for images in; this request had none.
    EXPECT_EQ(c.state(), v1::ComponentPlacement::RESIDENT) << c.id();
    EXPECT_EQ(c.device_bytes(), c.weight_bytes());
    EXPECT_TRUE(c.has_last_use());
  }

  // A rule set naming an unknown component is refused whole; the strategy stays.
  v1::SetOffloadStrategyRequest bad;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(R"pb(
    strategy { workflow { rules { after { component: "text_encoder" offload: "text_encoder" } }
                          rules { before { component: "unet" offload: "vae" } } } })pb", &bad));
  v1::SetOffloadStrategyResponse set;
  grpc::Status refused = admin_->SetOffloadStrategy(Authed().get(), bad, &set);
  EXPECT_EQ(refused.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("strategy.workflow.rules[1]: unknown component 'unet'"), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(Placement().strategy(), "footprint");
  v1::SetOffloadStrategyRequest unknown_custom;
  unknown_custom.mutable_strategy()->set_custom("magic");
  EXPECT_EQ(admin_->SetOffloadStrategy(Authed().get(), unknown_custom, &set).error_code(), grpc::NOT_FOUND);

  // Workflow: the text encoder leaves right after it ran.
  v1::SetOffloadStrategyRequest workflow;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(R"pb(
    strategy { workflow { rules { after { component: "text_encoder" offload: "text_encoder" } }
                          rules { keep_resident: "vae" } } })pb", &workflow));
  ASSERT_TRUE(admin_->SetOffloadStrategy(Authed().get(), workflow, &set).ok());
  EXPECT_EQ(set.strategy(), "workflow");
  v1::GenerateResponse after_rules;
  ASSERT_TRUE(Generate("", &after_rules).ok());
  EXPECT_EQ(after_rules.image(), before.image());
  const v1::GetPlacementResponse after_workflow = Placement();
  for (const auto& c : after_workflow.components()) {
    if (c.name() == "vae_encoder") continue;  // Never run by text to image.
    EXPECT_EQ(c.state(), c.name() == "text_encoder" ? v1::ComponentPlacement::OFFLOADED
                                                    : v1::ComponentPlacement::RESIDENT) << c.id();
  }

  // Group-offload the transformer; with the footprint strategy back, a warning says why it is odd.
  v1::EnableGroupOffloadResponse enabled;
  ASSERT_TRUE(StreamComponent("zimage-tiny/transformer", &enabled).ok());
  ASSERT_EQ(enabled.components_size(), 1);
  EXPECT_EQ(enabled.components(0).state(), v1::ComponentPlacement::GROUP_OFFLOADED);
  EXPECT_GT(enabled.components(0).group_offload().streamed_groups(), 0);
  EXPECT_LT(enabled.components(0).device_bytes(), enabled.components(0).weight_bytes());
  EXPECT_EQ(StreamComponent("zimage-tiny/transformer", &enabled).error_code(), grpc::FAILED_PRECONDITION);
  v1::SetOffloadStrategyRequest footprint;
  footprint.mutable_strategy()->mutable_footprint()->set_reserve_bytes(0);
  ASSERT_TRUE(admin_->SetOffloadStrategy(Authed().get(), footprint, &set).ok());
  ASSERT_EQ(set.warnings_size(), 1);
  EXPECT_EQ(Placement().warnings_size(), 1);
  // The same facts on the Prometheus page (device: the server's default, cuda:0 where there is a GPU).
  const std::string dev = DeviceNameOf(v1::DeviceConfig());
  const std::string page = HttpGet(server_->metrics_address(), "/metrics");
  EXPECT_NE(page.find("stowage_component_state{component=\"zimage-tiny/transformer\",state=\"group_offloaded\",device=\"" + dev + "\"} 1"),
            std::string::npos) << page;
  EXPECT_NE(page.find("stowage_placement_evictions_total{strategy=\"workflow\",cause=\"after_run\",device=\"" + dev + "\"} 1"),
            std::string::npos) << page;
  EXPECT_NE(page.find("stowage_placement_group_offload_warning{device=\"" + dev + "\"} 1"), std::string::npos);
  EXPECT_NE(page.find("stowage_placement_onloads_total{device=\"" + dev + "\"} 3"), std::string::npos);
  v1::GenerateResponse grouped;
  ASSERT_TRUE(Generate("", &grouped).ok());
  EXPECT_EQ(grouped.image(), before.image());
  // The group-offload families carry the placement view's figures for the transformer.
  {
    const std::string grouped_page = HttpGet(server_->metrics_address(), "/metrics");
    const v1::GetPlacementResponse placement = Placement();
    v1::ComponentPlacement transformer;
    for (const auto& c : placement.components()) {
      if (c.id() == "zimage-tiny/transformer") transformer = c;
    }
    const auto& g = transformer.group_offload();
    ASSERT_GT(g.forwards(), 0);
    // Streamed through its ring, its requests' last steps copied none of a next step's groups: the
    // server's runner passed the pipeline's hint (LastRunNext) to placement.
    ASSERT_GT(g.streamed_groups(), g.slots());
    EXPECT_GT(g.prefetches_skipped_after_last(), 0);
    for (const std::string& line :
         {"stowage_group_offload_forwards_total{component=\"zimage-tiny/transformer\",device=\"" + dev + "\"} " +
              std::to_string(g.forwards()),
          "stowage_group_offload_bytes{component=\"zimage-tiny/transformer\",kind=\"working_set\",device=\"" + dev + "\"} " +
              std::to_string(g.working_set_bytes()),
          "stowage_group_offload_onloads_total{component=\"zimage-tiny/transformer\",how=\"sync\",device=\"" + dev + "\"} " +
              std::to_string(g.sync_onloads()),
          std::string("stowage_group_offload_slot_releases_total{component=\"zimage-tiny/transformer\",device=\"" + dev + "\"} ")}) {
      EXPECT_NE(grouped_page.find(line), std::string::npos) << line << "\n" << grouped_page;
    }
    EXPECT_EQ(grouped_page.find("stowage_group_offload_forwards_total{component=\"zimage-tiny/vae\"}"),
              std::string::npos);  // Only group-offloaded components have these series.
  }
  v1::DisableGroupOffloadRequest disable;
  disable.set_component_id("zimage-tiny/transformer");
  v1::DisableGroupOffloadResponse disabled;
  ASSERT_TRUE(admin_->DisableGroupOffload(Authed().get(), disable, &disabled).ok());
  EXPECT_EQ(disabled.components(0).state(), v1::ComponentPlacement::OFFLOADED);
  EXPECT_EQ(Placement().warnings_size(), 0);

  // The decision log holds what happened, with the request's id.
  v1::GetPlacementLogRequest log_request;
  log_request.set_limit(1000);
  v1::GetPlacementLogResponse log;
  ASSERT_TRUE(admin_->GetPlacementLog(Authed().get(), log_request, &log).ok());
  bool onload = false, workflow_offload = false;
  for (const auto& d : log.decisions()) {
    onload |= d.action() == "onload" && d.request_id() == "admin-e2e";
    workflow_offload |= d.action() == "offload" && d.strategy() == "workflow" && d.component() == "zimage-tiny/text_encoder";
  }
  EXPECT_TRUE(onload);
  EXPECT_TRUE(workflow_offload);
  log_request.set_limit(-1);
  EXPECT_EQ(admin_->GetPlacementLog(Authed().get(), log_request, &log).error_code(), grpc::INVALID_ARGUMENT);
}

// SetMemoryBudget at run time: a smaller budget moves whole components to the host, least recently
// used first, until what is allocated fits (listed in the reply and the placement log); requests then
// run within it; hostile values are refused by name and change nothing; a budget that what cannot
// move (a group-offloaded working set) does not fit is refused, naming it; 0 lifts the budget; the
// server answers health checks throughout. Budgets count the device's context (a CUDA context on the
// GPU host, 0 on the simulator).
TEST_F(AdminE2ETest, TheMemoryBudgetChangesAtRunTime) {
  v1::GenerateResponse reply;
  ASSERT_TRUE(Generate("", &reply).ok());
  v1::GetPlacementResponse placement = Placement();
  const int64_t unbudgeted = placement.budget_bytes();  // No limit (simulated) or the card's size (CUDA).
  int64_t resident = 0;
  for (const auto& c : placement.components()) {
    if (c.state() == v1::ComponentPlacement::RESIDENT) resident += c.device_bytes();
  }
  ASSERT_GT(resident, 0);
  ASSERT_GE(placement.allocated_bytes(), resident);
  // A byte short of what is allocated. On CUDA the allocator also holds what is not a component's
  // weights (library workspaces; device caches such as captured graphs, which go first): when those
  // alone make room, nothing moves, and the next byte-short budget (from what is allocated now)
  // must move weights.
  int64_t budget = 0;
  v1::SetMemoryBudgetRequest request;
  v1::SetMemoryBudgetResponse response;
  for (int attempt = 0; attempt < 3 && response.offloaded_size() == 0; ++attempt) {
    placement = Placement();
    budget = placement.context_bytes() + placement.allocated_bytes() - 1;
    request.set_memory_budget_bytes(budget);
    const grpc::Status set = admin_->SetMemoryBudget(Authed().get(), request, &response);
    ASSERT_TRUE(set.ok()) << set.error_message();
  }
  EXPECT_EQ(response.budget_bytes(), budget);
  EXPECT_LE(response.allocated_bytes(), budget);
  ASSERT_GE(response.offloaded_size(), 1);
  EXPECT_EQ(response.offloaded(0), "zimage-tiny/text_encoder");  // It ran first: least recently used.
  placement = Placement();
  EXPECT_EQ(placement.budget_bytes(), budget);
  for (const auto& c : placement.components()) {
    if (c.id() == response.offloaded(0)) EXPECT_EQ(c.state(), v1::ComponentPlacement::OFFLOADED);
  }
  v1::GetPlacementLogRequest log_request;
  log_request.set_limit(50);
  v1::GetPlacementLogResponse log;
  ASSERT_TRUE(admin_->GetPlacementLog(Authed().get(), log_request, &log).ok());
  bool set = false, moved = false;
  for (const auto& d : log.decisions()) {
    set |= d.action() == "set_budget" && d.bytes() == budget;
    moved |= d.action() == "offload" && d.component() == response.offloaded(0) &&
             d.reason().find(absl::StrCat("memory budget set to ", budget, " bytes")) != std::string::npos;
  }
  EXPECT_TRUE(set);
  EXPECT_TRUE(moved);
  // Requests run within the new budget.
  ASSERT_TRUE(Generate("", &reply).ok());
  EXPECT_LE(reply.stats().peak_device_memory_bytes(), budget);

  // Hostile values: refused by name; the budget stays.
  request.set_memory_budget_bytes(-1);
  grpc::Status refused = admin_->SetMemoryBudget(Authed().get(), request, &response);
  EXPECT_EQ(refused.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("memory_budget_bytes: -1"), std::string::npos) << refused.error_message();
  request.set_memory_budget_bytes(budget / 2);
  request.set_device("sim:9");
  EXPECT_EQ(admin_->SetMemoryBudget(Authed().get(), request, &response).error_code(), grpc::NOT_FOUND);
  request.clear_device();
  grpc::ClientContext anonymous;
  EXPECT_EQ(admin_->SetMemoryBudget(&anonymous, request, &response).error_code(), grpc::UNAUTHENTICATED);
  EXPECT_EQ(Placement().budget_bytes(), budget);

  // A larger budget moves nothing; requests have room again (the byte-short budget leaves a streamed
  // transformer's working set none on CUDA).
  placement = Placement();
  const int64_t roomy = placement.context_bytes() + placement.allocated_bytes() + (int64_t{512} << 20);
  request.set_memory_budget_bytes(roomy);
  ASSERT_TRUE(admin_->SetMemoryBudget(Authed().get(), request, &response).ok());
  EXPECT_EQ(response.offloaded_size(), 0);
  EXPECT_EQ(Placement().budget_bytes(), roomy);

  // What cannot move does not fit: refused, naming it, nothing changed. The transformer group-
  // offloaded with a budget that keeps most of its groups resident: those stay on the device.
  int64_t transformer = 0;
  placement = Placement();
  for (const auto& c : placement.components()) {
    if (c.id() == "zimage-tiny/transformer") transformer = c.weight_bytes();
  }
  v1::EnableGroupOffloadRequest enable;
  enable.set_component_id("zimage-tiny/transformer");
  enable.mutable_options()->set_use_stream(true);
  enable.mutable_options()->set_budget_bytes(transformer - 1);
  v1::EnableGroupOffloadResponse enabled;
  const grpc::Status streamed = admin_->EnableGroupOffload(Authed().get(), enable, &enabled);
  ASSERT_TRUE(streamed.ok()) << streamed.error_message();
  ASSERT_TRUE(Generate("", &reply).ok());
  request.set_memory_budget_bytes(Placement().context_bytes() + 1);  // Room for a byte beside the context.
  refused = admin_->SetMemoryBudget(Authed().get(), request, &response);
  EXPECT_EQ(refused.error_code(), grpc::FAILED_PRECONDITION);
  EXPECT_NE(refused.error_message().find("zimage-tiny/transformer (group-offloaded working set, "), std::string::npos)
      << refused.error_message();
  EXPECT_EQ(Placement().budget_bytes(), roomy);
  // A huge budget: the simulator takes it (no limit in effect), CUDA refuses one above the card.
  request.set_memory_budget_bytes(INT64_MAX);
  refused = admin_->SetMemoryBudget(Authed().get(), request, &response);
  EXPECT_TRUE(refused.ok() || (refused.error_code() == grpc::INVALID_ARGUMENT &&
                               refused.error_message().find("exceeds") != std::string::npos))
      << refused.error_message();
  // 0 lifts it.
  request.set_memory_budget_bytes(0);
  ASSERT_TRUE(admin_->SetMemoryBudget(Authed().get(), request, &response).ok());
  EXPECT_EQ(response.budget_bytes(), unbudgeted);
  EXPECT_EQ(response.offloaded_size(), 0);
  ASSERT_TRUE(Generate("", &reply).ok());
  EXPECT_TRUE(HealthServing(grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials())));
}

TEST_F(AdminE2ETest, LoadAndUnloadPipelines) {
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("second");
  load.mutable_pipeline()->set_builtin("tiny");
  load.mutable_pipeline()->set_weight_seed(5);
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), load, &loaded).ok());
  EXPECT_EQ(loaded.pipeline().name(), "second");
  EXPECT_FALSE(loaded.pipeline().is_default());
  EXPECT_EQ(admin_->LoadPipeline(Authed().get(), load, &loaded).error_code(), grpc::ALREADY_EXISTS);
  v1::LoadPipelineRequest bad;
  bad.mutable_pipeline()->set_name("Bad Name");
  bad.mutable_pipeline()->set_builtin("tiny");
  EXPECT_EQ(admin_->LoadPipeline(Authed().get(), bad, &loaded).error_code(), grpc::INVALID_ARGUMENT);
  // FP8 compute: where the device cannot run FP8 GEMMs (the simulated device; CI's LibTorch has no
  // float8 either) the load is refused before anything loads, with the code Fp8Supported gives,
  // naming the field and the device; on a CUDA device with FP8 it loads and says so.
  v1::LoadPipelineRequest fp8;
  fp8.mutable_pipeline()->set_name("fp8");
  fp8.mutable_pipeline()->set_builtin("zimage-tiny");
  fp8.mutable_pipeline()->set_dtype("bfloat16");
  (*fp8.mutable_pipeline()->mutable_compute())["transformer"] = v1::COMPUTE_FP8;
  const std::string device = server_->device_name();
  const absl::Status supported = fused::Fp8Supported(
      device.rfind("cuda:", 0) == 0 ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU));
  const grpc::Status result = admin_->LoadPipeline(Authed().get(), fp8, &loaded);
  if (supported.ok()) {
    ASSERT_TRUE(result.ok()) << result.error_message();
    bool converted = false;
    for (const auto& c : loaded.pipeline().components()) converted |= c.name() == "transformer" && c.compute() == "fp8";
    EXPECT_TRUE(converted);
    // Streamed: the FP8 weights and their scales travel as they are (half the bf16 bytes) and go
    // into the FP8 GEMMs without widening — the image is the resident one's, byte for byte.
    v1::GenerateResponse resident, streamed;
    ASSERT_TRUE(Generate("fp8", &resident).ok());
    v1::EnableGroupOffloadResponse streaming;
    ASSERT_TRUE(StreamComponent("fp8/transformer", &streaming).ok());
    ASSERT_EQ(streaming.components_size(), 1);
    EXPECT_EQ(streaming.components(0).state(), v1::ComponentPlacement::GROUP_OFFLOADED);
    EXPECT_EQ(streaming.components(0).compute(), "fp8");
    ASSERT_TRUE(Generate("fp8", &streamed).ok());
    EXPECT_EQ(streamed.image(), resident.image());
    EXPECT_GT(streamed.stats().host_to_device_bytes(), 0);
    // Streamed from an int4 copy of the FP8 weights: made from the FP8 host copy when streaming is
    // switched on at run time (two passes), or with the FP8 form itself in one pass over the bf16
    // weights when the pipeline loads group-offloaded with COMPRESS_INT4 — the same bytes on the
    // device, so the same image.
    v1::GenerateResponse two_passes, one_pass, written_later;
    v1::DisableGroupOffloadRequest disable;
    v1::DisableGroupOffloadResponse disabled;
    disable.set_component_id("fp8/transformer");
    ASSERT_TRUE(admin_->DisableGroupOffload(Authed().get(), disable, &disabled).ok());
    ASSERT_TRUE(StreamComponent("fp8/transformer", &streaming, v1::GroupOffloadConfig::COMPRESS_INT4).ok());
    ASSERT_TRUE(Generate("fp8", &two_passes).ok());
    v1::LoadPipelineRequest fp8_int4 = fp8;
    fp8_int4.mutable_pipeline()->set_name("fp8-int4");
    v1::PipelineGroupOffload* offload = fp8_int4.mutable_pipeline()->mutable_group_offload();
    offload->set_enabled(true);
    offload->mutable_defaults()->set_use_stream(true);
    offload->mutable_defaults()->set_compress(v1::GroupOffloadConfig::COMPRESS_INT4);
    for (const char* other : {"text_encoder", "vae", "vae_encoder"}) offload->add_exclude(other);
    // One pass declares weights in a file's mapping: the drawn ones move into the spill file first.
    const std::string spill_dir = MakeSpillTestDir();
    ASSERT_FALSE(spill_dir.empty());
    fp8_int4.mutable_pipeline()->set_host_spill_dir(spill_dir);
    ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), fp8_int4, &loaded).ok());
    bool int4 = false;
    const v1::GetPlacementResponse placement = Placement();  // Held: the loop reads its components.
    for (const auto& c : placement.components()) {
      int4 |= c.id() == "fp8-int4/transformer" && c.group_offload().compress() == "int4" && c.compute() == "fp8" &&
              c.group_offload().one_pass_fp8_weights() > 0;
    }
    EXPECT_TRUE(int4);
    ASSERT_TRUE(Generate("fp8-int4", &one_pass).ok());
    EXPECT_EQ(one_pass.image(), two_passes.image());
    // Streaming switched off, the one-pass component onloads whole: its FP8 host copy, never made so
    // far, is written first — the resident image.
    disable.set_component_id("fp8-int4/transformer");
    ASSERT_TRUE(admin_->DisableGroupOffload(Authed().get(), disable, &disabled).ok());
    ASSERT_TRUE(Generate("fp8-int4", &written_later).ok());
    EXPECT_EQ(written_later.image(), resident.image());
    v1::UnloadPipelineRequest drop;
    v1::UnloadPipelineResponse dropped;
    for (const char* name : {"fp8", "fp8-int4"}) {
      drop.set_name(name);
      ASSERT_TRUE(admin_->UnloadPipeline(Authed().get(), drop, &dropped).ok()) << name;
    }
  } else {
    EXPECT_EQ(static_cast<int>(result.error_code()), static_cast<int>(supported.code())) << result.error_message();
    EXPECT_NE(result.error_message().find("pipeline.compute: FP8 on device " + device), std::string::npos)
        << result.error_message();
  }
  v1::GenerateResponse a, b;
  ASSERT_TRUE(Generate("second", &a).ok());
  ASSERT_TRUE(Generate("zimage-tiny", &b).ok());
  EXPECT_NE(a.image(), b.image());  // Other weights.
  EXPECT_EQ(Placement().components_size(), 7);  // Z-Image's 4 and the demo's 3.

  // Unload while a long request of that pipeline runs: the unload waits for it.
  v1::GenerateRequest slow;
  slow.set_pipeline("second");
  slow.set_prompt("slow");
  slow.set_width(256);
  slow.set_height(256);
  slow.set_num_inference_steps(40);
  grpc::ClientContext slow_context;
  auto reader = generation_->GenerateStream(&slow_context, slow);
  v1::GenerateStreamResponse message;
  ASSERT_TRUE(reader->Read(&message));  // It is running.
  v1::UnloadPipelineRequest unload;
  unload.set_name("second");
  v1::UnloadPipelineResponse unloaded;
  ASSERT_TRUE(admin_->UnloadPipeline(Authed().get(), unload, &unloaded).ok());
  bool got_result = false;
  while (reader->Read(&message)) got_result |= message.has_result();
  EXPECT_TRUE(reader->Finish().ok());
  EXPECT_TRUE(got_result);  // The in-flight request finished before the pipeline went.
  EXPECT_EQ(Generate("second", &a).error_code(), grpc::NOT_FOUND);
  EXPECT_EQ(Placement().components_size(), 4);
  EXPECT_EQ(admin_->UnloadPipeline(Authed().get(), unload, &unloaded).error_code(), grpc::NOT_FOUND);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// While a load runs, ListPipelines lists the pipeline LOADING with the bytes of weights it has
// brought in so far of those it has met; once READY, no progress. (The transformer's random weights,
// ~110 M parameters, take long enough to be seen at work.)
TEST_F(AdminE2ETest, ALoadingPipelineShowsItsProgress) {
  const std::string dir = std::string(::testing::TempDir()) + "/slow_load_model";
  for (const char* sub : {"", "/text_encoder", "/transformer", "/vae"}) ::mkdir((dir + sub).c_str(), 0755);
  auto write = [&](const std::string& name, const std::string& text) { std::ofstream(dir + "/" + name) << text; };
  write("model_index.json", R"({"_class_name": "StowageTinyPipeline", "text_encoder": ["stowage", "TinyTextEncoder"],
      "transformer": ["stowage", "TinyDiT"], "vae": ["stowage", "TinyVaeDecoder"]})");
  write("text_encoder/config.json",
        R"({"_class_name": "TinyTextEncoder", "vocab_size": 259, "max_tokens": 64, "dim": 64, "heads": 4, "layers": 1})");
  write("transformer/config.json", R"({"_class_name": "TinyDiT", "in_channels": 4, "patch_size": 2, "dim": 1536,
      "heads": 16, "layers": 4, "text_dim": 64, "mlp_ratio": 4, "timestep_dim": 64})");
  write("vae/config.json", R"({"_class_name": "TinyVaeDecoder", "latent_channels": 4, "groups": 8,
      "block_out_channels": [32, 32], "scaling_factor": 1.0, "shift_factor": 0.0})");
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("slow");
  load.mutable_pipeline()->set_model_dir(dir);
  load.mutable_pipeline()->set_random_weights(true);
  std::atomic<bool> done{false};
  grpc::Status status;
  std::thread loader([&] {
    v1::LoadPipelineResponse loaded;
    status = admin_->LoadPipeline(Authed().get(), load, &loaded);
    done = true;
  });
  bool seen_partial = false;
  int64_t seen_total = 0;
  while (!done.load()) {
    grpc::ClientContext context;
    v1::ListPipelinesResponse list;
    if (generation_->ListPipelines(&context, v1::ListPipelinesRequest(), &list).ok()) {
      for (const v1::Pipeline& p : list.pipelines()) {
        if (p.name() != "slow" || p.state() != v1::PIPELINE_LOADING || !p.has_load_progress()) continue;
        const v1::LoadProgress& progress = p.load_progress();
        EXPECT_LE(progress.bytes_read(), progress.bytes_total());
        seen_total = std::max(seen_total, progress.bytes_total());
        seen_partial = seen_partial || (progress.bytes_total() > 0 && progress.bytes_read() < progress.bytes_total());
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  loader.join();
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_TRUE(seen_partial) << "never saw the load part-way";
  EXPECT_GT(seen_total, int64_t{100} << 20);  // The transformer's float32 weights: over 400 MB.
  grpc::ClientContext context;
  v1::ListPipelinesResponse list;
  ASSERT_TRUE(generation_->ListPipelines(&context, v1::ListPipelinesRequest(), &list).ok());
  for (const v1::Pipeline& p : list.pipelines()) {
    if (p.name() == "slow") {
      EXPECT_EQ(p.state(), v1::PIPELINE_READY);
      EXPECT_FALSE(p.has_load_progress());
    }
  }
}

TEST_F(AdminE2ETest, LoadsAPipelineFromAModelDirectory) {
  const std::string dir = std::string(::testing::TempDir()) + "/tiny_model_dir";
  TinyPipelineOptions options;
  options.weight_seed = 77;
  ASSERT_TRUE(SaveTinyPipeline(options, dir).ok());
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("fromdisk");
  load.mutable_pipeline()->set_model_dir(dir);
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), load, &loaded).ok());
  v1::LoadPipelineRequest builtin;
  builtin.mutable_pipeline()->set_name("builtin77");
  builtin.mutable_pipeline()->set_builtin("tiny");
  builtin.mutable_pipeline()->set_weight_seed(77);
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), builtin, &loaded).ok());
  v1::GenerateResponse a, b;
  ASSERT_TRUE(Generate("fromdisk", &a).ok());
  ASSERT_TRUE(Generate("builtin77", &b).ok());
  EXPECT_EQ(a.image(), b.image());  // Same weights, from disk and from the seed.
  // A second pipeline from the same directory shares its components: loaded once, one placement
  // entry used by both pipelines; unloading one leaves them to the other.
  v1::LoadPipelineRequest twin = load;
  twin.mutable_pipeline()->set_name("fromdisk2");
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), twin, &loaded).ok());
  const v1::GetPlacementResponse shared = Placement();
  int shared_entries = 0;
  for (const auto& c : shared.components()) {
    if (c.id().rfind("fromdisk/", 0) == 0) {
      ++shared_entries;
      EXPECT_EQ(c.pipelines_size(), 2) << c.id();
    }
    EXPECT_EQ(c.id().rfind("fromdisk2/", 0), std::string::npos) << "not shared: " << c.id();
  }
  EXPECT_EQ(shared_entries, 3);
  v1::UnloadPipelineRequest unload_first;
  unload_first.set_name("fromdisk");
  v1::UnloadPipelineResponse unloaded;
  ASSERT_TRUE(admin_->UnloadPipeline(Authed().get(), unload_first, &unloaded).ok());
  v1::GenerateResponse c2;
  ASSERT_TRUE(Generate("fromdisk2", &c2).ok());
  EXPECT_EQ(c2.image(), a.image());

  v1::LoadPipelineRequest missing;
  missing.mutable_pipeline()->set_name("nowhere");
  missing.mutable_pipeline()->set_model_dir(dir + "/nope");
  grpc::Status refused = admin_->LoadPipeline(Authed().get(), missing, &loaded);
  EXPECT_EQ(refused.error_code(), grpc::NOT_FOUND);
  EXPECT_NE(refused.error_message().find("pipeline.model_dir: '" + dir + "/nope' does not exist"), std::string::npos)
      << refused.error_message();
}

// Four pipelines, components deduplicated by content: a copy of a model folder shares every
// component with the original (same bytes, another path); a fine-tune drawn with its own transformer
// seed shares the text encoder and VAE with its base and nothing else; a seed for a component the
// pipeline lacks is refused by name.
TEST_F(AdminE2ETest, PipelinesShareComponentsByContent) {
  const std::string dir = std::string(::testing::TempDir()) + "/tiny_dedup_dir";
  const std::string copy = dir + "_copy";
  std::system(("rm -rf '" + dir + "' '" + copy + "'").c_str());
  TinyPipelineOptions options;
  options.weight_seed = 91;
  ASSERT_TRUE(SaveTinyPipeline(options, dir).ok());
  ASSERT_EQ(std::system(("cp -r '" + dir + "' '" + copy + "'").c_str()), 0);
  v1::LoadPipelineResponse loaded;
  auto load = [&](const std::string& name, const std::string& from, bool random,
                  std::map<std::string, uint64_t> seeds) {
    v1::LoadPipelineRequest request;
    request.mutable_pipeline()->set_name(name);
    request.mutable_pipeline()->set_model_dir(from);
    request.mutable_pipeline()->set_random_weights(random);
    request.mutable_pipeline()->set_weight_seed(91);
    for (const auto& [component, seed] : seeds) (*request.mutable_pipeline()->mutable_component_weight_seeds())[component] = seed;
    return admin_->LoadPipeline(Authed().get(), request, &loaded);
  };
  ASSERT_TRUE(load("base", dir, false, {}).ok());
  ASSERT_TRUE(load("copied", copy, false, {}).ok());
  ASSERT_TRUE(load("drawn", dir, true, {}).ok());
  ASSERT_TRUE(load("drawn-ft", copy, true, {{"transformer", 5}}).ok());
  std::map<std::string, std::set<std::string>> users;  // Placement entry → its pipelines.
  const v1::GetPlacementResponse placement = Placement();
  for (const auto& c : placement.components()) {
    for (const std::string& p : c.pipelines()) {
      if (p == "base" || p == "copied" || p == "drawn" || p == "drawn-ft") users[c.id()].insert(p);
    }
  }
  const std::set<std::string> files{"base", "copied"}, drawn{"drawn", "drawn-ft"};
  EXPECT_EQ(users["base/text_encoder"], files);
  EXPECT_EQ(users["base/transformer"], files);
  EXPECT_EQ(users["base/vae"], files);
  EXPECT_EQ(users["drawn/text_encoder"], drawn);
  EXPECT_EQ(users["drawn/vae"], drawn);
  EXPECT_EQ(users["drawn/transformer"], std::set<std::string>{"drawn"});
  EXPECT_EQ(users["drawn-ft/transformer"], std::set<std::string>{"drawn-ft"});
  EXPECT_EQ(users.size(), 7u);
  v1::GenerateResponse base, copied, from_seed, tuned;
  ASSERT_TRUE(Generate("base", &base).ok());
  ASSERT_TRUE(Generate("copied", &copied).ok());
  ASSERT_TRUE(Generate("drawn", &from_seed).ok());
  ASSERT_TRUE(Generate("drawn-ft", &tuned).ok());
  EXPECT_EQ(base.image(), copied.image());
  EXPECT_EQ(base.image(), from_seed.image());  // The folder's weights were drawn from seed 91 too.
  EXPECT_NE(from_seed.image(), tuned.image());

  const grpc::Status refused = load("bad-seed", dir, true, {{"unet", 5}});
  EXPECT_EQ(refused.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(refused.error_message().find("pipeline.component_weight_seeds: 'unet' is not a component of pipeline "
                                         "'bad-seed'"),
            std::string::npos)
      << refused.error_message();
  const grpc::Status from_files = load("file-seed", dir, false, {{"transformer", 5}});
  EXPECT_EQ(from_files.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(from_files.error_message().find("seeds draw random weights"), std::string::npos) << from_files.error_message();
}

TEST_F(AdminE2ETest, AModelFileTruncatedUnderTheServerFailsItsRequestsCleanly) {
  const std::string dir = std::string(::testing::TempDir()) + "/tiny_truncated_dir";
  std::system(("rm -rf '" + dir + "'").c_str());
  TinyPipelineOptions options;
  options.weight_seed = 78;
  ASSERT_TRUE(SaveTinyPipeline(options, dir).ok());
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("fragile");
  load.mutable_pipeline()->set_model_dir(dir);
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), load, &loaded).ok());
  v1::GenerateResponse response;
  ASSERT_TRUE(Generate("fragile", &response).ok());

  // `cp new old` truncates the file in place before writing it: the server must not die of SIGBUS.
  const std::string file = dir + "/transformer/diffusion_pytorch_model.safetensors";
  ASSERT_EQ(::truncate(file.c_str(), 0), 0);
  for (int i = 0; i < 2; ++i) {
    const grpc::Status status = Generate("fragile", &response);
    EXPECT_EQ(status.error_code(), grpc::FAILED_PRECONDITION) << status.error_message();
    EXPECT_NE(status.error_message().find("model file '" + file + "' changed on disk after it was loaded"),
              std::string::npos)
        << status.error_message();
    EXPECT_NE(status.error_message().find("unload and load the pipeline again"), std::string::npos);
  }
  // Other pipelines keep serving; the documented remedy works: unload, load the new version.
  ASSERT_TRUE(Generate("", &response).ok());
  v1::UnloadPipelineRequest unload;
  unload.set_name("fragile");
  v1::UnloadPipelineResponse unloaded;
  ASSERT_TRUE(admin_->UnloadPipeline(Authed().get(), unload, &unloaded).ok());
  const std::string fresh = dir + "_v2";
  std::system(("rm -rf '" + fresh + "'").c_str());
  ASSERT_TRUE(SaveTinyPipeline(options, fresh).ok());
  load.mutable_pipeline()->set_model_dir(fresh);
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), load, &loaded).ok());
  EXPECT_TRUE(Generate("fragile", &response).ok());
}

TEST_F(AdminE2ETest, ServesTheZImageArchitectureAtATinySize) {
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("zimage");
  load.mutable_pipeline()->set_builtin("zimage-tiny");
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), load, &loaded).ok());
  ASSERT_EQ(loaded.pipeline().components_size(), 4);
  EXPECT_EQ(loaded.pipeline().components(0).kind(), "Qwen3Model");
  EXPECT_EQ(loaded.pipeline().components(1).kind(), "AutoencoderKL");  // Its encoder.
  EXPECT_EQ(loaded.pipeline().components(2).kind(), "ZImageTransformer2DModel");
  EXPECT_EQ(loaded.pipeline().components(3).kind(), "AutoencoderKL");
  v1::GenerateResponse a, b;
  ASSERT_TRUE(Generate("zimage", &a).ok());
  ASSERT_TRUE(Generate("zimage", &b).ok());
  EXPECT_EQ(a.image(), b.image());
  EXPECT_EQ(a.width(), 64);
  // Group-offload the whole pipeline (the VAE's blocks are nested: named explicitly) and draw again.
  v1::EnableGroupOffloadRequest enable;
  enable.set_pipeline("zimage");
  enable.mutable_options()->set_use_stream(true);
  v1::GroupOffloadConfig vae;
  vae.set_use_stream(true);
  vae.add_block_modules("decoder.up_blocks");
  vae.set_target(v1::GroupOffloadConfig::PAGEABLE_HOST);  // Pinned where it lies.
  (*enable.mutable_overrides())["vae"] = vae;
  v1::GroupOffloadConfig text_encoder;  // Staged through the ring.
  text_encoder.set_target(v1::GroupOffloadConfig::PAGEABLE_HOST);
  text_encoder.set_never_pin_in_place(true);
  (*enable.mutable_overrides())["text_encoder"] = text_encoder;
  v1::EnableGroupOffloadResponse enabled;
  ASSERT_TRUE(admin_->EnableGroupOffload(Authed().get(), enable, &enabled).ok());
  EXPECT_EQ(enabled.components_size(), 4);
  for (const auto& component : enabled.components()) {
    const auto& g = component.group_offload();
    if (component.name() == "vae") {
      EXPECT_GT(g.pinned_in_place_bytes(), 0) << component.id();
    } else {
      EXPECT_EQ(g.pinned_in_place_bytes(), 0) << component.id();
    }
    EXPECT_EQ(g.pin_in_place_error(), "") << component.id();
  }
  v1::GenerateResponse c;
  ASSERT_TRUE(Generate("zimage", &c).ok());
  EXPECT_EQ(c.image(), a.image());
}

// 8-bit streaming through the admin API (the same GroupOffloadConfig message as the config file):
// the status reports the format, the 8-bit host bytes, the scratch and the bytes per forward, and
// the pipeline still draws.
TEST_F(AdminE2ETest, CompressedGroupOffloadIsReported) {
  v1::LoadPipelineRequest load;
  load.mutable_pipeline()->set_name("zimage");
  load.mutable_pipeline()->set_builtin("zimage-tiny");
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(admin_->LoadPipeline(Authed().get(), load, &loaded).ok());
  v1::EnableGroupOffloadResponse enabled;
  grpc::Status status = StreamComponent("zimage/transformer", &enabled, v1::GroupOffloadConfig::COMPRESS_INT8);
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(enabled.components_size(), 1);
  const v1::GroupOffloadStatus& g = enabled.components(0).group_offload();
  EXPECT_EQ(g.compress(), "int8");
  EXPECT_GT(g.compressed_host_bytes(), 0);
  EXPECT_GT(g.scratch_bytes(), 0);
  EXPECT_GT(g.bytes_per_forward(), 0);
  EXPECT_GE(g.working_set_bytes(), g.scratch_bytes());
  v1::GenerateResponse image;
  ASSERT_TRUE(Generate("zimage", &image).ok());
  v1::GetPlacementResponse placement;
  ASSERT_TRUE(admin_->GetPlacement(Authed().get(), {}, &placement).ok());
  bool found = false;
  for (const auto& c : placement.components()) {
    if (c.id() != "zimage/transformer") continue;
    found = true;
    EXPECT_EQ(c.group_offload().compress(), "int8");
    EXPECT_EQ(c.group_offload().bytes_per_forward(), g.bytes_per_forward());
    EXPECT_GE(c.group_offload().forwards(), 1);
  }
  EXPECT_TRUE(found);
}

TEST(TlsE2ETest, TlsPortServesTlsClientsOnly) {
  const std::string dir = ::testing::TempDir();
  const std::string cert = dir + "/tls.crt";
  const std::string key = dir + "/tls.key";
  const std::string command =
      "openssl req -x509 -newkey rsa:2048 -nodes -days 1 -subj /CN=localhost "
      "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 -keyout " + key + " -out " + cert +
      " >/dev/null 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << "openssl is needed for this test";
  v1::ServerConfig config;
  config.set_grpc_address("127.0.0.1:0");
  config.set_metrics_address("none");
  config.mutable_tls()->set_cert_file(cert);
  config.mutable_tls()->set_key_file(key);
  auto server = StowageServer::Start(config);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string port = (*server)->grpc_address().substr((*server)->grpc_address().rfind(':') + 1);
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadAll(cert);
  auto secure = v1::GenerationService::NewStub(
      grpc::CreateChannel("localhost:" + port, grpc::SslCredentials(ssl)));
  v1::ListPipelinesResponse response;
  grpc::ClientContext ok_context;
  ok_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  EXPECT_TRUE(secure->ListPipelines(&ok_context, {}, &response).ok());
  EXPECT_EQ(response.pipelines_size(), 1);
  auto plain = v1::GenerationService::NewStub(
      grpc::CreateChannel("localhost:" + port, grpc::InsecureChannelCredentials()));
  grpc::ClientContext plain_context;
  plain_context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  EXPECT_FALSE(plain->ListPipelines(&plain_context, {}, &response).ok());
  // Half a TLS config is refused at start, naming the field.
  v1::ServerConfig half = config;
  half.mutable_tls()->clear_key_file();
  auto refused = StowageServer::Start(half);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("tls"), std::string::npos);
}

TEST(AdminAuthTest, ConstantTimeEqualsAndDisabledApi) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  const std::string header = "Bearer t";
  EXPECT_EQ(CheckBearerToken("", &header).code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(CheckBearerToken("t", &header).ok());
}

}  // namespace
}  // namespace stowage
