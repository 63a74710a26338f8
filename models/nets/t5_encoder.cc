#include "models/nets/t5_encoder.h"

#include <cmath>
#include <limits>
#include <memory>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "models/core/config_checks.h"
#include "models/core/diffusers_format.h"

namespace stowage {

absl::StatusOr<T5Config> T5ConfigFromJson(const google::protobuf::Struct& json, const std::string& file) {
  T5Config c;
  ASSIGN_OR_RETURN(c.vocab_size, ConfigInt(json, "vocab_size", c.vocab_size, file));
  ASSIGN_OR_RETURN(c.d_model, ConfigInt(json, "d_model", c.d_model, file));
  ASSIGN_OR_RETURN(c.d_kv, ConfigInt(json, "d_kv", c.d_kv, file));
  ASSIGN_OR_RETURN(c.d_ff, ConfigInt(json, "d_ff", c.d_ff, file));
  ASSIGN_OR_RETURN(c.num_layers, ConfigInt(json, "num_layers", c.num_layers, file));
  ASSIGN_OR_RETURN(c.num_heads, ConfigInt(json, "num_heads", c.num_heads, file));
  ASSIGN_OR_RETURN(c.relative_attention_num_buckets,
                   ConfigInt(json, "relative_attention_num_buckets", c.relative_attention_num_buckets, file));
  ASSIGN_OR_RETURN(c.relative_attention_max_distance,
                   ConfigInt(json, "relative_attention_max_distance", c.relative_attention_max_distance, file));
  ASSIGN_OR_RETURN(c.layer_norm_epsilon, ConfigDouble(json, "layer_norm_epsilon", c.layer_norm_epsilon, file));
  auto ff = json.fields().find("feed_forward_proj");
  if (ff != json.fields().end() && ff->second.string_value() != "gated-gelu") {
    return absl::UnimplementedError(absl::StrCat(file, ": feed_forward_proj '", Truncated(ff->second.string_value()),
                                                 "' is not supported; only gated-gelu (T5 v1.1, as Flux uses)"));
  }
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const T5Config& c, const std::string& file) {
  ConfigCheck check(file);
  check.Size("vocab_size", c.vocab_size)
      .Size("d_model", c.d_model)
      .Size("d_kv", c.d_kv)
      .Size("d_ff", c.d_ff)
      .Range("num_layers", c.num_layers, 1, kMaxConfigLayers)
      .Size("num_heads", c.num_heads)
      .Range("relative_attention_num_buckets", c.relative_attention_num_buckets, 4, 4096)
      .Even("relative_attention_num_buckets", c.relative_attention_num_buckets)
      .Range("relative_attention_max_distance", c.relative_attention_max_distance,
             c.relative_attention_num_buckets / 2 + 1, 1 << 20)
      .Above("layer_norm_epsilon", c.layer_norm_epsilon, 0.0, 1.0);
  RETURN_IF_ERROR(check.status());
  check.Size("inner dim num_heads * d_kv", c.num_heads * c.d_kv);
  RETURN_IF_ERROR(check.status());
  const int64_t inner = c.num_heads * c.d_kv;
  ParameterCount block;
  block.Add({4, c.d_model, inner});   // q, k, v, o.
  block.Add({3, c.d_model, c.d_ff});  // wi_0, wi_1, wo.
  block.Add({2, c.d_model});          // Two norms.
  ParameterCount total;
  total.Add({c.vocab_size + 1, c.d_model});  // Shared embedding, final norm.
  total.Add({c.relative_attention_num_buckets, c.num_heads});
  total.AddTimes(c.num_layers, block);
  return total.Check(file);
}

at::Tensor T5RelativePositionBuckets(int64_t query_length, int64_t key_length, int64_t buckets, int64_t max_distance) {
  const at::TensorOptions i64 = at::TensorOptions().dtype(at::kLong);
  const at::Tensor relative = at::arange(key_length, i64).unsqueeze(0) - at::arange(query_length, i64).unsqueeze(1);
  const int64_t half = buckets / 2;
  at::Tensor result = relative.gt(0).to(at::kLong) * half;
  const at::Tensor distance = relative.abs();
  const int64_t max_exact = half / 2;
  const at::Tensor large =
      (max_exact + (at::log(distance.to(at::kFloat) / static_cast<double>(max_exact)) /
                    std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                    static_cast<double>(half - max_exact))
                       .to(at::kLong))
          .clamp_max(half - 1);
  return result + at::where(distance.lt(max_exact), distance, large);
}

T5Block::T5Block(const T5Config& c, bool has_relative_bias, const LayerOptions& o) : Module("T5Block"), config_(c) {
  const int64_t inner = c.num_heads * c.d_kv;
  auto* layers = AddChild("layer", std::make_unique<Sequential>());
  auto* attention = layers->Add(std::make_unique<Container>("T5LayerSelfAttention"));
  auto* self = attention->AddChild("SelfAttention", std::make_unique<Container>("T5Attention"));
  q_ = self->AddChild("q", std::make_unique<Linear>(c.d_model, inner, false, o));
  k_ = self->AddChild("k", std::make_unique<Linear>(c.d_model, inner, false, o));
  v_ = self->AddChild("v", std::make_unique<Linear>(c.d_model, inner, false, o));
  o_ = self->AddChild("o", std::make_unique<Linear>(inner, c.d_model, false, o));
  if (has_relative_bias) {
    relative_bias_ = self->AddChild("relative_attention_bias",
                                    std::make_unique<Embedding>(c.relative_attention_num_buckets, c.num_heads, o));
  }
  // T5LayerNorm: RMS in float32, the weight applied in the weight's dtype.
  attention_norm_ =
      attention->AddChild("layer_norm", std::make_unique<RMSNorm>(c.d_model, c.layer_norm_epsilon, true, o, true));
  auto* ff = layers->Add(std::make_unique<Container>("T5LayerFF"));
  auto* dense = ff->AddChild("DenseReluDense", std::make_unique<Container>("T5DenseGatedActDense"));
  wi_0_ = dense->AddChild("wi_0", std::make_unique<Linear>(c.d_model, c.d_ff, false, o));
  wi_1_ = dense->AddChild("wi_1", std::make_unique<Linear>(c.d_model, c.d_ff, false, o));
  wo_ = dense->AddChild("wo", std::make_unique<Linear>(c.d_ff, c.d_model, false, o));
  ff_norm_ = ff->AddChild("layer_norm", std::make_unique<RMSNorm>(c.d_model, c.layer_norm_epsilon, true, o, true));
}

at::Tensor T5Block::Forward(const at::Tensor& x, at::Tensor& bias, const at::Tensor& mask) {
  ForwardScope scope(*this);
  const int64_t b = x.size(0), s = x.size(1);
  if (!bias.defined()) {
    TORCH_CHECK(relative_bias_ != nullptr, "T5Block: only the first block has the relative position bias");
    const at::Tensor buckets = T5RelativePositionBuckets(s, s, config_.relative_attention_num_buckets,
                                                         config_.relative_attention_max_distance)
                                   .to(x.device());
    bias = relative_bias_->Forward(buckets).permute({2, 0, 1}).unsqueeze(0).to(at::kFloat);  // [1, heads, q, k]
    if (mask.defined()) {
      // Masked keys get the float minimum, as transformers' extended attention mask does.
      const at::Tensor masked = mask.to(x.device()).eq(0).unsqueeze(1).unsqueeze(1);  // [B, 1, 1, S]
      bias = bias.expand({b, -1, -1, -1}).masked_fill(masked, std::numeric_limits<float>::lowest());
    }
  }
  auto heads = [&](const at::Tensor& t) { return t.view({b, s, config_.num_heads, config_.d_kv}).transpose(1, 2); };
  const at::Tensor h = attention_norm_->Forward(x);
  const at::Tensor q = heads(q_->Forward(h)), k = heads(k_->Forward(h)), v = heads(v_->Forward(h));
  // T5 does not scale the scores by 1/sqrt(d_kv); softmax in float32.
  const at::Tensor scores = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)) + bias;
  const at::Tensor attended = at::matmul(at::softmax(scores, -1).to(v.scalar_type()), v);
  at::Tensor y = x + o_->Forward(attended.transpose(1, 2).reshape({b, s, -1}));
  const at::Tensor f = ff_norm_->Forward(y);
  return y + wo_->Forward(at::gelu(wi_0_->Forward(f), "tanh") * wi_1_->Forward(f));
}

T5Encoder::T5Encoder(const T5Config& c, const LayerOptions& o) : Module("T5EncoderModel"), config_(c) {
  shared_ = AddChild("shared", std::make_unique<Embedding>(c.vocab_size, c.d_model, o));
  auto* encoder = AddChild("encoder", std::make_unique<Container>("T5Stack"));
  blocks_ = encoder->AddChild("block", std::make_unique<ModuleList<T5Block>>());
  for (int64_t i = 0; i < c.num_layers; ++i) blocks_->Append(std::make_unique<T5Block>(c, /*has_relative_bias=*/i == 0, o));
  final_norm_ =
      encoder->AddChild("final_layer_norm", std::make_unique<RMSNorm>(c.d_model, c.layer_norm_epsilon, true, o, true));
}

at::Tensor T5Encoder::Forward(const at::Tensor& ids, const at::Tensor& mask) {
  ForwardScope scope(*this);
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) >= 1, "T5Encoder: ids must be [B, S] with S >= 1");
  at::Tensor x = shared_->Forward(ids);
  at::Tensor bias;  // The first block computes it.
  for (T5Block* block : *blocks_) x = block->Forward(x, bias, mask);
  return final_norm_->Forward(x);
}

}  // namespace stowage
