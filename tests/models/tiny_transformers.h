// The small Z-Image and Flux transformer configs the GPU tests of models/core build (fused kernels
// against plain, captured graphs against eager): real head dims (128) and block structure, a few
// layers, 256-wide, so a whole forward takes milliseconds.
#ifndef STOWAGE_TESTS_MODELS_TINY_TRANSFORMERS_H_
#define STOWAGE_TESTS_MODELS_TINY_TRANSFORMERS_H_

#include "models/nets/flux_transformer.h"
#include "models/nets/zimage_transformer.h"

namespace stowage {

inline ZImageTransformerConfig TinyZImageTransformerConfig() {
  ZImageTransformerConfig c;
  c.in_channels = 16;
  c.dim = 256;
  c.n_heads = 2;  // head dim 128 = 32 + 48 + 48
  c.n_layers = 2;
  c.n_refiner_layers = 1;
  c.cap_feat_dim = 64;
  c.axes_dims = {32, 48, 48};
  c.axes_lens = {256, 64, 64};
  return c;
}

// Guidance-distilled ([dev]-like): the forward takes a guidance value.
inline FluxTransformerConfig TinyFluxTransformerConfig() {
  FluxTransformerConfig c;
  c.in_channels = 64;
  c.num_layers = 2;
  c.num_single_layers = 2;
  c.attention_head_dim = 128;
  c.num_attention_heads = 2;
  c.joint_attention_dim = 96;
  c.pooled_projection_dim = 32;
  c.guidance_embeds = true;
  c.axes_dims_rope = {16, 56, 56};
  return c;
}

}  // namespace stowage

#endif  // STOWAGE_TESTS_MODELS_TINY_TRANSFORMERS_H_
