// T5EncoderModel (transformers), Flux's second text encoder (T5-XXL): a shared token embedding,
// pre-norm blocks with RMS layer norms (no mean, no bias), unscaled self-attention with a learned
// bucketed relative position bias (computed by the first block, reused by all), a gated-GELU
// feed-forward (tanh GELU of wi_0 times wi_1, then wo), and a final RMS norm. Parameter names match
// transformers' state dict ("shared.weight", "encoder.block.N.layer.M...").
//
// Parity: at a tiny size its hidden states within 4e-7 of transformers' (float32) on the committed reference
// fixtures (//tests/parity:flux_parity_test). models/pipelines/flux_pipeline.h runs it.
#ifndef STOWAGE_MODELS_NETS_T5_ENCODER_H_
#define STOWAGE_MODELS_NETS_T5_ENCODER_H_

#include <cstdint>
#include <string>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"

namespace stowage {

struct T5Config {
  int64_t vocab_size = 32128;
  int64_t d_model = 4096;
  int64_t d_kv = 64;
  int64_t d_ff = 10240;
  int64_t num_layers = 24;
  int64_t num_heads = 64;
  int64_t relative_attention_num_buckets = 32;
  int64_t relative_attention_max_distance = 128;
  double layer_norm_epsilon = 1e-6;
};

// Reads a transformers T5Config config.json (feed_forward_proj must be "gated-gelu") and validates
// it; `file` names it in errors.
absl::StatusOr<T5Config> T5ConfigFromJson(const google::protobuf::Struct& json,
                                          const std::string& file = "text_encoder_2/config.json");
// Sizes in [1, 2^20], layers in [1, 1024], an even number of buckets >= 4, max_distance above half
// the buckets, epsilon in (0, 1], at most 2^36 parameters.
absl::Status Validate(const T5Config& config, const std::string& file);

// The bucket of each relative position (key − query) in a bidirectional encoder: half the buckets
// for each sign; within a half, exact for distances below a quarter of the buckets, then
// logarithmic up to `max_distance`. int64 [q, k] in [0, buckets).
at::Tensor T5RelativePositionBuckets(int64_t query_length, int64_t key_length, int64_t buckets, int64_t max_distance);

class T5Block : public Module {
 public:
  T5Block(const T5Config& config, bool has_relative_bias, const LayerOptions& options);
  // x: [B, S, d_model]; bias: [1 or B, heads, S, S], float32 (position bias plus the mask's lowest
  // float where masked). When `bias` is undefined, this block — the first, which holds
  // relative_attention_bias — computes it from `mask` ([B, S], 1 = attend; optional) inside its own
  // forward, where group offloading has its weights on the device, and leaves it in `bias` for the
  // blocks after it (as transformers' T5 passes position_bias on).
  at::Tensor Forward(const at::Tensor& x, at::Tensor& bias, const at::Tensor& mask);

 private:
  T5Config config_;
  RMSNorm* attention_norm_;
  Linear* q_;
  Linear* k_;
  Linear* v_;
  Linear* o_;
  Embedding* relative_bias_ = nullptr;
  RMSNorm* ff_norm_;
  Linear* wi_0_;
  Linear* wi_1_;
  Linear* wo_;
};

class T5Encoder : public Module {
 public:
  T5Encoder(const T5Config& config, const LayerOptions& options);
  // ids: int64 [B, S]; mask (optional): [B, S], 1 for tokens to attend to. Returns [B, S, d_model].
  at::Tensor Forward(const at::Tensor& ids, const at::Tensor& mask = at::Tensor());
  const T5Config& config() const { return config_; }

 private:
  T5Config config_;
  Embedding* shared_;
  ModuleList<T5Block>* blocks_;
  RMSNorm* final_norm_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_T5_ENCODER_H_
