// A stack of transformer blocks with Z-Image-Turbo's main-block shapes, for the offload benchmark:
// pre-norm self-attention with RMS-normalised queries and keys, SwiGLU feed-forward, and a timestep
// modulation, over [text; image] tokens. Defaults: 30 blocks, dim 3840, 30 heads, FFN 10240.
#ifndef STOWAGE_BENCH_TRANSFORMER_STACK_H_
#define STOWAGE_BENCH_TRANSFORMER_STACK_H_

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "models/core/layers.h"

namespace stowage {

struct TransformerStackConfig {
  int64_t blocks = 30;
  int64_t dim = 3840;
  int64_t heads = 30;
  int64_t ffn = 10240;
  int64_t modulation_dim = 256;
};

class StackTransformerBlock : public Module {
 public:
  StackTransformerBlock(const TransformerStackConfig& config, const LayerOptions& options);
  // x: [B, N, dim]; c: [B, modulation_dim].
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& c);

 private:
  RMSNorm* norm1_;
  SelfAttention* attn_;
  RMSNorm* norm2_;
  Linear* w1_;
  Linear* w2_;
  Linear* w3_;
  Linear* modulation_;
};

class TransformerStack : public Module {
 public:
  TransformerStack(const TransformerStackConfig& config, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& c);

 private:
  Linear* time_proj_;
  ModuleList<StackTransformerBlock>* blocks_;
  RMSNorm* norm_out_;
};

// Fills every tensor of `root` with N(0, 1/fan_in)-scaled values tiled from one random buffer:
// non-zero, varied data (never zeros) at memcpy speed, for billion-parameter benchmarks.
void FillBenchmarkWeights(Module& root, uint64_t seed);

}  // namespace stowage

#endif  // STOWAGE_BENCH_TRANSFORMER_STACK_H_
