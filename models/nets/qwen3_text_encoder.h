// The Qwen3 text encoder as Z-Image's pipeline uses it (transformers' Qwen3Model; the pipeline
// takes hidden_states[-2], the raw output of the second-to-last decoder layer). Only the layers that
// output needs are built; the loader ignores the last layer's and the final norm's weights. Parameter
// names are transformers' ("layers.3.self_attn.q_proj.weight", "embed_tokens.weight", ...).
//
// One unpadded sequence per call: with right padding (the Qwen tokenizer's), causal attention makes
// the kept tokens' features identical to the padded batch's.
#ifndef STOWAGE_MODELS_NETS_QWEN3_TEXT_ENCODER_H_
#define STOWAGE_MODELS_NETS_QWEN3_TEXT_ENCODER_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"

namespace stowage {

struct Qwen3Config {
  int64_t vocab_size = 151936;
  int64_t hidden_size = 2560;
  int64_t num_hidden_layers = 36;
  int64_t num_attention_heads = 32;
  int64_t num_key_value_heads = 8;
  int64_t head_dim = 128;
  int64_t intermediate_size = 9728;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
};

// Reads a transformers Qwen3 config.json and validates it; `file` names it in errors.
absl::StatusOr<Qwen3Config> Qwen3ConfigFromJson(const google::protobuf::Struct& json,
                                                const std::string& file = "text_encoder/config.json");

// Checks what the encoder's code assumes (limits: config_checks.h): vocab_size, hidden_size,
// intermediate_size, num_attention_heads and num_key_value_heads in [1, 2^20]; num_hidden_layers in
// [2, 1024] (hidden_states[-2] needs two); num_key_value_heads dividing num_attention_heads;
// head_dim even (rotate_half) in [2, 2^20]; rms_norm_eps in (0, 1]; rope_theta in (0, 1e12]; at most
// 2^36 parameters.
absl::Status Validate(const Qwen3Config& config, const std::string& file);

// Weight-name prefixes of a full Qwen3Model checkpoint that the encoder does not use (the last layer,
// the final norm, an LM head).
std::vector<std::string> Qwen3UnusedWeightPrefixes(const Qwen3Config& config);

class Qwen3DecoderLayer : public Module {
 public:
  Qwen3DecoderLayer(const Qwen3Config& config, const LayerOptions& options);
  // x: [1, S, hidden]; cos/sin: [S, head_dim] in x's dtype.
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

 private:
  int64_t heads_;
  int64_t kv_heads_;
  int64_t head_dim_;
  Linear* q_proj_;
  Linear* k_proj_;
  Linear* v_proj_;
  Linear* o_proj_;
  RMSNorm* q_norm_;
  RMSNorm* k_norm_;
  Linear* gate_proj_;
  Linear* up_proj_;
  Linear* down_proj_;
  RMSNorm* input_layernorm_;
  RMSNorm* post_attention_layernorm_;
};

class Qwen3TextEncoder : public Module {
 public:
  Qwen3TextEncoder(const Qwen3Config& config, const LayerOptions& options);
  // ids: [L] int64 (no padding). Returns hidden_states[-2]: [L, hidden_size].
  at::Tensor Forward(const at::Tensor& ids);
  const Qwen3Config& config() const { return config_; }

 private:
  Qwen3Config config_;
  Embedding* embed_tokens_;
  ModuleList<Qwen3DecoderLayer>* layers_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_QWEN3_TEXT_ENCODER_H_
