#include "server/config.h"

#include <cstdio>
#include <fstream>
#include <string>

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

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
  leaf.set_prefetch_depth(-1);
  l = ToGroupOffloadOptions(leaf, "pipelines[0].group_offload.defaults");
  EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(l.status().message()).find("pipelines[0].group_offload.defaults.prefetch_depth"),
            std::string::npos) << l.status();
}

}  // namespace
}  // namespace stowage
