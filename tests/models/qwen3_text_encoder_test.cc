#include "models/nets/qwen3_text_encoder.h"

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/core/weight_init.h"

namespace stowage {
namespace {

Qwen3Config Tiny() {
  Qwen3Config c;
  c.vocab_size = 50;
  c.hidden_size = 32;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 48;
  return c;
}

TEST(Qwen3TextEncoderTest, BuildsTheLayersHiddenStatesMinusTwoNeedsWithTransformersNames) {
  Qwen3TextEncoder encoder(Tiny(), LayerOptions{});
  std::map<std::string, std::vector<int64_t>> shapes;
  encoder.ForEachSlot([&](Module& m, TensorSlot& s) { shapes[m.SlotPath(s)] = s.value.sizes().vec(); });
  EXPECT_EQ(shapes.at("embed_tokens.weight"), (std::vector<int64_t>{50, 32}));
  EXPECT_EQ(shapes.at("layers.1.self_attn.q_proj.weight"), (std::vector<int64_t>{64, 32}));
  EXPECT_EQ(shapes.at("layers.1.self_attn.k_proj.weight"), (std::vector<int64_t>{32, 32}));
  EXPECT_EQ(shapes.at("layers.1.self_attn.o_proj.weight"), (std::vector<int64_t>{32, 64}));
  EXPECT_EQ(shapes.at("layers.0.self_attn.q_norm.weight"), (std::vector<int64_t>{16}));
  EXPECT_EQ(shapes.at("layers.0.mlp.down_proj.weight"), (std::vector<int64_t>{32, 48}));
  EXPECT_EQ(shapes.at("layers.0.post_attention_layernorm.weight"), (std::vector<int64_t>{32}));
  // Three layers in the checkpoint; hidden_states[-2] needs layers 0 and 1 only.
  EXPECT_EQ(shapes.count("layers.2.input_layernorm.weight"), 0u);
  EXPECT_EQ(shapes.count("norm.weight"), 0u);
  EXPECT_EQ(shapes.size(), 1u + 2 * 11);
  EXPECT_EQ(Qwen3UnusedWeightPrefixes(Tiny()), (std::vector<std::string>{"layers.2.", "norm.", "lm_head."}));
}

TEST(Qwen3TextEncoderTest, AttentionIsCausal) {
  Qwen3TextEncoder encoder(Tiny(), LayerOptions{});
  InitializeRandomWeights(encoder, 5);
  c10::InferenceMode guard;
  const at::Tensor ids = at::tensor(std::vector<int64_t>{3, 14, 15, 9, 26, 5});
  const at::Tensor all = encoder.Forward(ids);
  ASSERT_EQ(all.sizes(), (std::vector<int64_t>{6, 32}));
  const at::Tensor prefix = encoder.Forward(ids.slice(0, 0, 4));
  // Earlier tokens do not see later ones; the last token does see the others.
  EXPECT_TRUE(at::allclose(prefix, all.slice(0, 0, 4), 1e-5, 1e-5));
  const at::Tensor changed = encoder.Forward(at::tensor(std::vector<int64_t>{7, 14, 15, 9, 26, 5}));
  EXPECT_FALSE(at::allclose(changed.slice(0, 5, 6), all.slice(0, 5, 6), 1e-4, 1e-4));
  EXPECT_TRUE(all.isfinite().all().item<bool>());
}

TEST(Qwen3TextEncoderTest, ConfigFromJsonValidates) {
  google::protobuf::Struct json;
  (*json.mutable_fields())["num_attention_heads"].set_number_value(32);
  (*json.mutable_fields())["num_key_value_heads"].set_number_value(8);
  (*json.mutable_fields())["rope_theta"].set_number_value(5e6);
  auto c = Qwen3ConfigFromJson(json);
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->rope_theta, 5e6);
  EXPECT_EQ(c->hidden_size, 2560);
  (*json.mutable_fields())["num_key_value_heads"].set_number_value(7);
  EXPECT_EQ(Qwen3ConfigFromJson(json).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stowage
