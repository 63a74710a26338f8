// AutoencoderKL's decoder (the Flux VAE that Z-Image uses), written from diffusers'
// autoencoder_kl.py / vae.py Decoder, with diffusers' state-dict names under "decoder.". Only the
// decode path exists: encoder weights in a checkpoint are ignored by the loader.
#ifndef STOWAGE_MODELS_NETS_AUTOENCODER_KL_H_
#define STOWAGE_MODELS_NETS_AUTOENCODER_KL_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"

namespace stowage {

struct AutoencoderKLConfig {
  int64_t latent_channels = 16;
  int64_t out_channels = 3;
  std::vector<int64_t> block_out_channels = {128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t norm_num_groups = 32;
  double scaling_factor = 0.3611;
  double shift_factor = 0.1159;
  bool mid_block_add_attention = true;
};

// Reads a diffusers AutoencoderKL config.json and validates it; `file` names it in errors.
absl::StatusOr<AutoencoderKLConfig> AutoencoderKLConfigFromJson(const google::protobuf::Struct& json,
                                                               const std::string& file = "vae/config.json");

// Checks what the decoder's code assumes (limits: config_checks.h): latent_channels, out_channels
// and norm_num_groups in [1, 2^20]; 1 to 8 block_out_channels (the upscale is 2^(n-1)), each in
// [1, 2^20] and a multiple of norm_num_groups (every group norm runs on one of them);
// layers_per_block in [0, 1024]; scaling_factor in (0, 1e6] (latents are divided by it),
// shift_factor finite in [-1e6, 1e6]; at most 2^36 parameters.
absl::Status Validate(const AutoencoderKLConfig& config, const std::string& file);

// Single-head self-attention over the pixels of a feature map, with a group norm in front.
class VaeAttention : public Module {
 public:
  VaeAttention(int64_t channels, int64_t groups, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  GroupNorm* group_norm_;
  Linear* to_q_;
  Linear* to_k_;
  Linear* to_v_;
  Linear* to_out_;
};

class VaeUpDecoderBlock : public Module {
 public:
  VaeUpDecoderBlock(int64_t in, int64_t out, int64_t layers, bool upsample, int64_t groups,
                    const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  ModuleList<ResnetBlock2D>* resnets_;
  Conv2d* upsample_conv_ = nullptr;
};

class AutoencoderKLDecoder : public Module {
 public:
  AutoencoderKLDecoder(const AutoencoderKLConfig& config, const LayerOptions& options);
  // Latents in model space; applies `z / scaling_factor + shift_factor`, then decodes to
  // [B, out_channels, 8h, 8w] roughly in [-1, 1].
  at::Tensor Decode(const at::Tensor& latents);
  const AutoencoderKLConfig& config() const { return config_; }
  int64_t upscale() const { return int64_t{1} << (config_.block_out_channels.size() - 1); }

 private:
  AutoencoderKLConfig config_;
  Conv2d* conv_in_;
  ResnetBlock2D* mid_resnet0_;
  VaeAttention* mid_attention_ = nullptr;
  ResnetBlock2D* mid_resnet1_;
  ModuleList<VaeUpDecoderBlock>* up_blocks_;
  GroupNorm* conv_norm_out_;
  Conv2d* conv_out_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_AUTOENCODER_KL_H_
