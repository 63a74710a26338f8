// CLIPTextModel (transformers), the text encoder Flux uses for its pooled prompt vector: token and
// learned position embeddings, pre-norm transformer layers with causal self-attention and a
// quick-GELU MLP, a final LayerNorm. Parameter names match transformers' state dict ("text_model."
// prefix), so a diffusers-format text_encoder/ folder binds directly.
//
// Parity: at a tiny size its last_hidden_state and pooled output within 3e-7 of transformers' (float32) on the committed reference
// fixtures (//tests/parity:flux_parity_test). models/pipelines/flux_pipeline.h runs it.
#ifndef STOWAGE_MODELS_NETS_CLIP_TEXT_ENCODER_H_
#define STOWAGE_MODELS_NETS_CLIP_TEXT_ENCODER_H_

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"

namespace stowage {

struct ClipTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 768;
  int64_t intermediate_size = 3072;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 12;
  int64_t max_position_embeddings = 77;
  double layer_norm_eps = 1e-5;
  // The end-of-text token whose final hidden state is the pooled output. 2 is the legacy value of
  // the original CLIP configs: their pooled position is the largest id's (the end token is the
  // vocabulary's last), as transformers does.
  int64_t eos_token_id = 2;
};

// Reads a transformers CLIPTextConfig config.json and validates it; `file` names it in errors.
absl::StatusOr<ClipTextConfig> ClipTextConfigFromJson(const google::protobuf::Struct& json,
                                                      const std::string& file = "text_encoder/config.json");
// Sizes in [1, 2^20] (vocab, hidden, intermediate, heads, positions), heads dividing hidden, layers
// in [1, 1024], layer_norm_eps in (0, 1], at most 2^36 parameters; hidden_act must be quick_gelu
// (checked by the reader).
absl::Status Validate(const ClipTextConfig& config, const std::string& file);

class ClipEncoderLayer : public Module {
 public:
  ClipEncoderLayer(const ClipTextConfig& config, const LayerOptions& options);
  // x: [B, S, hidden]; causal self-attention.
  at::Tensor Forward(const at::Tensor& x);

 private:
  int64_t heads_;
  LayerNorm* layer_norm1_;
  LayerNorm* layer_norm2_;
  Linear* q_proj_;
  Linear* k_proj_;
  Linear* v_proj_;
  Linear* out_proj_;
  Linear* fc1_;
  Linear* fc2_;
};

class ClipTextEncoder : public Module {
 public:
  struct Output {
    at::Tensor last_hidden_state;  // [B, S, hidden], after the final LayerNorm.
    at::Tensor pooled;             // [B, hidden]: the end token's row.
  };
  ClipTextEncoder(const ClipTextConfig& config, const LayerOptions& options);
  // ids: int64 [B, S], S <= max_position_embeddings (the tokenizer pads or cuts to it).
  Output Forward(const at::Tensor& ids);
  const ClipTextConfig& config() const { return config_; }

 private:
  ClipTextConfig config_;
  Embedding* token_embedding_;
  Embedding* position_embedding_;
  ModuleList<ClipEncoderLayer>* layers_;
  LayerNorm* final_layer_norm_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_CLIP_TEXT_ENCODER_H_
