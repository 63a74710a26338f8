#include "models/nets/flux_transformer.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "google/protobuf/util/json_util.h"
#include "models/core/weight_init.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/host_weights.h"

namespace stowage {
namespace {

FluxTransformerConfig Tiny(bool guidance) {
  FluxTransformerConfig c;
  c.in_channels = 16;
  c.num_layers = 1;
  c.num_single_layers = 1;
  c.attention_head_dim = 16;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 24;
  c.pooled_projection_dim = 12;
  c.guidance_embeds = guidance;
  c.axes_dims_rope = {4, 6, 6};
  return c;
}

std::map<std::string, std::vector<int64_t>> Shapes(Module& m) {
  std::map<std::string, std::vector<int64_t>> shapes;
  m.ForEachSlot([&](Module& owner, TensorSlot& slot) { shapes[owner.SlotPath(slot)] = slot.value.sizes().vec(); });
  return shapes;
}

// The state-dict names and shapes diffusers' FluxTransformer2DModel has for this config.
TEST(FluxTransformerTest, ParameterNamesAndShapesMatchDiffusers) {
  FluxTransformer dev(Tiny(true), LayerOptions{});
  const auto shapes = Shapes(dev);
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"time_text_embed.timestep_embedder.linear_1.weight", {32, 256}},
      {"time_text_embed.timestep_embedder.linear_2.bias", {32}},
      {"time_text_embed.guidance_embedder.linear_1.weight", {32, 256}},
      {"time_text_embed.text_embedder.linear_1.weight", {32, 12}},
      {"time_text_embed.text_embedder.linear_2.weight", {32, 32}},
      {"context_embedder.weight", {32, 24}},
      {"x_embedder.weight", {32, 16}},
      {"transformer_blocks.0.norm1.linear.weight", {192, 32}},
      {"transformer_blocks.0.norm1_context.linear.bias", {192}},
      {"transformer_blocks.0.attn.norm_q.weight", {16}},
      {"transformer_blocks.0.attn.norm_added_k.weight", {16}},
      {"transformer_blocks.0.attn.to_q.bias", {32}},
      {"transformer_blocks.0.attn.to_out.0.weight", {32, 32}},
      {"transformer_blocks.0.attn.add_v_proj.weight", {32, 32}},
      {"transformer_blocks.0.attn.to_add_out.bias", {32}},
      {"transformer_blocks.0.ff.net.0.proj.weight", {128, 32}},
      {"transformer_blocks.0.ff.net.2.weight", {32, 128}},
      {"transformer_blocks.0.ff_context.net.2.bias", {32}},
      {"single_transformer_blocks.0.norm.linear.weight", {96, 32}},
      {"single_transformer_blocks.0.proj_mlp.weight", {128, 32}},
      {"single_transformer_blocks.0.proj_out.weight", {32, 160}},
      {"single_transformer_blocks.0.attn.to_k.weight", {32, 32}},
      {"single_transformer_blocks.0.attn.norm_k.weight", {16}},
      {"norm_out.linear.weight", {64, 32}},
      {"proj_out.weight", {16, 32}},
  };
  for (const auto& [name, shape] : expected) {
    ASSERT_EQ(shapes.count(name), 1u) << name;
    EXPECT_EQ(shapes.at(name), shape) << name;
  }
  // 12 embedder tensors, 2 + 2 embedders, 32 per double block, 14 per single block, 4 at the end.
  EXPECT_EQ(shapes.size(), 66u);
  EXPECT_EQ(shapes.count("single_transformer_blocks.0.attn.to_out.0.weight"), 0u);  // pre_only.
  FluxTransformer schnell(Tiny(false), LayerOptions{});
  EXPECT_EQ(Shapes(schnell).size(), 62u);  // No guidance embedder.
}

// RoPE: three axes of interleaved-pair frequencies theta^(-2j/d), each repeated for its channel pair.
TEST(FluxTransformerTest, RopeRepeatsEachAxisFrequencyForItsPair) {
  FluxTransformer model(Tiny(false), LayerOptions{});
  const at::Tensor ids = at::tensor(std::vector<int64_t>{0, 3, 5}).view({1, 3});
  const auto [cos, sin] = model.Rope(ids);
  ASSERT_EQ(cos.sizes(), (std::vector<int64_t>{1, 16}));
  // Axis 1 (dims 4..9, d = 6), pair j = 1: angle 3 / 10000^(2/6), channels 6 and 7.
  const double angle = 3.0 / std::pow(10000.0, 2.0 / 6.0);
  EXPECT_NEAR(cos[0][6].item<double>(), std::cos(angle), 1e-6);
  EXPECT_NEAR(cos[0][7].item<double>(), std::cos(angle), 1e-6);
  EXPECT_NEAR(sin[0][7].item<double>(), std::sin(angle), 1e-6);
  EXPECT_NEAR(cos[0][0].item<double>(), 1.0, 1e-12);  // Axis 0 at position 0.
}

TEST(FluxTransformerTest, ForwardShapesConditioningAndGroupOffloadExactness) {
  FluxTransformer model(Tiny(true), LayerOptions{});
  InitializeRandomWeights(model, 9);
  c10::InferenceMode guard;
  const int64_t img = 12, txt = 5;
  const at::Tensor hidden = at::randn({2, img, 16});
  const at::Tensor text = at::randn({2, txt, 24});
  const at::Tensor pooled = at::randn({2, 12});
  const at::Tensor t = at::full({2}, 0.7);
  const at::Tensor g = at::full({2}, 3.5);
  at::Tensor img_ids = at::zeros({img, 3}, at::kLong);
  img_ids.select(1, 1).copy_(at::arange(img) / 4);
  img_ids.select(1, 2).copy_(at::arange(img) % 4);
  const at::Tensor txt_ids = at::zeros({txt, 3}, at::kLong);
  const at::Tensor a = model.Forward(hidden, text, pooled, t, img_ids, txt_ids, g);
  EXPECT_EQ(a.sizes(), (std::vector<int64_t>{2, img, 16}));
  EXPECT_TRUE(a.isfinite().all().item<bool>());
  EXPECT_TRUE(at::equal(a, model.Forward(hidden, text, pooled, t, img_ids, txt_ids, g)));
  // Every conditioning input reaches the image.
  EXPECT_FALSE(at::equal(a, model.Forward(hidden, text, pooled, at::full({2}, 0.2), img_ids, txt_ids, g)));
  EXPECT_FALSE(at::equal(a, model.Forward(hidden, text, pooled, t, img_ids, txt_ids, at::full({2}, 1.0))));
  EXPECT_FALSE(at::equal(a, model.Forward(hidden, text * 2, pooled, t, img_ids, txt_ids, g)));
  EXPECT_FALSE(at::equal(a, model.Forward(hidden, text, pooled * 2, t, img_ids, txt_ids, g)));
  EXPECT_FALSE(at::equal(a, model.Forward(hidden, text, pooled, t, img_ids.flip(0), txt_ids, g)));
  // Batch members are independent.
  const at::Tensor first = model.Forward(hidden.slice(0, 0, 1), text.slice(0, 0, 1), pooled.slice(0, 0, 1),
                                         t.slice(0, 0, 1), img_ids, txt_ids, g.slice(0, 0, 1));
  EXPECT_LT((first[0] - a[0]).abs().max().item<double>(), 1e-5);
  // [dev] needs guidance; [schnell] refuses it.
  EXPECT_THROW(model.Forward(hidden, text, pooled, t, img_ids, txt_ids, at::Tensor()), c10::Error);
  FluxTransformer schnell(Tiny(false), LayerOptions{});
  InitializeRandomWeights(schnell, 9);
  EXPECT_THROW(schnell.Forward(hidden, text, pooled, t, img_ids, txt_ids, g), c10::Error);

  // Group offloading (the two block lists stream) changes nothing.
  auto weights = *HostWeights::Capture(model);
  auto backend = CreateSimulatedBackend({});
  GroupOffloadOptions options;
  options.use_stream = true;
  auto offloader = GroupOffloader::Apply("flux", model, *weights, *backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ((*offloader)->stats().streamed_groups, 2);
  for (int i = 0; i < 2; ++i) {
    EXPECT_TRUE(at::equal(model.Forward(hidden, text, pooled, t, img_ids, txt_ids, g), a));
  }
}

TEST(FluxTransformerTest, ConfigFromJsonValidates) {
  google::protobuf::Struct json;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  R"({"_class_name": "FluxTransformer2DModel", "in_channels": 64, "num_layers": 19,
                      "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
                      "joint_attention_dim": 4096, "pooled_projection_dim": 768, "guidance_embeds": true,
                      "axes_dims_rope": [16, 56, 56], "out_channels": null, "patch_size": 1})",
                  &json)
                  .ok());
  auto dev = FluxTransformerConfigFromJson(json);
  ASSERT_TRUE(dev.ok()) << dev.status();
  EXPECT_TRUE(dev->guidance_embeds);
  EXPECT_EQ(dev->inner_dim(), 3072);
  EXPECT_EQ(dev->out(), 64);
  (*json.mutable_fields())["axes_dims_rope"].mutable_list_value()->mutable_values(0)->set_number_value(18);
  auto bad = FluxTransformerConfigFromJson(json, "flux/config.json");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("sum of axes_dims_rope"), std::string::npos) << bad.status();
  (*json.mutable_fields())["axes_dims_rope"].mutable_list_value()->mutable_values(0)->set_number_value(16);
  (*json.mutable_fields())["num_layers"].set_number_value(-1);
  EXPECT_NE(FluxTransformerConfigFromJson(json).status().message().find("num_layers"), std::string::npos);
  (*json.mutable_fields())["num_layers"].set_number_value(1e9);
  EXPECT_EQ(FluxTransformerConfigFromJson(json).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stowage
