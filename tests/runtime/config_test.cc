#include "runtime/config.h"

#include <sys/vfs.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "google/protobuf/text_format.h"

namespace stowage {
namespace {

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = std::string(::testing::TempDir()) + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigTest, EmptyConfigServesTheBuiltInPipelineWithDefaults) {
  auto config = FinalizeServerConfig(v1::ServerConfig());
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->grpc_address(), kDefaultGrpcAddress);
  EXPECT_EQ(config->metrics_address(), kDefaultMetricsAddress);
  EXPECT_EQ(config->queue_depth(), kDefaultQueueDepth);
  ASSERT_EQ(config->pipelines_size(), 1);
  EXPECT_EQ(config->pipelines(0).name(), "zimage-tiny");
  EXPECT_EQ(config->pipelines(0).builtin(), "zimage-tiny");
  EXPECT_EQ(config->pipelines(0).dtype(), "float32");
  EXPECT_TRUE(config->pipelines(0).default_());
  // The HTTP API's limits.
  EXPECT_EQ(config->http().read_timeout_ms(), 10000);
  EXPECT_EQ(config->http().max_connections(), 1024);
  EXPECT_EQ(config->http().max_connections_per_client(), 32);
  EXPECT_EQ(config->http().max_body_bytes(), 16 << 20);  // Room for an edit's image and mask.
}

TEST(ConfigTest, WithoutAConfigTheDemoIsTheDefaultBesideTheBuiltIn) {
  v1::ServerConfig config;
  AddDefaultPipelines(config, "/models/demo/shapes");
  ASSERT_EQ(config.pipelines_size(), 2);
  EXPECT_EQ(config.pipelines(0).name(), kDemoPipelineName);
  EXPECT_EQ(config.pipelines(0).model_dir(), "/models/demo/shapes");
  EXPECT_EQ(config.pipelines(0).default_size(), static_cast<uint32_t>(kDemoImageSize));
  EXPECT_TRUE(config.pipelines(0).default_());
  EXPECT_EQ(config.pipelines(1).builtin(), kDefaultPipelineName);
  EXPECT_FALSE(config.pipelines(1).default_());
  // No demo folder: the built-in alone; a config that names pipelines is left as it is.
  v1::ServerConfig bare;
  AddDefaultPipelines(bare, "");
  ASSERT_EQ(bare.pipelines_size(), 1);
  EXPECT_EQ(bare.pipelines(0).name(), kDefaultPipelineName);
  AddDefaultPipelines(bare, "/models/demo/shapes");
  EXPECT_EQ(bare.pipelines_size(), 1);
}

TEST(ConfigTest, TextFormatAndJsonParseToTheSameConfig) {
  const std::string text = WriteTemp("a.textproto", R"pb(
    grpc_address: "127.0.0.1:0"
    queue_depth: 3
    device { kind: KIND_SIMULATED memory_budget_bytes: 1048576 }
    pipelines { name: "small" builtin: "tiny" dtype: "bfloat16" }
  )pb");
  const std::string json = WriteTemp("a.json", R"({
    "grpcAddress": "127.0.0.1:0", "queueDepth": 3,
    "device": {"kind": "KIND_SIMULATED", "memoryBudgetBytes": "1048576"},
    "pipelines": [{"name": "small", "builtin": "tiny", "dtype": "bfloat16"}]})");
  auto a = LoadServerConfig(text);
  auto b = LoadServerConfig(json);
  ASSERT_TRUE(a.ok()) << a.status();
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(a->SerializeAsString(), b->SerializeAsString());
  EXPECT_EQ(a->device().memory_budget_bytes(), 1048576);
}

// PipelineConfig.compute from JSON: a mode number the enum does not name is refused naming the
// entry (or by the JSON reader itself); never taken as some mode.
TEST(ConfigTest, AnUnknownComputeModeIsRefused) {
  const std::string json = WriteTemp("compute.json", R"({"pipelines": [{"name": "a", "builtin": "zimage-tiny",
    "dtype": "bfloat16", "compute": {"transformer": 7}}]})");
  auto loaded = LoadServerConfig(json);
  if (!loaded.ok()) {
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << loaded.status();
    return;
  }
  auto finalized = FinalizeServerConfig(*loaded);
  ASSERT_FALSE(finalized.ok());
  EXPECT_EQ(finalized.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(finalized.status().message()).find("pipelines[0].compute['transformer']: unknown compute mode 7"),
            std::string::npos)
      << finalized.status();
}

TEST(ConfigTest, SyntaxErrorsNameFileAndLine) {
  auto bad = LoadServerConfig(WriteTemp("bad.textproto", "queue_depth: 3\nno_such_field: 1\n"));
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string message(bad.status().message());
  EXPECT_NE(message.find("bad.textproto"), std::string::npos) << message;
  EXPECT_NE(message.find("line 2"), std::string::npos) << message;
  EXPECT_NE(message.find("no_such_field"), std::string::npos) << message;
  auto bad_json = LoadServerConfig(WriteTemp("bad.json", "{\"queueDepth\": \"many\"}"));
  EXPECT_EQ(bad_json.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadServerConfig("/nonexistent/x.textproto").status().code(), absl::StatusCode::kNotFound);
}

TEST(ConfigTest, SemanticErrorsNameTheField) {
  struct Case {
    std::string text;
    std::string expected;
  };
  const Case cases[] = {
      {"queue_depth: -1", "queue_depth"},
      {"device { memory_budget_bytes: -5 }", "device.memory_budget_bytes"},
      {"pipelines { name: \"Bad Name\" builtin: \"tiny\" }", "pipelines[0].name"},
      {"pipelines { name: \"a\" builtin: \"tiny\" } pipelines { name: \"a\" builtin: \"tiny\" }",
       "pipelines[1].name"},
      {"pipelines { name: \"a\" }", "pipelines[0]: no source"},
      {"pipelines { name: \"a\" model_dir: \"\" }", "pipelines[0].model_dir: empty path"},
      {"pipelines { name: \"a\" builtin: \"huge\" }", "pipelines[0].builtin"},
      {"pipelines { name: \"a\" builtin: \"tiny\" dtype: \"int8\" }", "pipelines[0].dtype"},
      {"pipelines { name: \"a\" builtin: \"tiny\" default: true } "
       "pipelines { name: \"b\" builtin: \"tiny\" default: true }",
       "more than one"},
      // FP8 compute: bf16 pipelines only, component names as pipeline names.
      {"pipelines { name: \"a\" builtin: \"zimage-tiny\" compute { key: \"transformer\" value: COMPUTE_FP8 } }",
       "pipelines[0].compute['transformer']: FP8 compute needs dtype \"bfloat16\""},
      {"pipelines { name: \"a\" builtin: \"zimage-tiny\" dtype: \"bfloat16\" compute { key: \"Trans Former\" value: COMPUTE_FP8 } }",
       "pipelines[0].compute['Trans Former']: a component name must match"},
      // Where host copies spill: an existing directory, named when it is not.
      {"pipelines { name: \"a\" builtin: \"zimage-tiny\" host_spill_dir: \"/proc/version\" }",
       "pipelines[0].host_spill_dir: '/proc/version' is not a directory"},
      // Component seeds draw random weights: refused where the weights are read, names checked.
      {"pipelines { name: \"a\" model_dir: \"/\" component_weight_seeds { key: \"transformer\" value: 7 } }",
       "pipelines[0].component_weight_seeds['transformer']: seeds draw random weights"},
      {"pipelines { name: \"a\" builtin: \"tiny\" component_weight_seeds { key: \"Trans/Former\" value: 7 } }",
       "pipelines[0].component_weight_seeds['Trans/Former']: a component name must match"},
  };
  for (const Case& c : cases) {
    auto loaded = LoadServerConfig(WriteTemp("c.textproto", c.text));
    ASSERT_TRUE(loaded.ok()) << c.text << ": " << loaded.status();
    auto finalized = FinalizeServerConfig(*loaded);
    ASSERT_FALSE(finalized.ok()) << c.text;
    EXPECT_EQ(finalized.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(std::string(finalized.status().message()).find(c.expected), std::string::npos)
        << c.text << " -> " << finalized.status();
  }
}

// cuda_expandable_segments: set in the environment LibTorch's allocator reads unless the environment
// already configures the allocator (an empty variable does not count, and an empty
// PYTORCH_ALLOC_CONF, which LibTorch would read first, goes); nothing when off; the second call (in
// the process the server re-executes) finds it set and changes nothing.
TEST(ConfigTest, CudaExpandableSegmentsSetTheAllocatorsEnvironmentUnlessItIsSet) {
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  ::unsetenv("PYTORCH_ALLOC_CONF");
  v1::ServerConfig config;
  CudaAllocatorSettings applied = ApplyCudaAllocatorSettings(config);
  EXPECT_EQ(applied.note, "");
  EXPECT_FALSE(applied.changed_environment);
  EXPECT_EQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), nullptr);
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString("cuda_expandable_segments: true", &config));
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "", 1);
  ::setenv("PYTORCH_ALLOC_CONF", "", 1);
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_TRUE(applied.changed_environment);
  EXPECT_EQ(applied.note, "cuda_expandable_segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True");
  ASSERT_NE(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), nullptr);
  EXPECT_STREQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True");
  EXPECT_EQ(std::getenv("PYTORCH_ALLOC_CONF"), nullptr);
  // Again (the re-executed server): found as set, nothing changes.
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_FALSE(applied.changed_environment);
  EXPECT_NE(applied.note.find("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"), std::string::npos) << applied.note;
  // A user's own setting wins and is named.
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  ::setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:512", 1);
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_FALSE(applied.changed_environment);
  EXPECT_NE(applied.note.find("PYTORCH_ALLOC_CONF=max_split_size_mb:512"), std::string::npos) << applied.note;
  EXPECT_EQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), nullptr);
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6", 1);
  ::unsetenv("PYTORCH_ALLOC_CONF");
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_FALSE(applied.changed_environment);
  EXPECT_NE(applied.note.find("PYTORCH_CUDA_ALLOC_CONF=garbage_collection_threshold:0.6 is used as it is"),
            std::string::npos)
      << applied.note;
  // A huge or unprintable value is named cut short, never echoed whole.
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", (std::string(100000, 'x') + "\x01\x7f").c_str(), 1);
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_FALSE(applied.changed_environment);
  EXPECT_LT(applied.note.size(), 200u) << applied.note;
  EXPECT_EQ(applied.note.find('\x01'), std::string::npos);
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
}

// cuda_max_split_size_mb: 0 (LibTorch's default) or 21..1048576, named with its range when out of
// it; set alone or combined with expandable segments in the one variable LibTorch reads.
TEST(ConfigTest, CudaMaxSplitSizeIsCheckedAndJoinsTheAllocatorsSetting) {
  for (const auto& [value, accepted] : std::vector<std::pair<int64_t, bool>>{
           {0, true}, {21, true}, {256, true}, {1 << 20, true}, {1, false}, {20, false}, {(1 << 20) + 1, false},
           {4294967295LL, false}}) {
    v1::ServerConfig config;
    config.set_cuda_max_split_size_mb(static_cast<uint32_t>(value));
    const auto finalized = FinalizeServerConfig(config);
    EXPECT_EQ(finalized.ok(), accepted) << value << " -> " << finalized.status();
    if (!accepted) {
      EXPECT_NE(std::string(finalized.status().message())
                    .find(absl::StrCat("cuda_max_split_size_mb: ", value,
                                       " is out of range; allowed: 0 (LibTorch's default: no limit) or 21..1048576")),
                std::string::npos)
          << finalized.status();
    }
  }
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  ::unsetenv("PYTORCH_ALLOC_CONF");
  v1::ServerConfig config;
  config.set_cuda_max_split_size_mb(256);
  EXPECT_EQ(CudaAllocatorConf(config), "max_split_size_mb:256");
  CudaAllocatorSettings applied = ApplyCudaAllocatorSettings(config);
  EXPECT_TRUE(applied.changed_environment);
  EXPECT_EQ(applied.note, "cuda_max_split_size_mb: PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:256");
  EXPECT_STREQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), "max_split_size_mb:256");
  // Both: one value (a fresh process), and the re-executed server finds it set.
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
  config.set_cuda_expandable_segments(true);
  EXPECT_EQ(CudaAllocatorConf(config), "expandable_segments:True,max_split_size_mb:256");
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_TRUE(applied.changed_environment);
  EXPECT_STREQ(std::getenv("PYTORCH_CUDA_ALLOC_CONF"), "expandable_segments:True,max_split_size_mb:256");
  applied = ApplyCudaAllocatorSettings(config);
  EXPECT_FALSE(applied.changed_environment);
  EXPECT_EQ(applied.note,
            "cuda_expandable_segments, cuda_max_split_size_mb: PYTORCH_CUDA_ALLOC_CONF="
            "expandable_segments:True,max_split_size_mb:256");
  ::unsetenv("PYTORCH_CUDA_ALLOC_CONF");
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// strategy.footprint.keep_resident: names or ids of hosted components, bounded; errors name the entry.
TEST(ConfigTest, FootprintKeepResidentNamesHostedComponents) {
  const std::vector<std::string> hosted = {"text_encoder", "transformer", "vae"};
  const std::vector<std::string> ids = {"zimage/text_encoder", "zimage/transformer", "zimage/vae",
                                        "zimage-ft/transformer"};
  v1::OffloadStrategy strategy;
  strategy.mutable_footprint()->add_keep_resident("zimage/text_encoder");
  strategy.mutable_footprint()->add_keep_resident("vae");
  auto made = ToOffloadStrategy(strategy, hosted, ids);
  ASSERT_TRUE(made.ok()) << made.status();
  // It keeps them: with the deficit only the transformer covers, it is chosen over the smaller vae.
  StrategyInput in;
  in.target = Candidate{"ft/transformer", "transformer", 100, absl::Now()};
  in.needed_bytes = 100;
  in.free_bytes = 10;
  in.resident = {Candidate{"zimage/text_encoder", "text_encoder", 95, absl::Now()},
                 Candidate{"zimage/transformer", "transformer", 100, absl::Now()},
                 Candidate{"zimage/vae", "vae", 95, absl::Now()}};
  EXPECT_EQ((*made)->BeforeRun(in), std::vector<std::string>{"zimage/transformer"});
  // A typo in the pipeline, an id of a component shared by content (registered under zimage/, not
  // zimage-ft/), more than one slash, no pipeline, an unknown name, a huge entry.
  for (const std::string& bad : {std::string("unet"), std::string("zimage/unet"), std::string("zimag/text_encoder"),
                                 std::string("zimage-ft/text_encoder"), std::string("a/zimage/text_encoder"),
                                 std::string("/text_encoder"), std::string(5000, 'x')}) {
    v1::OffloadStrategy s;
    s.mutable_footprint()->add_keep_resident(bad);
    const absl::Status status = ToOffloadStrategy(s, hosted, ids).status();
    EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << bad.substr(0, 40);
    EXPECT_NE(std::string(status.message()).find("strategy.footprint.keep_resident[0]"), std::string::npos) << status;
    EXPECT_LT(status.message().size(), 1000u) << "the entry is truncated in the message";
  }
  v1::OffloadStrategy many;
  for (int i = 0; i <= kMaxKeepResident; ++i) many.mutable_footprint()->add_keep_resident("vae");
  EXPECT_EQ(ToOffloadStrategy(many, hosted, ids).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ConfigTest, GroupOffloadOptionsPassDepthAndPinInPlace) {
  v1::GroupOffloadConfig block;
  auto b = ToGroupOffloadOptions(block, "defaults");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->type, OffloadType::kBlockLevel);
  EXPECT_EQ(b->prefetch_depth, 0);  // Unset: the engine chooses per level (group_offload_test).
  EXPECT_EQ(b->target, OffloadTarget::kPinnedHost);
  EXPECT_TRUE(b->pin_in_place);
  v1::GroupOffloadConfig leaf;
  leaf.set_offload_type(v1::GroupOffloadConfig::LEAF_LEVEL);
  leaf.set_target(v1::GroupOffloadConfig::PAGEABLE_HOST);
  leaf.set_prefetch_depth(2);
  leaf.set_never_pin_in_place(true);
  auto l = ToGroupOffloadOptions(leaf, "defaults");
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->type, OffloadType::kLeafLevel);
  EXPECT_EQ(l->target, OffloadTarget::kPageableHost);
  EXPECT_EQ(l->prefetch_depth, 2);
  EXPECT_FALSE(l->pin_in_place);
  EXPECT_EQ(b->compress, CompressFormat::kNone);  // Off by default.
  block.set_compress(v1::GroupOffloadConfig::COMPRESS_INT8);
  EXPECT_EQ(ToGroupOffloadOptions(block, "defaults")->compress, CompressFormat::kInt8);
  block.set_compress(v1::GroupOffloadConfig::COMPRESS_FP8);
  EXPECT_EQ(ToGroupOffloadOptions(block, "defaults")->compress, CompressFormat::kFp8E4M3);
  block.set_compress(v1::GroupOffloadConfig::COMPRESS_INT8_GROUPED);
  EXPECT_EQ(ToGroupOffloadOptions(block, "defaults")->compress, CompressFormat::kInt8Grouped);
  block.set_compress(v1::GroupOffloadConfig::COMPRESS_INT4);
  EXPECT_EQ(ToGroupOffloadOptions(block, "defaults")->compress, CompressFormat::kInt4);
  EXPECT_FALSE(ToGroupOffloadOptions(block, "defaults")->choose_compress);
  block.set_compress(v1::GroupOffloadConfig::COMPRESS_AUTO);  // Placement chooses.
  EXPECT_EQ(ToGroupOffloadOptions(block, "defaults")->compress, CompressFormat::kNone);
  EXPECT_TRUE(ToGroupOffloadOptions(block, "defaults")->choose_compress);
  for (const int value : {6, 7, -1}) {  // Open enum: anything past the known values is refused.
    block.set_compress(static_cast<v1::GroupOffloadConfig::Compress>(value));
    auto refused = ToGroupOffloadOptions(block, "defaults");
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << value;
    EXPECT_NE(std::string(refused.status().message()).find("COMPRESS_AUTO (5)"), std::string::npos) << refused.status();
  }
  block.set_compress(static_cast<v1::GroupOffloadConfig::Compress>(7));
  auto bad = ToGroupOffloadOptions(block, "defaults");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(bad.status().message()).find("defaults.compress"), std::string::npos) << bad.status();
  for (const auto compress : {v1::GroupOffloadConfig::COMPRESS_INT8, v1::GroupOffloadConfig::COMPRESS_INT4,
                              v1::GroupOffloadConfig::COMPRESS_AUTO}) {
    leaf.set_compress(compress);  // PAGEABLE_HOST: refused.
    bad = ToGroupOffloadOptions(leaf, "defaults");
    EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  }
  leaf.set_compress(v1::GroupOffloadConfig::COMPRESS_NONE);
  leaf.set_prefetch_depth(-1);
  l = ToGroupOffloadOptions(leaf, "pipelines[0].group_offload.defaults");
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(l.status().message()).find("pipelines[0].group_offload.defaults.prefetch_depth"),
            std::string::npos) << l.status();
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// Every numeric option: below, at and above each bound of its documented range (runtime/config.h).
struct RangeCase {
  std::string field;
  std::function<void(v1::ServerConfig&, int64_t)> set;
  std::vector<int64_t> accepted;
  std::vector<int64_t> refused;
};

v1::GroupOffloadConfig* Defaults(v1::ServerConfig& config) {
  v1::PipelineConfig* p = config.mutable_pipelines(0);
  p->mutable_group_offload()->set_enabled(true);
  return p->mutable_group_offload()->mutable_defaults();
}

TEST(ConfigRangeTest, EveryNumericOptionIsCheckedAtItsBounds) {
  const int64_t kMax = INT64_MAX;
  const int64_t MiB = int64_t{1} << 20, GiB = int64_t{1} << 30;
  const std::string go = "pipelines[0].group_offload.defaults";
  const std::vector<RangeCase> cases = {
      {"queue_depth", [](auto& c, int64_t v) { c.set_queue_depth(static_cast<int32_t>(v)); },
       {0, 1, 4096}, {-1, 4097, 1000000}},
      {"cpu_threads", [](auto& c, int64_t v) { c.set_cpu_threads(static_cast<int32_t>(v)); },
       {0, 1, 1024}, {-1, 1025}},
      {"cuda_max_split_size_mb",
       [](auto& c, int64_t v) { c.set_cuda_max_split_size_mb(static_cast<uint32_t>(v)); },
       {0, 21, 1 << 20}, {1, 20, (1 << 20) + 1}},
      {"scheduler.max_reorder_delay_ms",
       [](auto& c, int64_t v) { c.mutable_scheduler()->set_max_reorder_delay_ms(static_cast<int32_t>(v)); },
       {0, 1, 60000}, {-1, 60001}},
      // Up to queue_depth (16 by default).
      {"scheduler.tenant_queue_limit",
       [](auto& c, int64_t v) { c.mutable_scheduler()->set_tenant_queue_limit(static_cast<int32_t>(v)); },
       {0, 1, 16}, {-1, 17}},
      {"http.read_timeout_ms", [](auto& c, int64_t v) { c.mutable_http()->set_read_timeout_ms(static_cast<int32_t>(v)); },
       {0, 1000, 600000}, {-1, 1, 999, 600001}},
      {"http.max_connections", [](auto& c, int64_t v) { c.mutable_http()->set_max_connections(static_cast<int32_t>(v)); },
       {0, 32, 100000}, {-1, 100001}},
      // Up to max_connections (1024 by default).
      {"http.max_connections_per_client",
       [](auto& c, int64_t v) { c.mutable_http()->set_max_connections_per_client(static_cast<int32_t>(v)); },
       {0, 1, 1024}, {-1, 1025}},
      {"http.max_body_bytes", [](auto& c, int64_t v) { c.mutable_http()->set_max_body_bytes(static_cast<int32_t>(v)); },
       {0, 1024, 64 << 20}, {-1, 1, 1023, (64 << 20) + 1}},
      {"device.index", [](auto& c, int64_t v) { c.mutable_device()->set_index(static_cast<int32_t>(v)); },
       {0, 127}, {-1, 128}},
      {"device.memory_budget_bytes", [](auto& c, int64_t v) { c.mutable_device()->set_memory_budget_bytes(v); },
       {0, 1, kMax}, {-1}},
      {"device.simulated_bandwidth_bytes_per_second",
       [](auto& c, int64_t v) { c.mutable_device()->set_simulated_bandwidth_bytes_per_second(v); },
       {0, 1, kMax}, {-1}},
      {"device.simulated_context_bytes",
       [](auto& c, int64_t v) { c.mutable_device()->set_simulated_context_bytes(v); },
       {0, 1, kMax}, {-1}},
      {"device.peer_bandwidth_bytes_per_second",
       [](auto& c, int64_t v) { c.mutable_device()->set_peer_bandwidth_bytes_per_second(v); },
       {0, 1, kMax}, {-1, -kMax}},
      {"device.host_memory_budget_bytes",
       [](auto& c, int64_t v) { c.mutable_device()->set_host_memory_budget_bytes(v); },
       {0, 1, kMax}, {-1, -kMax}},
      {"device.streamed_group_cache.margin_bytes",
       [](auto& c, int64_t v) { c.mutable_device()->mutable_streamed_group_cache()->set_margin_bytes(v); },
       {0, 1, kMax}, {-1, -kMax}},
      {"device.host_to_device_bandwidth_bytes_per_second",
       [](auto& c, int64_t v) { c.mutable_device()->set_host_to_device_bandwidth_bytes_per_second(v); },
       {0, 1, kMax}, {-1, -kMax}},
      {"strategy.footprint.reserve_bytes",
       [](auto& c, int64_t v) { c.mutable_strategy()->mutable_footprint()->set_reserve_bytes(v); },
       {0, kMax}, {-1}},
      {go + ".prefetch_depth", [](auto& c, int64_t v) { Defaults(c)->set_prefetch_depth(static_cast<int32_t>(v)); },
       {0, 1, 64}, {-1, 65, 1000000}},
      {go + ".num_blocks_per_group",
       [](auto& c, int64_t v) { Defaults(c)->set_num_blocks_per_group(static_cast<int32_t>(v)); },
       {0, 1, 4096}, {-1, 4097}},
      {go + ".staging_buffer_bytes", [](auto& c, int64_t v) { Defaults(c)->set_staging_buffer_bytes(v); },
       {0, MiB, 4 * GiB}, {-1, 1, MiB - 1, 4 * GiB + 1}},
      {go + ".staging_buffers", [](auto& c, int64_t v) { Defaults(c)->set_staging_buffers(static_cast<int32_t>(v)); },
       {0, 1, 64}, {-1, 65}},
      {go + ".budget_bytes", [](auto& c, int64_t v) { Defaults(c)->set_budget_bytes(v); }, {0, 1, kMax}, {-1}},
      {"pipelines[0].default_size",
       [](auto& c, int64_t v) { c.mutable_pipelines(0)->set_default_size(static_cast<uint32_t>(v)); },
       {0, 16, 8192}, {1, 15, 8193, 1000000}},
      {"pipelines[0].group_offload.overrides['vae'].prefetch_depth",
       [](auto& c, int64_t v) {
         Defaults(c);
         (*c.mutable_pipelines(0)->mutable_group_offload()->mutable_overrides())["vae"].set_prefetch_depth(
             static_cast<int32_t>(v));
       },
       {0, 64}, {65}},
  };
  for (const RangeCase& c : cases) {
    auto make = [&](int64_t value) {
      v1::ServerConfig config;
      v1::PipelineConfig* p = config.add_pipelines();
      p->set_name("p");
      p->set_builtin("tiny");
      c.set(config, value);
      return FinalizeServerConfig(config);
    };
    for (int64_t value : c.accepted) {
      auto finalized = make(value);
      EXPECT_TRUE(finalized.ok()) << c.field << " = " << value << ": " << finalized.status();
    }
    for (int64_t value : c.refused) {
      auto finalized = make(value);
      ASSERT_FALSE(finalized.ok()) << c.field << " = " << value << " was accepted";
      EXPECT_EQ(finalized.status().code(), absl::StatusCode::kInvalidArgument) << finalized.status();
      EXPECT_NE(finalized.status().message().find(absl::StrCat(c.field, ": ", value, " is out of range; allowed: ")),
                std::string::npos)
          << finalized.status();
    }
  }
  // A simulated context must leave part of the budget.
  for (const int64_t context : {int64_t{1000}, int64_t{5000}}) {
    v1::ServerConfig config;
    config.mutable_device()->set_memory_budget_bytes(1000);
    config.mutable_device()->set_simulated_context_bytes(context);
    auto finalized = FinalizeServerConfig(config);
    ASSERT_FALSE(finalized.ok()) << context;
    EXPECT_NE(finalized.status().message().find("device.simulated_context_bytes: "), std::string::npos)
        << finalized.status();
  }
  {
    v1::ServerConfig config;
    config.mutable_device()->set_memory_budget_bytes(1000);
    config.mutable_device()->set_simulated_context_bytes(999);
    EXPECT_TRUE(FinalizeServerConfig(config).ok());
  }
  // The unset queue depth becomes the default.
  v1::ServerConfig unset;
  EXPECT_EQ(FinalizeServerConfig(unset)->queue_depth(), kDefaultQueueDepth);
}

TEST(ConfigTest, SchedulerTenantsAndModesAreChecked) {
  struct Case {
    std::string text;
    std::string needle;  // "" = accepted.
  };
  for (const Case& c : std::vector<Case>{
           {R"pb(scheduler { priority_mode: PRIORITY_WEIGHTED tenant_weights { key: "gold" value: 3 } })pb", ""},
           {R"pb(scheduler { tenant_weights { key: "gold" value: 1000 } })pb", ""},
           {R"pb(scheduler { tenant_weights { key: "gold" value: 0 } })pb",
            "scheduler.tenant_weights[gold]: 0 is out of range; allowed: (0, 1000]"},
           {R"pb(scheduler { tenant_weights { key: "gold" value: -2 } })pb", "scheduler.tenant_weights[gold]: -2"},
           {R"pb(scheduler { tenant_weights { key: "gold" value: 1001 } })pb", "scheduler.tenant_weights[gold]: 1001"},
           {R"pb(scheduler { tenant_weights { key: "gold" value: nan } })pb", "scheduler.tenant_weights[gold]: nan"},
           {R"pb(scheduler { tenant_weights { key: "two words" value: 1 } })pb",
            "scheduler.tenant_weights: tenant 'two words' is not 1..64 characters of [A-Za-z0-9._-]"},
           {R"pb(scheduler { tenant_weights { key: "" value: 1 } })pb", "scheduler.tenant_weights: tenant '' is not"},
           {R"pb(scheduler { tenant_burst_work: -1 })pb", "scheduler.tenant_burst_work: -1 is out of range; allowed: 0"},
           {R"pb(scheduler { tenant_burst_work: 10001 })pb", "scheduler.tenant_burst_work: 10001 is out of range"},
           {R"pb(scheduler { tenant_burst_work: nan })pb", "scheduler.tenant_burst_work: nan"},
           {R"pb(scheduler { tenant_burst_work: 0 })pb", ""},
           {R"pb(scheduler { preemption: PREEMPTION_PRIORITY })pb", ""},
           {R"pb(scheduler { preemption: PREEMPTION_RESIDENT max_reorder_delay_ms: 2000 })pb", ""},
           {R"pb(scheduler { preemption: PREEMPTION_RESIDENT })pb",
            "scheduler.preemption: PREEMPTION_RESIDENT bounds how long a running request may be paused by "
            "max_reorder_delay_ms, which is 0"},
       }) {
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(c.text, &config)) << c.text;
    const auto finalized = FinalizeServerConfig(config);
    if (c.needle.empty()) {
      EXPECT_TRUE(finalized.ok()) << c.text << ": " << finalized.status();
      continue;
    }
    ASSERT_FALSE(finalized.ok()) << c.text;
    EXPECT_EQ(finalized.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(finalized.status().message().find(c.needle), std::string::npos) << finalized.status();
  }
  v1::ServerConfig unknown_mode;
  unknown_mode.mutable_scheduler()->set_priority_mode(static_cast<v1::SchedulerConfig::PriorityMode>(7));
  EXPECT_NE(FinalizeServerConfig(unknown_mode).status().message().find("scheduler.priority_mode: unknown value 7"),
            std::string::npos);
  v1::ServerConfig unknown_preemption;
  unknown_preemption.mutable_scheduler()->set_preemption(static_cast<v1::SchedulerConfig::Preemption>(9));
  EXPECT_NE(FinalizeServerConfig(unknown_preemption).status().message().find("scheduler.preemption: unknown value 9"),
            std::string::npos);
  v1::ServerConfig many;
  for (int i = 0; i <= kMaxTenantWeights; ++i) (*many.mutable_scheduler()->mutable_tenant_weights())[absl::StrCat("t", i)] = 1;
  EXPECT_NE(FinalizeServerConfig(many).status().message().find("257 tenants; at most 256"), std::string::npos);
  // The options the workers get.
  v1::SchedulerConfig scheduler;
  scheduler.set_priority_mode(v1::SchedulerConfig::PRIORITY_WEIGHTED);
  scheduler.set_max_reorder_delay_ms(250);
  (*scheduler.mutable_tenant_weights())["gold"] = 3;
  const SchedulerOptions options = ToSchedulerOptions(scheduler);
  EXPECT_EQ(options.priority_mode, PriorityMode::kWeighted);
  EXPECT_EQ(options.max_reorder_delay, absl::Milliseconds(250));
  EXPECT_EQ(options.tenant_weights.at("gold"), 3);
  EXPECT_EQ(options.tenant_burst, kDefaultTenantBurstWork);  // Unset: the default credit.
  scheduler.set_tenant_burst_work(0);
  EXPECT_EQ(ToSchedulerOptions(scheduler).tenant_burst, 0);  // Set to 0: none.
  EXPECT_EQ(options.preemption, Preemption::kNone);  // Unset: none.
  scheduler.set_preemption(v1::SchedulerConfig::PREEMPTION_PRIORITY);
  EXPECT_EQ(ToSchedulerOptions(scheduler).preemption, Preemption::kPriority);
  scheduler.set_preemption(v1::SchedulerConfig::PREEMPTION_RESIDENT);
  EXPECT_EQ(ToSchedulerOptions(scheduler).preemption, Preemption::kResident);
  scheduler.set_preemption(v1::SchedulerConfig::PREEMPTION_NONE);
  EXPECT_EQ(ToSchedulerOptions(scheduler).preemption, Preemption::kNone);
}

TEST(ConfigRangeTest, AHugePrefetchDepthIsRefusedWithItsFieldPathAndRange) {
  auto loaded = LoadServerConfig(WriteTemp("huge.textproto", R"pb(
    pipelines { name: "p" builtin: "tiny"
                group_offload { enabled: true defaults { use_stream: true prefetch_depth: 1000000 } } }
  )pb"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto finalized = FinalizeServerConfig(*loaded);
  EXPECT_EQ(finalized.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(finalized.status().message(),
            "pipelines[0].group_offload.defaults.prefetch_depth: 1000000 is out of range; allowed: 0 (the "
            "engine's choice) or 1..64");
}

TEST(ConfigFilesTest, ConfigPathThatIsNotAReadableFileIsRefusedNamingIt) {
  const std::string dir = std::string(::testing::TempDir()) + "/config_dir";
  ::mkdir(dir.c_str(), 0755);
  auto as_dir = LoadServerConfig(dir);
  EXPECT_EQ(as_dir.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(as_dir.status().message(), "cannot read '" + dir + "': it is a directory");
  auto missing = LoadServerConfig(dir + "/missing.textproto");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("missing.textproto': no such file"), std::string::npos)
      << missing.status();
  EXPECT_EQ(LoadServerConfig("/dev/null").status().code(), absl::StatusCode::kInvalidArgument);  // Not regular.
  if (::geteuid() != 0) {  // Root reads anything.
    const std::string locked = WriteTemp("locked.textproto", "queue_depth: 1");
    ::chmod(locked.c_str(), 0);
    EXPECT_EQ(LoadServerConfig(locked).status().code(), absl::StatusCode::kPermissionDenied);
  }
}

TEST(ConfigFilesTest, ModelDirAndTlsFilesAreCheckedNamingTheirFields) {
  const std::string tmp = ::testing::TempDir();
  const std::string file = WriteTemp("not_a_dir", "x");
  const std::string cert = WriteTemp("tls.crt", "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n");
  const std::string key = WriteTemp("tls.key", "-----BEGIN PRIVATE KEY-----\nMIIE\n-----END PRIVATE KEY-----\n");
  struct Case {
    std::string text;
    absl::StatusCode code;
    std::string expected;
  };
  const Case cases[] = {
      {"pipelines { name: \"a\" model_dir: \"/nonexistent/model\" }", absl::StatusCode::kNotFound,
       "pipelines[0].model_dir: '/nonexistent/model' does not exist"},
      {"pipelines { name: \"a\" model_dir: \"" + file + "\" }", absl::StatusCode::kInvalidArgument,
       "pipelines[0].model_dir: '" + file + "' is not a directory"},
      {"pipelines { name: \"a\" builtin: \"zimage-tiny\" host_spill_dir: \"/nonexistent/spill\" }",
       absl::StatusCode::kNotFound, "pipelines[0].host_spill_dir: '/nonexistent/spill' does not exist"},
      {"tls { cert_file: \"/nonexistent/y\" key_file: \"" + file + "\" }", absl::StatusCode::kNotFound,
       "tls.cert_file: cannot read '/nonexistent/y': no such file"},
      {"tls { cert_file: \"" + cert + "\" key_file: \"" + tmp + "\" }", absl::StatusCode::kInvalidArgument,
       "tls.key_file: cannot read '" + tmp + "': it is a directory"},
      // Files that are not PEM are named at start-up (gRPC said only that it could not listen).
      {"tls { cert_file: \"" + file + "\" key_file: \"" + key + "\" }", absl::StatusCode::kInvalidArgument,
       "tls.cert_file: '" + file + "' is not a PEM file with a '-----BEGIN CERTIFICATE-----' block"},
      {"tls { cert_file: \"" + cert + "\" key_file: \"" + cert + "\" }", absl::StatusCode::kInvalidArgument,
       "tls.key_file: '" + cert + "' is not a PEM file with a '-----BEGIN PRIVATE KEY-----' block"},
      // An empty or repeated device of a pipeline.
      {"pipelines { name: \"a\" builtin: \"tiny\" devices: \"\" }", absl::StatusCode::kInvalidArgument,
       "pipelines[0].devices[0]: empty device name (a device of this server such as \"cuda:0\" or \"sim:0\")"},
      {"pipelines { name: \"a\" builtin: \"tiny\" devices: \"sim:0\" devices: \"sim:0\" }",
       absl::StatusCode::kInvalidArgument, "pipelines[0].devices[1]: 'sim:0' is listed twice"},
      {"tls { cert_file: \"" + file + "\" }", absl::StatusCode::kInvalidArgument,
       "tls: set both cert_file and key_file, or neither"},
      {"auth { admin_token_file: \"/nonexistent/token\" }", absl::StatusCode::kNotFound,
       "auth.admin_token_file: cannot read '/nonexistent/token': no such file"},
      {"auth { api_key_file: \"/nonexistent/key\" }", absl::StatusCode::kNotFound,
       "auth.api_key_file: cannot read '/nonexistent/key': no such file"},
      {"auth { api_key: \"k\" api_key_file: \"" + file + "\" }", absl::StatusCode::kInvalidArgument,
       "auth: set api_key or api_key_file, not both"},
  };
  for (const Case& c : cases) {
    auto loaded = LoadServerConfig(WriteTemp("files.textproto", c.text));
    ASSERT_TRUE(loaded.ok()) << c.text << ": " << loaded.status();
    auto finalized = FinalizeServerConfig(*loaded);
    EXPECT_EQ(finalized.status().code(), c.code) << c.text << " -> " << finalized.status();
    EXPECT_EQ(finalized.status().message(), c.expected) << c.text;
  }
  v1::ServerConfig good;
  v1::PipelineConfig* p = good.add_pipelines();
  p->set_name("a");
  p->set_model_dir(tmp);  // A directory: checked for existence only; loading reads it later.
  good.mutable_tls()->set_cert_file(cert);
  good.mutable_tls()->set_key_file(key);
  EXPECT_TRUE(FinalizeServerConfig(good).ok()) << FinalizeServerConfig(good).status();
  // host_spill_dir: a directory on a disk is taken; a tmpfs (RAM) is refused by name, and so is a path
  // longer than any the system takes (echoed shortened).
  p->set_host_spill_dir(".");
  EXPECT_TRUE(FinalizeServerConfig(good).ok()) << FinalizeServerConfig(good).status();
  p->set_host_spill_dir("/" + std::string(20000, 'd'));
  auto huge = FinalizeServerConfig(good);
  EXPECT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().message().rfind("pipelines[0].host_spill_dir: ", 0), 0u) << huge.status();
  EXPECT_LT(huge.status().message().size(), 400u) << huge.status();
  struct statfs fs;
  if (::statfs("/dev/shm", &fs) == 0 && fs.f_type == TMPFS_MAGIC && ::access("/dev/shm", W_OK | X_OK) == 0) {
    p->set_host_spill_dir("/dev/shm");
    auto ram = FinalizeServerConfig(good);
    EXPECT_EQ(ram.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(ram.status().message(), "pipelines[0].host_spill_dir: '/dev/shm' is on a tmpfs or ramfs, which keeps "
                                      "its files in RAM; choose a directory on a disk");
  }
}

TEST(ConfigFilesTest, HttpAddressNoneAndEmptyBothDisableTheHttpFront) {
  v1::ServerConfig config;
  auto finalized = FinalizeServerConfig(config);
  ASSERT_TRUE(finalized.ok()) << finalized.status();
  EXPECT_EQ(finalized->http_address(), "");
  config.set_http_address("none");
  finalized = FinalizeServerConfig(config);
  ASSERT_TRUE(finalized.ok()) << finalized.status();
  EXPECT_EQ(finalized->http_address(), "");
  config.set_http_address("127.0.0.1:0");
  finalized = FinalizeServerConfig(config);
  ASSERT_TRUE(finalized.ok()) << finalized.status();
  EXPECT_EQ(finalized->http_address(), "127.0.0.1:0");
}

TEST(ConfigTextTest, LongOrOddNamesAreNeverEchoedWhole) {
  v1::ServerConfig config;
  v1::PipelineConfig* p = config.add_pipelines();
  p->set_name(std::string(100000, 'A') + "\n\x1b[31m");
  p->set_builtin("tiny");
  auto finalized = FinalizeServerConfig(config);
  ASSERT_FALSE(finalized.ok());
  const std::string message(finalized.status().message());
  EXPECT_LT(message.size(), 200u) << message;
  EXPECT_NE(message.find("...(100006 bytes)"), std::string::npos) << message;
  p->set_name("bad\x01name\xff");
  finalized = FinalizeServerConfig(config);
  EXPECT_EQ(finalized.status().message(), "pipelines[0].name: 'bad?name?' must match [a-z0-9_-]{1,64}");
  p->set_name("ok");
  p->set_builtin(std::string(5000, 'b'));
  finalized = FinalizeServerConfig(config);
  EXPECT_LT(finalized.status().message().size(), 200u) << finalized.status();
}

}  // namespace
}  // namespace stowage
