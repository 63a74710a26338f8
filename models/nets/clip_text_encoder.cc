#include "models/nets/clip_text_encoder.h"

#include <memory>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "models/core/config_checks.h"
#include "models/core/diffusers_format.h"

namespace stowage {

absl::StatusOr<ClipTextConfig> ClipTextConfigFromJson(const google::protobuf::Struct& json, const std::string& file) {
  ClipTextConfig c;
  ASSIGN_OR_RETURN(c.vocab_size, ConfigInt(json, "vocab_size", c.vocab_size, file));
  ASSIGN_OR_RETURN(c.hidden_size, ConfigInt(json, "hidden_size", c.hidden_size, file));
  ASSIGN_OR_RETURN(c.intermediate_size, ConfigInt(json, "intermediate_size", c.intermediate_size, file));
  ASSIGN_OR_RETURN(c.num_hidden_layers, ConfigInt(json, "num_hidden_layers", c.num_hidden_layers, file));
  ASSIGN_OR_RETURN(c.num_attention_heads, ConfigInt(json, "num_attention_heads", c.num_attention_heads, file));
  ASSIGN_OR_RETURN(c.max_position_embeddings,
                   ConfigInt(json, "max_position_embeddings", c.max_position_embeddings, file));
  ASSIGN_OR_RETURN(c.layer_norm_eps, ConfigDouble(json, "layer_norm_eps", c.layer_norm_eps, file));
  ASSIGN_OR_RETURN(c.eos_token_id, ConfigInt(json, "eos_token_id", c.eos_token_id, file));
  auto act = json.fields().find("hidden_act");
  if (act != json.fields().end() && act->second.string_value() != "quick_gelu") {
    return absl::UnimplementedError(absl::StrCat(file, ": hidden_act '", Truncated(act->second.string_value()),
                                                 "' is not supported; only quick_gelu"));
  }
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const ClipTextConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Size("vocab_size", c.vocab_size)
      .Size("hidden_size", c.hidden_size)
      .Size("intermediate_size", c.intermediate_size)
      .Range("num_hidden_layers", c.num_hidden_layers, 1, kMaxConfigLayers)
      .Size("num_attention_heads", c.num_attention_heads)
      .Divides("num_attention_heads", c.num_attention_heads, "hidden_size", c.hidden_size)
      .Size("max_position_embeddings", c.max_position_embeddings)
      .Above("layer_norm_eps", c.layer_norm_eps, 0.0, 1.0)
      .Range("eos_token_id", c.eos_token_id, 0, c.vocab_size - 1);
  RETURN_IF_ERROR(check.status());
  const int64_t d = c.hidden_size;
  ParameterCount layer;
  layer.Add({4, d + 1, d});                  // q, k, v, out projections.
  layer.Add({d + 1, c.intermediate_size});   // fc1.
  layer.Add({c.intermediate_size + 1, d});   // fc2.
  layer.Add({4, d});                         // Two LayerNorms.
  ParameterCount total;
  total.Add({c.vocab_size + c.max_position_embeddings, d});
  total.Add({2, d});
  total.AddTimes(c.num_hidden_layers, layer);
  return total.Check(file);
}

ClipEncoderLayer::ClipEncoderLayer(const ClipTextConfig& c, const LayerOptions& o)
    : Module("CLIPEncoderLayer"), heads_(c.num_attention_heads) {
  auto* attn = AddChild("self_attn", std::make_unique<Container>("CLIPAttention"));
  k_proj_ = attn->AddChild("k_proj", std::make_unique<Linear>(c.hidden_size, c.hidden_size, true, o));
  v_proj_ = attn->AddChild("v_proj", std::make_unique<Linear>(c.hidden_size, c.hidden_size, true, o));
  q_proj_ = attn->AddChild("q_proj", std::make_unique<Linear>(c.hidden_size, c.hidden_size, true, o));
  out_proj_ = attn->AddChild("out_proj", std::make_unique<Linear>(c.hidden_size, c.hidden_size, true, o));
  layer_norm1_ = AddChild("layer_norm1", std::make_unique<LayerNorm>(c.hidden_size, c.layer_norm_eps, true, o));
  auto* mlp = AddChild("mlp", std::make_unique<Container>("CLIPMLP"));
  fc1_ = mlp->AddChild("fc1", std::make_unique<Linear>(c.hidden_size, c.intermediate_size, true, o));
  fc2_ = mlp->AddChild("fc2", std::make_unique<Linear>(c.intermediate_size, c.hidden_size, true, o));
  layer_norm2_ = AddChild("layer_norm2", std::make_unique<LayerNorm>(c.hidden_size, c.layer_norm_eps, true, o));
}

at::Tensor ClipEncoderLayer::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  const int64_t b = x.size(0), s = x.size(1);
  auto heads = [&](const at::Tensor& t) { return t.view({b, s, heads_, -1}).transpose(1, 2); };
  const at::Tensor h = layer_norm1_->Forward(x);
  const at::Tensor o = ScaledDotProductAttention(heads(q_proj_->Forward(h)), heads(k_proj_->Forward(h)),
                                                 heads(v_proj_->Forward(h)), at::Tensor(), /*causal=*/true);
  const at::Tensor attended = x + out_proj_->Forward(o.transpose(1, 2).reshape({b, s, -1}).to(x.scalar_type()));
  const at::Tensor m = fc1_->Forward(layer_norm2_->Forward(attended));
  return attended + fc2_->Forward(m * at::sigmoid(1.702 * m));  // quick_gelu.
}

ClipTextEncoder::ClipTextEncoder(const ClipTextConfig& c, const LayerOptions& o)
    : Module("CLIPTextModel"), config_(c) {
  auto* text_model = AddChild("text_model", std::make_unique<Container>("CLIPTextTransformer"));
  auto* embeddings = text_model->AddChild("embeddings", std::make_unique<Container>("CLIPTextEmbeddings"));
  token_embedding_ = embeddings->AddChild("token_embedding", std::make_unique<Embedding>(c.vocab_size, c.hidden_size, o));
  position_embedding_ = embeddings->AddChild(
      "position_embedding", std::make_unique<Embedding>(c.max_position_embeddings, c.hidden_size, o));
  auto* encoder = text_model->AddChild("encoder", std::make_unique<Container>("CLIPEncoder"));
  layers_ = encoder->AddChild("layers", std::make_unique<ModuleList<ClipEncoderLayer>>());
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) layers_->Append(std::make_unique<ClipEncoderLayer>(c, o));
  final_layer_norm_ =
      text_model->AddChild("final_layer_norm", std::make_unique<LayerNorm>(c.hidden_size, c.layer_norm_eps, true, o));
}

ClipTextEncoder::Output ClipTextEncoder::Forward(const at::Tensor& ids) {
  ForwardScope scope(*this);
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) >= 1 && ids.size(1) <= config_.max_position_embeddings,
              "ClipTextEncoder: ids must be [B, S] with 1 <= S <= max_position_embeddings (",
              config_.max_position_embeddings, ")");
  const int64_t s = ids.size(1);
  const at::Tensor positions = at::arange(s, ids.options().dtype(at::kLong)).unsqueeze(0);
  at::Tensor x = token_embedding_->Forward(ids) + position_embedding_->Forward(positions);
  for (ClipEncoderLayer* layer : *layers_) x = layer->Forward(x);
  x = final_layer_norm_->Forward(x);
  // The end token's position: the largest id for the legacy eos_token_id 2, else its first place.
  const at::Tensor end = config_.eos_token_id == 2 ? ids.argmax(-1) : ids.eq(config_.eos_token_id).to(at::kInt).argmax(-1);
  const at::Tensor rows = at::arange(ids.size(0), ids.options().dtype(at::kLong));
  return Output{x, x.index({rows, end})};
}

}  // namespace stowage
