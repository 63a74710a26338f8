#include "models/nets/clip_text_encoder.h"

#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "google/protobuf/util/json_util.h"
#include "models/core/weight_init.h"

namespace stowage {
namespace {

ClipTextConfig Tiny() {
  ClipTextConfig c;
  c.vocab_size = 100;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.max_position_embeddings = 16;
  return c;
}

// The state-dict names and shapes transformers' CLIPTextModel has for this config.
TEST(ClipTextEncoderTest, ParameterNamesAndShapesMatchTransformers) {
  ClipTextEncoder model(Tiny(), LayerOptions{});
  std::map<std::string, std::vector<int64_t>> shapes;
  model.ForEachSlot([&](Module& owner, TensorSlot& slot) { shapes[owner.SlotPath(slot)] = slot.value.sizes().vec(); });
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"text_model.embeddings.token_embedding.weight", {100, 32}},
      {"text_model.embeddings.position_embedding.weight", {16, 32}},
      {"text_model.encoder.layers.0.self_attn.q_proj.weight", {32, 32}},
      {"text_model.encoder.layers.0.self_attn.out_proj.bias", {32}},
      {"text_model.encoder.layers.1.layer_norm1.weight", {32}},
      {"text_model.encoder.layers.1.mlp.fc1.weight", {64, 32}},
      {"text_model.encoder.layers.1.mlp.fc2.weight", {32, 64}},
      {"text_model.encoder.layers.1.layer_norm2.bias", {32}},
      {"text_model.final_layer_norm.weight", {32}},
  };
  for (const auto& [name, shape] : expected) {
    ASSERT_EQ(shapes.count(name), 1u) << name;
    EXPECT_EQ(shapes.at(name), shape) << name;
  }
  EXPECT_EQ(shapes.size(), 2u + 2 * 16 + 2);  // Embeddings, 16 tensors per layer, the final norm.
}

// Causal attention: a position never sees later tokens. The pooled vector is the end token's row
// (the largest id for the legacy eos_token_id 2, else the first place of eos_token_id).
TEST(ClipTextEncoderTest, CausalAndPooledAtTheEndToken) {
  ClipTextEncoder model(Tiny(), LayerOptions{});
  InitializeRandomWeights(model, 4);
  c10::InferenceMode guard;
  const at::Tensor ids = at::tensor(std::vector<int64_t>{5, 17, 99, 3, 3, 3, 8, 9, 12, 40, 41, 42}).view({2, 6});
  const ClipTextEncoder::Output out = model.Forward(ids);
  EXPECT_EQ(out.last_hidden_state.sizes(), (std::vector<int64_t>{2, 6, 32}));
  at::Tensor changed = ids.clone();
  changed[0][4] = 50;
  const ClipTextEncoder::Output later = model.Forward(changed);
  EXPECT_TRUE(at::allclose(later.last_hidden_state[0].slice(0, 0, 4), out.last_hidden_state[0].slice(0, 0, 4)));
  EXPECT_FALSE(at::allclose(later.last_hidden_state[0][4], out.last_hidden_state[0][4]));
  EXPECT_TRUE(at::equal(out.pooled[0], out.last_hidden_state[0][2]));  // Id 99 is the largest.
  EXPECT_TRUE(at::equal(out.pooled[1], out.last_hidden_state[1][5]));  // Id 42.
  ClipTextConfig explicit_end = Tiny();
  explicit_end.eos_token_id = 3;
  ClipTextEncoder model3(explicit_end, LayerOptions{});
  InitializeRandomWeights(model3, 4);
  const ClipTextEncoder::Output out3 = model3.Forward(ids);
  EXPECT_TRUE(at::equal(out3.pooled[0], out3.last_hidden_state[0][3]));  // The first 3.
  EXPECT_THROW(model.Forward(at::zeros({1, 17}, at::kLong)), c10::Error);  // Longer than 16 positions.
}

TEST(ClipTextEncoderTest, ConfigFromJsonValidates) {
  google::protobuf::Struct json;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(
                  R"({"vocab_size": 49408, "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                      "num_attention_heads": 12, "max_position_embeddings": 77, "hidden_act": "quick_gelu",
                      "layer_norm_eps": 1e-05, "eos_token_id": 2})",
                  &json)
                  .ok());
  ASSERT_TRUE(ClipTextConfigFromJson(json).ok());
  (*json.mutable_fields())["num_attention_heads"].set_number_value(7);
  EXPECT_NE(ClipTextConfigFromJson(json).status().message().find("num_attention_heads"), std::string::npos);
  (*json.mutable_fields())["num_attention_heads"].set_number_value(12);
  (*json.mutable_fields())["hidden_act"].set_string_value("gelu");
  EXPECT_EQ(ClipTextConfigFromJson(json).status().code(), absl::StatusCode::kUnimplemented);
  (*json.mutable_fields())["hidden_act"].set_string_value("quick_gelu");
  (*json.mutable_fields())["eos_token_id"].set_number_value(49408);
  EXPECT_EQ(ClipTextConfigFromJson(json).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stowage
