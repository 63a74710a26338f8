// FluxTransformer2DModel (Flux.1 [dev] and [schnell]), written from diffusers'
// src/diffusers/models/transformers/transformer_flux.py: parameter names match diffusers' state
// dict, so a diffusers-format transformer/ folder binds directly.
//
// Input: packed latents [B, S_img, in_channels] (2x2 latent patches flattened, 64 channels for the
// 16-channel VAE), text features [B, S_txt, joint_attention_dim] (T5), pooled text [B,
// pooled_projection_dim] (CLIP), the timestep (sigma in [0, 1]; scaled by 1000 inside), position ids
// [S_txt, 3] and [S_img, 3] for the three-axis RoPE, and for [dev] (guidance_embeds) the guidance
// scale. Double-stream blocks keep text and image apart except in their joint attention (text
// first); single-stream blocks run on [text; image]. Output [B, S_img, patch² × out_channels].
//
// Parity: [dev] and [schnell] at a tiny size equal diffusers' outputs within 3e-6 (float32) on
// the committed reference fixtures (//tests/parity:flux_parity_test). models/pipelines/flux_pipeline.h runs it.
#ifndef STOWAGE_MODELS_NETS_FLUX_TRANSFORMER_H_
#define STOWAGE_MODELS_NETS_FLUX_TRANSFORMER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/core/layers.h"
#include "models/core/step_graphs.h"

namespace stowage {

struct FluxTransformerConfig {
  int64_t patch_size = 1;
  int64_t in_channels = 64;
  int64_t out_channels = 0;  // 0: in_channels.
  int64_t num_layers = 19;
  int64_t num_single_layers = 38;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 4096;
  int64_t pooled_projection_dim = 768;
  bool guidance_embeds = false;  // true for [dev], false for [schnell].
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t out() const { return out_channels > 0 ? out_channels : in_channels; }
};

// Reads a diffusers transformer config.json and validates it; `file` names it in errors.
absl::StatusOr<FluxTransformerConfig> FluxTransformerConfigFromJson(const google::protobuf::Struct& json,
                                                                   const std::string& file = "transformer/config.json");

// Everything the code assumes, before a tensor is built (limits: config_checks.h): sizes in
// [1, 2^20], layer counts in [0, 1024] (at least one block in all), patch_size 1..64, three even
// axes_dims_rope summing to attention_head_dim, at most 2^36 parameters.
absl::Status Validate(const FluxTransformerConfig& config, const std::string& file);

// The rotary factors of the joint sequence (text positions first) as the blocks take them.
struct FluxRope {
  at::Tensor cos, sin;            // float32 [S_txt + S, head_dim], each angle repeated for its pair.
  at::Tensor pair_cos, pair_sin;  // float32 [S_txt + S, head_dim / 2], one per pair: defined when
                                  // the fused kernels serve the forward (models/core/fused_ops.h).
};

class FluxAttention : public Module {
 public:
  // `joint`: also projects a second (text) stream (add_*_proj, to_add_out); `pre_only`: no to_out.
  FluxAttention(int64_t dim, int64_t heads, int64_t head_dim, bool joint, bool pre_only, const LayerOptions& options);
  // x: [B, S, dim]; context (joint only): [B, S_txt, dim]. Returns the image part and, when joint,
  // the text part.
  std::pair<at::Tensor, at::Tensor> Forward(const at::Tensor& x, const at::Tensor& context, const FluxRope& rope);
  // The same on the fused path (rope.pair_cos defined), from inputs made as the projections need
  // them (a normed input straight into FP8 where every projection runs an FP8 GEMM).
  std::pair<at::Tensor, at::Tensor> Forward(SharedInput& x, SharedInput* context, const FluxRope& rope);
  // The fused path of a single block's attention: q, k, v already projected ([B, S, inner], rows
  // any stride apart: the single block makes them and its MLP input in one GEMM).
  at::Tensor ForwardProjected(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const FluxRope& rope);
  std::vector<Linear*> projections() const { return {to_q_, to_k_, to_v_}; }

 private:
  // Attention over q, k, v [B, S, heads, head_dim] and the output projections (the text rows first
  // when joint).
  std::pair<at::Tensor, at::Tensor> Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool joint,
                                           int64_t text);

  int64_t heads_, head_dim_;
  RMSNorm* norm_q_;
  RMSNorm* norm_k_;
  Linear* to_q_;
  Linear* to_k_;
  Linear* to_v_;
  Linear* to_out_ = nullptr;
  RMSNorm* norm_added_q_ = nullptr;
  RMSNorm* norm_added_k_ = nullptr;
  Linear* add_q_proj_ = nullptr;
  Linear* add_k_proj_ = nullptr;
  Linear* add_v_proj_ = nullptr;
  Linear* to_add_out_ = nullptr;
};

class FluxTransformerBlock : public Module {
 public:
  FluxTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, const LayerOptions& options);
  // Returns (text, image). silu_temb: silu(temb), computed once per forward for every block.
  std::pair<at::Tensor, at::Tensor> Forward(const at::Tensor& x, const at::Tensor& context,
                                            const at::Tensor& silu_temb, const FluxRope& rope);

 private:
  Linear* norm1_;
  Linear* norm1_context_;
  FluxAttention* attn_;
  Linear* ff_in_;
  Linear* ff_out_;
  Linear* ff_context_in_;
  Linear* ff_context_out_;
};

class FluxSingleTransformerBlock : public Module {
 public:
  FluxSingleTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, const LayerOptions& options);
  // x: [text; image] [B, S_txt + S_img, dim]; silu_temb: silu(temb).
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& silu_temb, const FluxRope& rope);

 private:
  Linear* norm_;
  Linear* proj_mlp_;
  Linear* proj_out_;
  FluxAttention* attn_;
};

class FluxTransformer : public Module {
 public:
  FluxTransformer(const FluxTransformerConfig& config, const LayerOptions& options);
  // See the file comment. `guidance`: [B] or undefined; required exactly when guidance_embeds.
  at::Tensor Forward(const at::Tensor& hidden, const at::Tensor& text, const at::Tensor& pooled,
                     const at::Tensor& timestep, const at::Tensor& img_ids, const at::Tensor& txt_ids,
                     const at::Tensor& guidance);
  const FluxTransformerConfig& config() const { return config_; }

  // The blocks and the output layer run as a captured CUDA graph when they can
  // (models/core/step_graphs.h: resident weights, no adapters); these drop the graphs and tell
  // what they did.
  int64_t ReleaseDeviceCaches() override { return graphs_.Release(); }
  StepGraphStats graph_stats() const { return graphs_.stats(); }

  // Exposed for tests: RoPE cos and sin for position ids [S, 3] → [S, head_dim] each, float32, with
  // each frequency repeated for its pair of channels (diffusers' repeat_interleave_real).
  std::pair<at::Tensor, at::Tensor> Rope(const at::Tensor& ids) const;

 private:
  // Sinusoidal embedding of t·1000 (already scaled), 256 channels, [cos, sin] order.
  static at::Tensor TimestepProjection(const at::Tensor& scaled);

  FluxTransformerConfig config_;
  Linear* t_linear_1_;
  Linear* t_linear_2_;
  Linear* g_linear_1_ = nullptr;
  Linear* g_linear_2_ = nullptr;
  Linear* text_linear_1_;
  Linear* text_linear_2_;
  Linear* context_embedder_;
  Linear* x_embedder_;
  ModuleList<FluxTransformerBlock>* blocks_;
  ModuleList<FluxSingleTransformerBlock>* single_blocks_;
  Linear* norm_out_;
  Linear* proj_out_;
  StepGraphs graphs_{"FluxTransformer2DModel"};
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_FLUX_TRANSFORMER_H_
