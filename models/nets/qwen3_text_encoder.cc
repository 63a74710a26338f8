#include "models/nets/qwen3_text_encoder.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "models/core/config_checks.h"
#include "models/core/diffusers_format.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

// transformers' rotate_half: (-second half, first half).
at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.slice(-1, half), x.slice(-1, 0, half)}, -1);
}

}  // namespace

absl::StatusOr<Qwen3Config> Qwen3ConfigFromJson(const google::protobuf::Struct& json, const std::string& file) {
  Qwen3Config c;
  ASSIGN_OR_RETURN(c.vocab_size, ConfigInt(json, "vocab_size", c.vocab_size, file));
  ASSIGN_OR_RETURN(c.hidden_size, ConfigInt(json, "hidden_size", c.hidden_size, file));
  ASSIGN_OR_RETURN(c.num_hidden_layers, ConfigInt(json, "num_hidden_layers", c.num_hidden_layers, file));
  ASSIGN_OR_RETURN(c.num_attention_heads, ConfigInt(json, "num_attention_heads", c.num_attention_heads, file));
  ASSIGN_OR_RETURN(c.num_key_value_heads, ConfigInt(json, "num_key_value_heads", c.num_key_value_heads, file));
  ASSIGN_OR_RETURN(c.head_dim, ConfigInt(json, "head_dim", c.head_dim, file));
  ASSIGN_OR_RETURN(c.intermediate_size, ConfigInt(json, "intermediate_size", c.intermediate_size, file));
  ASSIGN_OR_RETURN(c.rms_norm_eps, ConfigDouble(json, "rms_norm_eps", c.rms_norm_eps, file));
  ASSIGN_OR_RETURN(c.rope_theta, ConfigDouble(json, "rope_theta", c.rope_theta, file));
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const Qwen3Config& c, const std::string& file) {
  ConfigCheck check(file);
  check.Size("vocab_size", c.vocab_size)
      .Size("hidden_size", c.hidden_size)
      .Range("num_hidden_layers", c.num_hidden_layers, 2, kMaxConfigLayers)
      .Size("num_attention_heads", c.num_attention_heads)
      .Size("num_key_value_heads", c.num_key_value_heads)
      .Divides("num_key_value_heads", c.num_key_value_heads, "num_attention_heads", c.num_attention_heads)
      .Range("head_dim", c.head_dim, 2, kMaxConfigDim)
      .Even("head_dim", c.head_dim)
      .Size("intermediate_size", c.intermediate_size)
      .Above("rms_norm_eps", c.rms_norm_eps, 0.0, 1.0)
      .Above("rope_theta", c.rope_theta, 0.0, 1e12);
  RETURN_IF_ERROR(check.status());
  const int64_t h = c.hidden_size, q = c.num_attention_heads * c.head_dim, kv = c.num_key_value_heads * c.head_dim;
  ParameterCount layer;
  layer.Add({h, 2 * q + 2 * kv});  // q, o, k, v projections.
  layer.Add({3, h, c.intermediate_size});
  layer.Add({2, h + c.head_dim});  // Norms.
  ParameterCount total;
  total.Add({c.vocab_size, h});
  total.AddTimes(c.num_hidden_layers - 1, layer);  // The last layer is not built.
  return total.Check(file);
}

Qwen3DecoderLayer::Qwen3DecoderLayer(const Qwen3Config& c, const LayerOptions& o)
    : Module("Qwen3DecoderLayer"),
      heads_(c.num_attention_heads),
      kv_heads_(c.num_key_value_heads),
      head_dim_(c.head_dim) {
  auto* attn = AddChild("self_attn", std::make_unique<Container>("Qwen3Attention"));
  q_proj_ = attn->AddChild("q_proj", std::make_unique<Linear>(c.hidden_size, heads_ * head_dim_, false, o));
  k_proj_ = attn->AddChild("k_proj", std::make_unique<Linear>(c.hidden_size, kv_heads_ * head_dim_, false, o));
  v_proj_ = attn->AddChild("v_proj", std::make_unique<Linear>(c.hidden_size, kv_heads_ * head_dim_, false, o));
  o_proj_ = attn->AddChild("o_proj", std::make_unique<Linear>(heads_ * head_dim_, c.hidden_size, false, o));
  q_norm_ = attn->AddChild("q_norm", std::make_unique<RMSNorm>(head_dim_, c.rms_norm_eps, true, o, true));
  k_norm_ = attn->AddChild("k_norm", std::make_unique<RMSNorm>(head_dim_, c.rms_norm_eps, true, o, true));
  auto* mlp = AddChild("mlp", std::make_unique<Container>("Qwen3MLP"));
  gate_proj_ = mlp->AddChild("gate_proj", std::make_unique<Linear>(c.hidden_size, c.intermediate_size, false, o));
  up_proj_ = mlp->AddChild("up_proj", std::make_unique<Linear>(c.hidden_size, c.intermediate_size, false, o));
  down_proj_ = mlp->AddChild("down_proj", std::make_unique<Linear>(c.intermediate_size, c.hidden_size, false, o));
  input_layernorm_ = AddChild("input_layernorm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, true, o, true));
  post_attention_layernorm_ =
      AddChild("post_attention_layernorm", std::make_unique<RMSNorm>(c.hidden_size, c.rms_norm_eps, true, o, true));
}

at::Tensor Qwen3DecoderLayer::Forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  ForwardScope scope(*this);
  const int64_t s = x.size(1);
  const at::Tensor h = input_layernorm_->Forward(x);
  auto heads = [&](const at::Tensor& t, int64_t n) { return t.view({1, s, n, head_dim_}); };
  at::Tensor q = q_norm_->Forward(heads(q_proj_->Forward(h), heads_)).transpose(1, 2);    // [1, H, S, hd]
  at::Tensor k = k_norm_->Forward(heads(k_proj_->Forward(h), kv_heads_)).transpose(1, 2);
  at::Tensor v = heads(v_proj_->Forward(h), kv_heads_).transpose(1, 2);
  const at::Tensor c = cos.unsqueeze(0).unsqueeze(0);
  const at::Tensor sn = sin.unsqueeze(0).unsqueeze(0);
  q = q * c + RotateHalf(q) * sn;
  k = k * c + RotateHalf(k) * sn;
  const int64_t groups = heads_ / kv_heads_;
  k = k.repeat_interleave(groups, 1);
  v = v.repeat_interleave(groups, 1);
  const at::Tensor attn = ScaledDotProductAttention(q, k, v, at::Tensor(), /*causal=*/true);
  const at::Tensor out = x + o_proj_->Forward(attn.transpose(1, 2).reshape({1, s, heads_ * head_dim_}).to(x.scalar_type()));
  const at::Tensor m = post_attention_layernorm_->Forward(out);
  return out + down_proj_->Forward(at::silu(gate_proj_->Forward(m)) * up_proj_->Forward(m));
}

Qwen3TextEncoder::Qwen3TextEncoder(const Qwen3Config& c, const LayerOptions& o)
    : Module("Qwen3Model"), config_(c) {
  embed_tokens_ = AddChild("embed_tokens", std::make_unique<Embedding>(c.vocab_size, c.hidden_size, o));
  layers_ = AddChild("layers", std::make_unique<ModuleList<Qwen3DecoderLayer>>());
  // hidden_states[-2] is the output of layer N-2: layers 0..N-2 are all that run.
  for (int64_t i = 0; i + 1 < c.num_hidden_layers; ++i) {
    layers_->Append(std::make_unique<Qwen3DecoderLayer>(c, o));
  }
}

std::vector<std::string> Qwen3UnusedWeightPrefixes(const Qwen3Config& config) {
  return {absl::StrCat("layers.", config.num_hidden_layers - 1, "."), "norm.", "lm_head."};
}

at::Tensor Qwen3TextEncoder::Forward(const at::Tensor& ids) {
  ForwardScope scope(*this);
  const int64_t s = ids.size(0);
  at::Tensor x = embed_tokens_->Forward(ids.unsqueeze(0));
  // Rotary tables in float32 (inv_freq = theta^(-2j/d), positions 0..S-1), cast to the model dtype.
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(ids.device());
  const at::Tensor inv_freq =
      1.0 / at::pow(config_.rope_theta, at::arange(0, config_.head_dim, 2, f32.dtype(at::kLong)).to(at::kFloat) /
                                            static_cast<double>(config_.head_dim));
  const at::Tensor freqs = at::outer(at::arange(s, f32), inv_freq);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = at::cos(emb).to(x.scalar_type());
  const at::Tensor sin = at::sin(emb).to(x.scalar_type());
  for (Qwen3DecoderLayer* layer : *layers_) x = layer->Forward(x, cos, sin);
  return x.squeeze(0);
}

}  // namespace stowage
