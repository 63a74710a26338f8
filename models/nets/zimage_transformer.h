// ZImageTransformer2DModel (Z-Image's S3-DiT), written from diffusers'
// src/diffusers/models/transformers/transformer_z_image.py (basic, non-omni mode): parameter names
// match diffusers' state dict, so a diffusers-format transformer/ folder binds directly.
//
// Sequence: image patches (2×2, padded to a multiple of 32 with a learned pad token) refined by
// `n_refiner_layers` modulated blocks; caption features (RMSNorm + Linear, padded likewise) refined by
// unmodulated blocks; then [image; caption] through `n_layers` modulated blocks with three-axis RoPE
// (caption token k at (1+k, 0, 0); image token (h, w) at (Lc+1, h, w)), and a final adaptive layer.
// Batches: ForwardBatch runs several samples of one image size through one forward (the weights are
// read once for all of them); captions of different lengths are padded to the longest and masked
// out of attention, as diffusers does, so each sample's output matches its own Forward.
#ifndef STOWAGE_MODELS_NETS_ZIMAGE_TRANSFORMER_H_
#define STOWAGE_MODELS_NETS_ZIMAGE_TRANSFORMER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"
#include "models/core/step_graphs.h"

namespace stowage {

struct ZImageTransformerConfig {
  int64_t patch_size = 2;
  int64_t f_patch_size = 1;
  int64_t in_channels = 16;
  int64_t dim = 3840;
  int64_t n_layers = 30;
  int64_t n_refiner_layers = 2;
  int64_t n_heads = 30;
  double norm_eps = 1e-5;
  bool qk_norm = true;
  int64_t cap_feat_dim = 2560;
  double rope_theta = 256.0;
  double t_scale = 1000.0;
  std::vector<int64_t> axes_dims = {32, 48, 48};
  std::vector<int64_t> axes_lens = {1024, 512, 512};

  int64_t head_dim() const { return dim / n_heads; }
  int64_t adaln_dim() const { return dim < 256 ? dim : 256; }
  int64_t ffn_hidden() const { return static_cast<int64_t>(static_cast<double>(dim) / 3.0 * 8.0); }
};

// Reads a diffusers transformer config.json (all_patch_size/all_f_patch_size take the first entry)
// and validates it (Validate below); `file` names it in errors.
absl::StatusOr<ZImageTransformerConfig> ZImageTransformerConfigFromJson(const google::protobuf::Struct& json,
                                                                       const std::string& file = "transformer/config.json");

// Checks everything the model's code assumes, before any tensor is built (limits: config_checks.h):
// sizes in [1, 2^20] (in_channels, dim, n_heads, cap_feat_dim, axes_lens), n_layers in [1, 1024],
// n_refiner_layers in [0, 1024], patch_size in [1, 64], f_patch_size 1 (images are one frame),
// n_heads dividing dim, three axes_dims (each even, >= 2) summing to the head dim, three axes_lens,
// norm_eps in (0, 1], rope_theta in (0, 1e12], t_scale in (0, 1e6], and at most 2^36 parameters
// (RoPE tables included). INVALID_ARGUMENT "<file>: <field> is <value>; must be ...".
absl::Status Validate(const ZImageTransformerConfig& config, const std::string& file);

// The RoPE factors of one sequence as a block takes them.
struct ZImageRope {
  at::Tensor freqs;     // complex [S, head_dim / 2] (shared) or [B, S, head_dim / 2]: the plain path.
  at::Tensor cos, sin;  // Their real and imaginary parts, float32, defined when the fused kernels
                        // serve the forward (models/core/fused_ops.h).
};

class ZImageAttention : public Module {
 public:
  ZImageAttention(const ZImageTransformerConfig& config, const LayerOptions& options);
  // x: [B, S, D]; key_mask: bool [B, S] (true = attend) or undefined (attend to all).
  at::Tensor Forward(const at::Tensor& x, const ZImageRope& rope, const at::Tensor& key_mask = at::Tensor());

 private:
  int64_t heads_;
  Linear* to_q_;
  Linear* to_k_;
  Linear* to_v_;
  Linear* to_out_;
  RMSNorm* norm_q_ = nullptr;
  RMSNorm* norm_k_ = nullptr;
};

class ZImageBlock : public Module {
 public:
  ZImageBlock(const ZImageTransformerConfig& config, bool modulation, const LayerOptions& options);
  // c: [1, adaln_dim] or undefined for unmodulated blocks; key_mask as ZImageAttention's.
  at::Tensor Forward(const at::Tensor& x, const ZImageRope& rope, const at::Tensor& c,
                     const at::Tensor& key_mask = at::Tensor());

 private:
  ZImageAttention* attention_;
  Linear* w1_;
  Linear* w2_;
  Linear* w3_;
  RMSNorm* attention_norm1_;
  RMSNorm* ffn_norm1_;
  RMSNorm* attention_norm2_;
  RMSNorm* ffn_norm2_;
  Linear* modulation_ = nullptr;
};

class ZImageTransformer : public Module {
 public:
  ZImageTransformer(const ZImageTransformerConfig& config, const LayerOptions& options);
  // latents: [C, 1, H, W] (H, W multiples of patch_size) in the model dtype; t: model time in [0, 1]
  // (1 - sigma), float; caption: [L, cap_feat_dim] (no padding). Returns [C, 1, H, W].
  at::Tensor Forward(const at::Tensor& latents, double t, const at::Tensor& caption);
  // Several samples at one timestep in one forward: latents[i] as above, all of one shape;
  // captions[i]: [L_i, cap_feat_dim], lengths may differ. Returns one [C, 1, H, W] per sample. A
  // batch of one is exactly Forward.
  std::vector<at::Tensor> ForwardBatch(const std::vector<at::Tensor>& latents, double t,
                                       const std::vector<at::Tensor>& captions);
  const ZImageTransformerConfig& config() const { return config_; }

  // The forward after the embedders (refiners, main layers, final layer) runs as a captured CUDA
  // graph when it can (models/core/step_graphs.h: resident weights, no adapters, captions of one
  // padded length); these drop the graphs and tell what they did.
  int64_t ReleaseDeviceCaches() override { return graphs_.Release(); }
  StepGraphStats graph_stats() const { return graphs_.stats(); }

  // Exposed for tests: complex RoPE factors for int64 position ids [S, 3] → [S, head_dim / 2].
  at::Tensor RopeFactors(const at::Tensor& positions) const;

 private:
  ZImageTransformerConfig config_;
  std::vector<at::Tensor> rope_tables_;  // Per axis: complex [axes_lens[i], axes_dims[i] / 2].
  // RoPE factors per sequence layout (padded caption length, patch grid, device): every denoising
  // step, both guidance passes of a step and the members of a batch reuse them. The cache holds
  // the layouts of the last grid and device (a few caption lengths).
  struct RopeLayout {
    int64_t lc = -1, ft = -1, ht = -1, wt = -1;
    c10::Device device = c10::Device(c10::kCPU);
    bool operator==(const RopeLayout& o) const {
      return lc == o.lc && ft == o.ft && ht == o.ht && wt == o.wt && device == o.device;
    }
  };
  struct RopeFreqs {
    RopeLayout layout;
    at::Tensor x;    // [nx, head_dim / 2]
    at::Tensor cap;  // [lc, head_dim / 2]
  };
  const RopeFreqs& Freqs(const RopeLayout& layout, int64_t n, int64_t nx);
  std::vector<RopeFreqs> rope_cache_;
  Linear* x_embedder_;
  Linear* final_linear_;
  Linear* final_modulation_;
  Linear* t_fc1_;
  Linear* t_fc2_;
  RMSNorm* cap_norm_;
  Linear* cap_linear_;
  int x_pad_token_;
  int cap_pad_token_;
  ModuleList<ZImageBlock>* noise_refiner_;
  ModuleList<ZImageBlock>* context_refiner_;
  ModuleList<ZImageBlock>* layers_;
  StepGraphs graphs_{"ZImageTransformer2DModel"};
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_ZIMAGE_TRANSFORMER_H_
