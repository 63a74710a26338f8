// The built-in pipeline's architectures, small enough to run on a CPU in well under a second:
// a byte-level text encoder, a DiT denoiser (single-stream joint attention over text and image
// tokens, adaptive norms from the timestep) and a convolutional VAE decoder (8× upsampling).
// Structurally they have what offloading must handle in real models: block lists, parameters
// owned by non-leaf modules, nested blocks (the VAE's up blocks).
#ifndef STOWAGE_MODELS_PIPELINES_TINY_MODELS_H_
#define STOWAGE_MODELS_PIPELINES_TINY_MODELS_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"

namespace stowage {

struct TinyTextEncoderConfig {
  int64_t vocab_size = 259;
  int64_t max_tokens = 128;
  int64_t dim = 64;
  int64_t heads = 4;
  int64_t layers = 2;
};

// Config readers (a config.json written by SaveTinyPipeline; absent fields keep `defaults`') and
// validators. Each reader validates; `file` names the file in errors. Limits: config_checks.h.
// Text encoder: vocab_size in [259, 2^20] (the byte tokenizer's ids go to 258); max_tokens in
// [3, 65536] (BOS, EOS and a byte); dim and heads in [1, 2^20], heads dividing dim; layers in
// [0, 1024]; at most 2^36 parameters.
absl::StatusOr<TinyTextEncoderConfig> TinyTextEncoderConfigFromJson(const google::protobuf::Struct& json,
                                                                    const TinyTextEncoderConfig& defaults,
                                                                    const std::string& file);
absl::Status Validate(const TinyTextEncoderConfig& config, const std::string& file);

class TinyTextEncoderLayer : public Module {
 public:
  TinyTextEncoderLayer(const TinyTextEncoderConfig& config, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& mask);

 private:
  RMSNorm* norm1_;
  SelfAttention* attn_;
  RMSNorm* norm2_;
  FeedForward* ff_;
};

class TinyTextEncoder : public Module {
 public:
  TinyTextEncoder(const TinyTextEncoderConfig& config, const LayerOptions& options);
  // ids: [B, L] int64; mask: [B, L] bool. Returns hidden states [B, L, dim].
  at::Tensor Forward(const at::Tensor& ids, const at::Tensor& mask);
  const TinyTextEncoderConfig& config() const { return config_; }

 private:
  TinyTextEncoderConfig config_;
  Embedding* embed_;
  int position_;  // [max_tokens, dim], owned by the root: a parameter-only group under leaf level.
  ModuleList<TinyTextEncoderLayer>* layers_;
  RMSNorm* norm_;
};

struct TinyDiTConfig {
  int64_t in_channels = 4;
  int64_t patch_size = 2;
  int64_t dim = 96;
  int64_t heads = 4;
  int64_t layers = 4;
  int64_t text_dim = 64;
  int64_t mlp_ratio = 4;
  int64_t timestep_dim = 256;
};

// in_channels, text_dim in [1, 2^20]; patch_size in [1, 64]; dim in [4, 2^20] (the 2-D position
// embedding splits it in quarters); heads dividing dim; layers in [0, 1024]; mlp_ratio in [1, 64];
// timestep_dim even in [2, 2^20] (cos and sin halves); at most 2^36 parameters.
absl::StatusOr<TinyDiTConfig> TinyDiTConfigFromJson(const google::protobuf::Struct& json,
                                                    const TinyDiTConfig& defaults, const std::string& file);
absl::Status Validate(const TinyDiTConfig& config, const std::string& file);

class DiTBlock : public Module {
 public:
  DiTBlock(const TinyDiTConfig& config, const LayerOptions& options);
  // x: [B, N, dim]; c: [B, dim] conditioning; mask: [B, N] bool.
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& c, const at::Tensor& mask);

 private:
  LayerNorm* norm1_;
  SelfAttention* attn_;
  LayerNorm* norm2_;
  FeedForward* ff_;
  Linear* modulation_;
};

class TinyDiT : public Module {
 public:
  TinyDiT(const TinyDiTConfig& config, const LayerOptions& options);
  // latents: [B, C, H, W] (H, W multiples of patch_size); timestep: [B] in [0, 1000];
  // text: [B, L, text_dim]; text_mask: [B, L] bool. Returns the predicted velocity, like latents.
  at::Tensor Forward(const at::Tensor& latents, const at::Tensor& timestep, const at::Tensor& text,
                     const at::Tensor& text_mask);
  const TinyDiTConfig& config() const { return config_; }

 private:
  TinyDiTConfig config_;
  Linear* patch_embed_;
  Linear* text_proj_;
  Linear* time_fc1_;
  Linear* time_fc2_;
  ModuleList<DiTBlock>* blocks_;
  LayerNorm* norm_out_;
  Linear* modulation_out_;
  Linear* proj_out_;
};

struct TinyVaeDecoderConfig {
  int64_t latent_channels = 4;
  // Channels of conv_in, then of each up block (each doubles the resolution).
  std::vector<int64_t> channels = {64, 48, 32, 32};
  int64_t groups = 8;
  double scaling_factor = 1.0;
  double shift_factor = 0.0;
};

// latent_channels, groups in [1, 2^20]; 2 to 8 block_out_channels, each in [1, 2^20] and a multiple
// of groups; scaling_factor in (0, 1e6]; shift_factor in [-1e6, 1e6]; at most 2^36 parameters.
absl::StatusOr<TinyVaeDecoderConfig> TinyVaeDecoderConfigFromJson(const google::protobuf::Struct& json,
                                                                  const TinyVaeDecoderConfig& defaults,
                                                                  const std::string& file);
absl::Status Validate(const TinyVaeDecoderConfig& config, const std::string& file);

class VaeUpBlock : public Module {
 public:
  VaeUpBlock(int64_t in, int64_t out, int64_t groups, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  ResnetBlock2D* resnet_;
  Conv2d* upsample_conv_;
};

class TinyVaeDecoder : public Module {
 public:
  TinyVaeDecoder(const TinyVaeDecoderConfig& config, const LayerOptions& options);
  // latents: [B, latent_channels, h, w] in model space. Returns [B, 3, 8h, 8w] in [-1, 1]-ish.
  at::Tensor Forward(const at::Tensor& latents);
  const TinyVaeDecoderConfig& config() const { return config_; }
  int64_t upscale() const { return int64_t{1} << (config_.channels.size() - 1); }

 private:
  TinyVaeDecoderConfig config_;
  Conv2d* conv_in_;
  ResnetBlock2D* mid_;
  ModuleList<VaeUpBlock>* up_blocks_;
  GroupNorm* norm_out_;
  Conv2d* conv_out_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_TINY_MODELS_H_
