// AutoencoderKL (the Flux VAE that Z-Image uses), written from diffusers' autoencoder_kl.py / vae.py:
// the decoder (state-dict names under "decoder.") and the encoder ("encoder.", "quant_conv.") as two
// modules, so a pipeline places them as two components (the encoder runs only for images in).
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
  int64_t in_channels = 3;
  int64_t latent_channels = 16;
  int64_t out_channels = 3;
  std::vector<int64_t> block_out_channels = {128, 256, 512, 512};
  int64_t layers_per_block = 2;
  int64_t norm_num_groups = 32;
  double scaling_factor = 0.3611;
  double shift_factor = 0.1159;
  bool mid_block_add_attention = true;
  bool use_quant_conv = false;  // The encoder's 1x1 conv after conv_out.
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

// The middle of both halves (diffusers' UNetMidBlock2D at the widest channel count): a resnet, the
// attention (when the config adds it), a resnet; state-dict names "resnets.0", "attentions.0",
// "resnets.1".
class VaeMidBlock : public Module {
 public:
  VaeMidBlock(int64_t channels, int64_t groups, bool attention, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  ResnetBlock2D* resnet0_;
  VaeAttention* attention_ = nullptr;
  ResnetBlock2D* resnet1_;
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
  VaeMidBlock* mid_block_;
  ModuleList<VaeUpDecoderBlock>* up_blocks_;
  GroupNorm* conv_norm_out_;
  Conv2d* conv_out_;
};

class VaeDownEncoderBlock : public Module {
 public:
  VaeDownEncoderBlock(int64_t in, int64_t out, int64_t layers, bool downsample, int64_t groups,
                      const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  ModuleList<ResnetBlock2D>* resnets_;
  Conv2d* downsample_conv_ = nullptr;  // Stride 2 after a (0, 1, 0, 1) zero pad.
};

// The encoder half: pixels [B, in_channels, H, W] in [-1, 1] → the latent distribution's moments.
class AutoencoderKLEncoder : public Module {
 public:
  AutoencoderKLEncoder(const AutoencoderKLConfig& config, const LayerOptions& options);
  // [B, 2 * latent_channels, H / f, W / f]: the mean, then the log-variance (not yet clamped).
  at::Tensor Moments(const at::Tensor& pixels);
  // A sample of the latent distribution in model space, as diffusers' img2img pipelines take it:
  // mean + exp(logvar / 2) · ε with ε ~ N(0, 1) drawn (float32, on the CPU) from `generator`, then
  // (z − shift_factor) · scaling_factor. logvar is clamped to [−30, 20]. Float32 result.
  at::Tensor SampleLatents(const at::Tensor& pixels, at::Generator& generator);
  const AutoencoderKLConfig& config() const { return config_; }
  int64_t downscale() const { return int64_t{1} << (config_.block_out_channels.size() - 1); }

 private:
  AutoencoderKLConfig config_;
  Conv2d* conv_in_;
  ModuleList<VaeDownEncoderBlock>* down_blocks_;
  VaeMidBlock* mid_block_;
  GroupNorm* conv_norm_out_;
  Conv2d* conv_out_;
  Conv2d* quant_conv_ = nullptr;
};

// The state-dict prefixes each half leaves to the other (LoadComponentWeights' `ignored`).
std::vector<std::string> VaeDecoderIgnoredPrefixes();
std::vector<std::string> VaeEncoderIgnoredPrefixes(const AutoencoderKLConfig& config);

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_AUTOENCODER_KL_H_
