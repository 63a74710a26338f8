#include "bench/transformer_stack.h"

#include <cmath>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

namespace stowage {

StackTransformerBlock::StackTransformerBlock(const TransformerStackConfig& config,
                                             const LayerOptions& options)
    : Module("StackTransformerBlock") {
  norm1_ = AddChild("norm1", std::make_unique<RMSNorm>(config.dim, 1e-5, true, options));
  attn_ = AddChild("attn", std::make_unique<SelfAttention>(config.dim, config.heads, true, options));
  norm2_ = AddChild("norm2", std::make_unique<RMSNorm>(config.dim, 1e-5, true, options));
  w1_ = AddChild("w1", std::make_unique<Linear>(config.dim, config.ffn, false, options));
  w2_ = AddChild("w2", std::make_unique<Linear>(config.ffn, config.dim, false, options));
  w3_ = AddChild("w3", std::make_unique<Linear>(config.dim, config.ffn, false, options));
  modulation_ = AddChild("modulation",
                         std::make_unique<Linear>(config.modulation_dim, 4 * config.dim, true, options));
}

at::Tensor StackTransformerBlock::Forward(const at::Tensor& x, const at::Tensor& c) {
  ForwardScope scope(*this);
  const std::vector<at::Tensor> mod = modulation_->Forward(c).unsqueeze(1).chunk(4, -1);
  at::Tensor h = x + at::tanh(mod[1]) * attn_->Forward(norm1_->Forward(x) * (1 + mod[0]), at::Tensor());
  const at::Tensor n = norm2_->Forward(h) * (1 + mod[2]);
  return h + at::tanh(mod[3]) * w2_->Forward(at::silu(w1_->Forward(n)) * w3_->Forward(n));
}

TransformerStack::TransformerStack(const TransformerStackConfig& config, const LayerOptions& options)
    : Module("TransformerStack") {
  time_proj_ = AddChild("time_proj", std::make_unique<Linear>(config.modulation_dim,
                                                              config.modulation_dim, true, options));
  blocks_ = AddChild("blocks", std::make_unique<ModuleList<StackTransformerBlock>>());
  for (int64_t i = 0; i < config.blocks; ++i) {
    blocks_->Append(std::make_unique<StackTransformerBlock>(config, options));
  }
  norm_out_ = AddChild("norm_out", std::make_unique<RMSNorm>(config.dim, 1e-5, true, options));
}

at::Tensor TransformerStack::Forward(const at::Tensor& x, const at::Tensor& c) {
  ForwardScope scope(*this);
  const at::Tensor cond = at::silu(time_proj_->Forward(c));
  at::Tensor h = x;
  for (StackTransformerBlock* block : *blocks_) h = block->Forward(h, cond);
  return norm_out_->Forward(h);
}

void FillBenchmarkWeights(Module& root, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::Tensor source = at::randn({int64_t{1} << 22}, gen, at::TensorOptions().dtype(at::kFloat));
  root.ForEachSlot([&](Module& module, TensorSlot& slot) {
    at::Tensor& t = slot.value;
    if (!t.defined() || t.numel() == 0) return;
    const bool is_norm = module.kind().find("Norm") != std::string::npos;
    const double scale = (slot.name == "bias" || t.dim() < 2) ? 0.02 : 1.0 / std::sqrt(double(t.size(1)));
    const at::Tensor pattern = (is_norm ? source.slice(0, 0, 1 << 16) * 0.02 + 1.0 : source * scale).to(t.scalar_type());
    at::Tensor flat = t.view({-1});
    for (int64_t offset = 0; offset < flat.numel(); offset += pattern.numel()) {
      const int64_t n = std::min(pattern.numel(), flat.numel() - offset);
      flat.slice(0, offset, offset + n).copy_(pattern.slice(0, 0, n));
    }
  });
}

}  // namespace stowage
