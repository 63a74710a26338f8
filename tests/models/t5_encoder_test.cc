#include "models/nets/t5_encoder.h"

#include <cstdio>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "google/protobuf/util/json_util.h"
#include "models/core/fused_ops.h"
#include "models/core/layers.h"
#include "models/core/weight_init.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/host_weights.h"

namespace stowage {
namespace {

T5Config Tiny() {
  T5Config c;
  c.vocab_size = 64;
  c.d_model = 32;
  c.d_kv = 8;
  c.d_ff = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  return c;
}

// The state-dict names and shapes transformers' T5EncoderModel has for this config.
TEST(T5EncoderTest, ParameterNamesAndShapesMatchTransformers) {
  T5Encoder model(Tiny(), LayerOptions{});
  std::map<std::string, std::vector<int64_t>> shapes;
  model.ForEachSlot([&](Module& owner, TensorSlot& slot) { shapes[owner.SlotPath(slot)] = slot.value.sizes().vec(); });
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"shared.weight", {64, 32}},
      {"encoder.block.0.layer.0.SelfAttention.q.weight", {32, 32}},
      {"encoder.block.0.layer.0.SelfAttention.o.weight", {32, 32}},
      {"encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight", {32, 4}},
      {"encoder.block.0.layer.0.layer_norm.weight", {32}},
      {"encoder.block.1.layer.1.DenseReluDense.wi_0.weight", {48, 32}},
      {"encoder.block.1.layer.1.DenseReluDense.wi_1.weight", {48, 32}},
      {"encoder.block.1.layer.1.DenseReluDense.wo.weight", {32, 48}},
      {"encoder.block.1.layer.1.layer_norm.weight", {32}},
      {"encoder.final_layer_norm.weight", {32}},
  };
  for (const auto& [name, shape] : expected) {
    ASSERT_EQ(shapes.count(name), 1u) << name;
    EXPECT_EQ(shapes.at(name), shape) << name;
  }
  EXPECT_EQ(shapes.count("encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"), 0u);
  EXPECT_EQ(shapes.size(), 1u + 2 * 9 + 1 + 1);  // Embedding, 9 per block, the bias table, final norm.
}

// transformers' _relative_position_bucket (bidirectional, 32 buckets, max distance 128) for
// chosen relative positions (key − query).
TEST(T5EncoderTest, RelativePositionBucketsFollowT5) {
  const at::Tensor b = T5RelativePositionBuckets(1, 300, 32, 128);  // Query 0: relative = key index.
  // (Powers of two sit on bucket edges where float32 rounding decides; the values here do not.)
  const std::map<int64_t, int64_t> expected = {{0, 0},   {1, 17},  {7, 23},   {8, 24},   {12, 25},
                                               {20, 26}, {40, 28}, {100, 31}, {127, 31}, {299, 31}};
  for (const auto& [relative, bucket] : expected) EXPECT_EQ(b[0][relative].item<int64_t>(), bucket) << relative;
  const at::Tensor n = T5RelativePositionBuckets(300, 1, 32, 128);  // Key 0: relative = −query index.
  const std::map<int64_t, int64_t> negative = {{1, 1}, {7, 7}, {8, 8}, {12, 9}, {20, 10}, {40, 12}, {299, 15}};
  for (const auto& [distance, bucket] : negative) EXPECT_EQ(n[distance][0].item<int64_t>(), bucket) << -distance;
}

TEST(T5EncoderTest, ForwardMaskAndShapes) {
  T5Encoder model(Tiny(), LayerOptions{});
  InitializeRandomWeights(model, 6);
  c10::InferenceMode guard;
  const at::Tensor ids = at::tensor(std::vector<int64_t>{3, 9, 27, 1, 0, 0}).view({1, 6});
  const at::Tensor out = model.Forward(ids);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{1, 6, 32}));
  EXPECT_TRUE(out.isfinite().all().item<bool>());
  // Bidirectional: a later token changes earlier positions (unlike CLIP).
  at::Tensor changed = ids.clone();
  changed[0][3] = 40;
  EXPECT_FALSE(at::allclose(model.Forward(changed)[0][0], out[0][0]));
  // A masked key changes nothing for the others: padding positions are invisible.
  const at::Tensor mask = at::tensor(std::vector<int64_t>{1, 1, 1, 1, 0, 0}).view({1, 6});
  const at::Tensor masked = model.Forward(ids, mask);
  at::Tensor other_pad = ids.clone();
  other_pad[0][5] = 50;
  EXPECT_TRUE(at::allclose(model.Forward(other_pad, mask).slice(1, 0, 4), masked.slice(1, 0, 4), 1e-6, 1e-6));
  EXPECT_FALSE(at::allclose(model.Forward(other_pad).slice(1, 0, 4), out.slice(1, 0, 4)));
}

// Block-level group offloading of encoder.block (how a server streams T5-XXL) changes nothing: the
// relative position bias lives in block 0's weights and is computed inside block 0's forward, while
// its group is on the device (computing it in the stack's forward read offloaded weights).
TEST(T5EncoderTest, GroupOffloadedBlocksGiveTheSameOutput) {
  T5Config config = Tiny();
  config.num_layers = 3;
  T5Encoder model(config, LayerOptions{});
  InitializeRandomWeights(model, 8);
  c10::InferenceMode guard;
  const at::Tensor ids = at::tensor(std::vector<int64_t>{3, 9, 27, 1, 0, 0, 5, 1, 0, 0, 0, 0}).view({2, 6});
  const at::Tensor mask = ids.ne(0).to(at::kLong);
  const at::Tensor expected = model.Forward(ids, mask);
  const at::Tensor unmasked = model.Forward(ids);

  auto weights = HostWeights::Capture(model);
  ASSERT_TRUE(weights.ok()) << weights.status();
  auto backend = CreateSimulatedBackend({});
  GroupOffloadOptions options;
  options.use_stream = true;
  options.block_modules = {"encoder.block"};
  auto offloader = GroupOffloader::Apply("t5", model, **weights, *backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ((*offloader)->stats().streamed_groups, 3);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(model.Forward(ids, mask), expected));
    EXPECT_TRUE(at::equal(model.Forward(ids), unmasked));
  }
  // Without block_modules the default finds encoder.block too (the ModuleList nearest the root).
  offloader->reset();
  options.block_modules.clear();
  auto by_default = GroupOffloader::Apply("t5", model, **weights, *backend, options);
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_EQ((*by_default)->stats().streamed_groups, 3);
  EXPECT_TRUE(at::equal(model.Forward(ids, mask), expected));
}

// FP8 compute (PipelineConfig.compute of text_encoder_2) reaches T5's blocks, which lie inside its
// encoder rather than at the root: the 7 linears of each block convert (embedding, bias table and
// norms stay). Without float8 in the LibTorch the conversion is refused — not a silent 0 layers.
// On a GPU the converted encoder runs its FP8 GEMMs, reported against bf16.
TEST(T5EncoderTest, Fp8ConvertsTheBlocksInsideTheEncoder) {
  T5Config config = Tiny();
  config.d_model = 64;
  config.d_ff = 128;
  T5Encoder model(config, LayerOptions{at::kBFloat16});
  InitializeRandomWeights(model, 12);
  const at::Tensor ids = at::tensor(std::vector<int64_t>{3, 9, 27, 1, 5, 0, 0, 0}).view({1, 8});
  const absl::StatusOr<int64_t> converted = ConvertBlockLinearsToFp8(model);
#ifdef STOWAGE_HAS_FP8
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ(*converted, 2 * 7);
  int scales = 0;
  model.ForEachSlot([&](Module& owner, TensorSlot& slot) {
    const std::string name = owner.SlotPath(slot);
    if (name.size() > 13 && name.compare(name.size() - 13, 13, ".weight_scale") == 0) ++scales;
    if (name == "shared.weight") EXPECT_EQ(slot.value.scalar_type(), at::kBFloat16);
  });
  EXPECT_EQ(scales, 2 * 7);
  if (!at::hasCUDA()) GTEST_SKIP() << "FP8 GEMMs need a GPU";
  T5Encoder reference(config, LayerOptions{at::kBFloat16});
  InitializeRandomWeights(reference, 12);
  auto backend = CreateCudaBackend(0);
  ASSERT_TRUE(backend.ok()) << backend.status();
  auto fp8_weights = HostWeights::Capture(model);
  auto bf16_weights = HostWeights::Capture(reference);
  ASSERT_TRUE(fp8_weights.ok() && bf16_weights.ok());
  ASSERT_TRUE((*fp8_weights)->OnloadAll(**backend).ok());
  ASSERT_TRUE((*bf16_weights)->OnloadAll(**backend).ok());
  c10::InferenceMode guard;
  const at::Tensor cuda_ids = ids.to(at::kCUDA);
  const at::Tensor want = reference.Forward(cuda_ids).to(at::kFloat);
  const at::Tensor got = model.Forward(cuda_ids).to(at::kFloat);
  ASSERT_TRUE(got.isfinite().all().item<bool>());
  const double rel = (got - want).norm().item<double>() / want.norm().item<double>();
  std::printf("t5 tiny fp8 rel_l2 %.4f\n", rel);
  EXPECT_LT(rel, 0.25);
#else
  EXPECT_EQ(converted.status().code(), absl::StatusCode::kUnimplemented) << converted.status();
#endif
}

TEST(T5EncoderTest, ConfigFromJsonValidates) {
  google::protobuf::Struct json;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  R"({"vocab_size": 32128, "d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 24,
                      "num_heads": 64, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
                      "layer_norm_epsilon": 1e-06, "feed_forward_proj": "gated-gelu"})",
                  &json)
                  .ok());
  ASSERT_TRUE(T5ConfigFromJson(json).ok());
  (*json.mutable_fields())["feed_forward_proj"].set_string_value("relu");
  EXPECT_EQ(T5ConfigFromJson(json).status().code(), absl::StatusCode::kUnimplemented);
  (*json.mutable_fields())["feed_forward_proj"].set_string_value("gated-gelu");
  (*json.mutable_fields())["relative_attention_num_buckets"].set_number_value(31);
  EXPECT_NE(T5ConfigFromJson(json).status().message().find("relative_attention_num_buckets"), std::string::npos);
  (*json.mutable_fields())["relative_attention_num_buckets"].set_number_value(32);
  (*json.mutable_fields())["num_layers"].set_number_value(0);
  EXPECT_EQ(T5ConfigFromJson(json).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stowage
