#include "models/core/layers.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <set>

#include <ATen/ATen.h>
#include <ATen/ExpandUtils.h>
#include <torch/version.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "models/core/conv_lane.h"
#include "models/core/fused_ops.h"
#include "offload/safetensors.h"

namespace stowage {

namespace {
std::atomic<bool> packed_lora_everywhere{false};
}  // namespace

void SetPackedLoraEverywhere(bool on) { packed_lora_everywhere.store(on); }

namespace {

at::Tensor Empty(at::IntArrayRef shape, const LayerOptions& options) {
  return at::empty(shape, at::TensorOptions().dtype(options.dtype));
}

}  // namespace

Linear::Linear(int64_t in_features, int64_t out_features, bool bias, const LayerOptions& options)
    : Module("Linear"), in_features_(in_features), out_features_(out_features) {
  weight_ = AddParameter("weight", Empty({out_features, in_features}, options));
  if (bias) bias_ = AddParameter("bias", Empty({out_features}, options));
}

at::Tensor Linear::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  if (weight_scale_ >= 0) {
    return WithLoras(x, fused::Fp8Linear(x, tensor(weight_), tensor(weight_scale_), bias_ >= 0 ? tensor(bias_) : at::Tensor()));
  }
  return WithLoras(x, at::linear(x, tensor(weight_), bias_ >= 0 ? tensor(bias_) : at::Tensor()));
}

bool Linear::LoraActive() const { return AnyLoraActive(loras_); }

at::Tensor Linear::WithLoras(const at::Tensor& x, at::Tensor y) const {
  if (loras_.empty()) return y;
  // Mixed batches run packed where the fused kernels run (CUDA): two products a layer whatever the
  // number of adapters; elsewhere one adapter at a time, bit for bit what a request gets alone.
  return AddLoraDelta(loras_, x, std::move(y),
                      fused::Active(x) || packed_lora_everywhere.load() ? &lora_pack_ : nullptr);
}

absl::Status Linear::AttachLora(const std::string& name, LoraWeights weights) {
  const at::Tensor& a = weights.A();
  const at::Tensor& b = weights.B();
  if (!a.defined() || !b.defined() || a.dim() != 2 || b.dim() != 2 || a.size(1) != in_features_ ||
      b.size(0) != out_features_ || b.size(1) != a.size(0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        path(), ": a LoRA for this layer has A [rank, ", in_features_, "] and B [", out_features_,
        ", rank]; got A ", a.defined() ? c10::str(a.sizes()) : "none", " and B ",
        b.defined() ? c10::str(b.sizes()) : "none"));
  }
  loras_[name] = std::move(weights);
  lora_pack_ = LoraPack();
  return absl::OkStatus();
}

bool Linear::DetachLora(const std::string& name) {
  lora_pack_ = LoraPack();
  return loras_.erase(name) > 0;
}

namespace {

// The tensors, one after another in one storage (each contiguous, same dtype, trailing sizes and
// device), viewed as one tensor along dim 0; undefined when they are not laid out that way.
at::Tensor AdjacentRows(const std::vector<at::Tensor>& tensors) {
  const at::Tensor& first = tensors.front();
  if (!first.defined() || !first.is_contiguous()) return at::Tensor();
  int64_t rows = 0;
  const char* next = static_cast<const char*>(first.data_ptr());
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.is_contiguous() || t.scalar_type() != first.scalar_type() || t.device() != first.device() ||
        t.dim() != first.dim() || t.sizes().slice(1) != first.sizes().slice(1) ||
        !t.storage().is_alias_of(first.storage()) || static_cast<const char*>(t.data_ptr()) != next) {
      return at::Tensor();
    }
    rows += t.size(0);
    next += t.nbytes();
  }
  std::vector<int64_t> sizes = first.sizes().vec();
  sizes[0] = rows;
  return first.as_strided(sizes, first.strides());
}

}  // namespace

void Linear::DeclareAdjacent(Module& owner, const std::vector<Linear*>& layers) {
  std::vector<std::pair<Module*, int>> weights, biases;
  for (Linear* l : layers) {
    weights.emplace_back(l, l->weight_);
    if (l->bias_ >= 0) biases.emplace_back(l, l->bias_);
  }
  owner.AddAdjacentGroup(std::move(weights));
  if (biases.size() == layers.size()) owner.AddAdjacentGroup(std::move(biases));
}

at::Tensor Linear::ForwardGelu(const at::Tensor& x) {
  ForwardScope scope(*this);
  const at::Tensor& w = tensor(weight_);
  if (weight_scale_ < 0 && bias_ >= 0 && fused::Active(x) && w.scalar_type() == x.scalar_type() && !LoraActive()) {
    // cuBLASLt's GELU_BIAS epilogue (the tanh approximation) on the [tokens, in] view of x.
    const at::Tensor x2d = x.reshape({-1, in_features_});
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = out_features_;
    return at::_addmm_activation(tensor(bias_), x2d, w.t(), 1, 1, /*use_gelu=*/true).view(shape);
  }
  const at::Tensor y = weight_scale_ >= 0 ? fused::Fp8Linear(x, w, tensor(weight_scale_),
                                                             bias_ >= 0 ? tensor(bias_) : at::Tensor())
                                          : at::linear(x, w, bias_ >= 0 ? tensor(bias_) : at::Tensor());
  return at::gelu(WithLoras(x, y), "tanh");
}

SharedInput SharedInput::LayerNormModulated(at::Tensor x, at::Tensor scale, at::Tensor shift, double eps) {
  // A modulation that broadcasts x to a larger shape (one row of x for a batch of modulations): the
  // values are made now, so that probe() has the readers' input shape.
  if (at::infer_size(x.sizes(), at::infer_size(scale.sizes(), shift.sizes())) != x.sizes()) {
    return SharedInput(fused::LayerNormModulate(x, scale, shift, eps));
  }
  SharedInput in{at::Tensor()};
  in.source_ = std::move(x);
  in.scale_ = std::move(scale);
  in.shift_ = std::move(shift);
  in.eps_ = eps;
  return in;
}

const at::Tensor& SharedInput::Values() {
  if (!x_.defined()) x_ = fused::LayerNormModulate(source_, scale_, shift_, eps_);
  return x_;
}

const fused::Fp8Input& SharedInput::Fp8() {
  if (fp8_made_) return fp8_;
  fp8_made_ = true;
  if (!x_.defined()) fp8_ = fused::LayerNormModulateFp8(source_, scale_, shift_, eps_);
  if (!fp8_.q.defined()) fp8_ = fused::QuantizeInputFp8(Values());
  return fp8_;
}

std::vector<at::Tensor> Linear::ForwardShared(const std::vector<Linear*>& layers, const at::Tensor& x) {
  SharedInput in(x);
  return ForwardShared(layers, in);
}

Linear::Combined Linear::Combine(const std::vector<Linear*>& layers, int64_t in_features) {
  std::vector<at::Tensor> weights, scales, biases;
  for (const Linear* l : layers) {
    weights.push_back(l->slots()[static_cast<size_t>(l->weight_)].value);
    if (l->weight_scale_ >= 0) scales.push_back(l->slots()[static_cast<size_t>(l->weight_scale_)].value);
    if (l->bias_ >= 0) biases.push_back(l->slots()[static_cast<size_t>(l->bias_)].value);
  }
  Combined c{AdjacentRows(weights), scales.empty() ? at::Tensor() : AdjacentRows(scales),
             biases.empty() ? at::Tensor() : AdjacentRows(biases)};
  const bool scales_ok = scales.empty() || (scales.size() == layers.size() && c.scale.defined());
  const bool biases_ok = biases.empty() || (biases.size() == layers.size() && c.bias.defined());
  if (!c.weight.defined() || c.weight.size(1) != in_features || !scales_ok || !biases_ok) return {};
  return c;
}

std::vector<at::Tensor> Linear::SplitColumns(const std::vector<Linear*>& layers, const at::Tensor& y) {
  std::vector<at::Tensor> out;
  out.reserve(layers.size());
  int64_t column = 0;
  for (const Linear* l : layers) {
    out.push_back(y.narrow(-1, column, l->out_features_));
    column += l->out_features_;
  }
  return out;
}

std::vector<at::Tensor> Linear::ForwardShared(const std::vector<Linear*>& layers, SharedInput& in) {
  const at::Tensor& probe = in.probe();  // x, or what x is made from: the same dtype, device and sizes.
  const bool hookless = std::all_of(layers.begin(), layers.end(), [](const Linear* l) { return l->hook_count() == 0; });
  const bool any_fp8 = std::any_of(layers.begin(), layers.end(), [](const Linear* l) { return l->is_fp8(); });
  if (layers.size() > 1 && hookless && !any_fp8 && fused::Active(probe)) {
    const Combined c = Combine(layers, probe.size(-1));
    if (c.weight.defined()) {
      // A layer with an active LoRA adds its delta into its slice of the shared output (its
      // up-projection accumulates there: the slice is a strided view the GEMM writes through).
      const at::Tensor& x = in.Values();
      std::vector<at::Tensor> out = SplitColumns(layers, at::linear(x, c.weight, c.bias));
      for (size_t i = 0; i < layers.size(); ++i) {
        if (layers[i]->LoraActive()) out[i] = layers[i]->WithLoras(x, std::move(out[i]));
      }
      return out;
    }
  }
  std::vector<at::Tensor> out;
  out.reserve(layers.size());
  const bool all_fp8 = !layers.empty() && std::all_of(layers.begin(), layers.end(), [](const Linear* l) {
                         return l->is_fp8() && !l->LoraActive();
                       });
  if (!all_fp8) {
    for (Linear* layer : layers) out.push_back(layer->Forward(in.Values()));
    return out;
  }
  // Every layer runs an FP8 GEMM: x is quantised once (straight from the norm where a kernel does
  // both: the bfloat16 x is then never made).
  const fused::Fp8Input& input = in.Fp8();
  auto fp8_linear = [&](const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias) {
    // A weight the FP8 GEMM does not take (a width not a multiple of 16) runs the reference on the
    // bfloat16 values.
    return input.q.defined() && fused::Fp8GemmTakes(q, scale, bias)
               ? fused::Fp8LinearQuantized(input, probe.sizes(), q, scale, bias)
               : fused::Fp8Linear(in.Values(), q, scale, bias, &input);
  };
  if (hookless && fused::Active(probe)) {
    // Weights, scales and biases side by side (ConvertBlockLinearsToFp8 declares the scales adjacent
    // too): one FP8 GEMM over the combined rows — the single blocks' Q, K, V and MLP input are one
    // GEMM of 21504 columns instead of four that leave part of the last wave of tiles idle.
    const Combined c = Combine(layers, probe.size(-1));
    if (c.weight.defined()) return SplitColumns(layers, fp8_linear(c.weight, c.scale, c.bias));
  }
  for (Linear* layer : layers) {
    ForwardScope scope(*layer);
    out.push_back(fp8_linear(layer->tensor(layer->weight_), layer->tensor(layer->weight_scale_),
                             layer->bias_ >= 0 ? layer->tensor(layer->bias_) : at::Tensor()));
  }
  return out;
}

absl::Status Linear::ConvertToFp8(bool deferred) {
  if (weight_scale_ >= 0) return absl::OkStatus();
#ifndef STOWAGE_HAS_FP8
  (void)deferred;
  return absl::UnimplementedError("FP8 compute needs a LibTorch with float8 types (2.1 or later)");
#else
  if (!slots()[static_cast<size_t>(weight_)].value.defined()) {
    return absl::FailedPreconditionError(path() + ": cannot convert an offloaded weight to FP8");
  }
  const at::Tensor source = tensor(weight_);
  // Deferred only for a weight in a file's mapping: the declaration keeps its source, which then holds
  // no RAM beyond the pages being read; a weight on the heap (drawn at random, or converted) is
  // converted now, as the declaration would otherwise keep its bf16 bytes in RAM.
  if (deferred && source.device().is_cpu() && source.dim() == 2 && !MappedFilesContaining({source.data_ptr()}).empty()) {
    // kFp8E4M3's Quantize is QuantizeWeightFp8 bit for bit (fused_ops_test); HostWeights writes it.
    slots()[static_cast<size_t>(weight_)].value = UnwrittenHostTensor(source.sizes(), at::kFloat8_e4m3fn);
    weight_scale_ = AddBuffer("weight_scale", UnwrittenHostTensor({source.size(0)}, at::kFloat));
    DeferFp8(weight_, weight_scale_, source);
    return absl::OkStatus();
  }
  fused::Fp8Weight q = fused::QuantizeWeightFp8(source);
  // A view of a safetensors mapping: its pages leave this process's RSS (the FP8 copy replaces it).
  if (source.device().is_cpu()) (void)ReleaseMappedPages(source.data_ptr(), static_cast<int64_t>(source.nbytes()));
  slots()[static_cast<size_t>(weight_)].value = std::move(q.q);
  weight_scale_ = AddBuffer("weight_scale", std::move(q.scale));
  return absl::OkStatus();
#endif
}

namespace {
// The block lists nearest the root: its ModuleList children (a transformer's), else those one level
// further down (T5's encoder.block), and so on (CLIP's text_model.encoder.layers) — never the small
// lists inside embedders beside the blocks (Z-Image's t_embedder.mlp).
std::vector<Module*> NearestBlockLists(Module& root) {
  std::vector<Module*> level = {&root};
  while (!level.empty()) {
    std::vector<Module*> lists, next;
    for (Module* m : level) {
      for (const auto& [name, child] : m->children()) {
        (child->kind() == "ModuleList" ? lists : next).push_back(child);
      }
    }
    if (!lists.empty()) return lists;
    level = std::move(next);
  }
  return {};
}
}  // namespace

absl::StatusOr<int64_t> ConvertBlockLinearsToFp8(Module& root,
                                                 const std::function<absl::Status(Module&)>& after_block,
                                                 bool deferred) {
  int64_t converted = 0;
  absl::Status status;
  std::set<const Linear*> now_fp8;  // Converted by this call.
  auto convert = [&](Module& m) {
    auto* linear = dynamic_cast<Linear*>(&m);
    if (linear == nullptr || !status.ok() || linear->is_fp8()) return;
    status = linear->ConvertToFp8(deferred);
    if (status.ok()) {
      ++converted;
      now_fp8.insert(linear);
    }
  };
  for (Module* child : NearestBlockLists(root)) {
    for (const auto& [name, block] : child->children()) {
      block->ForEachModule(convert);
      if (!status.ok()) return status;
      if (after_block) RETURN_IF_ERROR(after_block(*block));
    }
    // Layers whose weights are declared adjacent get their new scales declared adjacent too, so that
    // once onloaded ForwardShared reads all of them as one FP8 GEMM's weight and scale.
    child->ForEachModule([&](Module& owner) {
      std::vector<std::vector<std::pair<Module*, int>>> scale_groups;
      for (const auto& group : owner.adjacent_groups()) {
        std::vector<std::pair<Module*, int>> scales;
        for (const auto& [member, slot] : group) {
          const auto* linear = dynamic_cast<const Linear*>(member);
          if (linear == nullptr || slot != linear->weight_ || now_fp8.count(linear) == 0) break;
          scales.emplace_back(member, linear->weight_scale_);
        }
        if (scales.size() == group.size() && scales.size() > 1) scale_groups.push_back(std::move(scales));
      }
      for (auto& scales : scale_groups) owner.AddAdjacentGroup(std::move(scales));
    });
  }
  return converted;
}

at::Tensor Linear::ForwardConcat(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu) {
  ForwardScope scope(*this);
  const at::Tensor& w = tensor(weight_);
  const at::Tensor b = bias_ >= 0 ? tensor(bias_) : at::Tensor();
  TORCH_CHECK(gelu.empty() || gelu.size() == parts.size(), "Linear::ForwardConcat: ", gelu.size(), " GELU flags for ",
              parts.size(), " parts");
  if (weight_scale_ >= 0 && !LoraActive()) return fused::Fp8LinearConcat(parts, gelu, w, tensor(weight_scale_), b);
  if (weight_scale_ >= 0 || LoraActive() || parts.empty() || !fused::Active(parts.front())) {
    const at::Tensor x = fused::GeluConcat(parts, gelu);
    return WithLoras(x, weight_scale_ >= 0 ? fused::Fp8Linear(x, w, tensor(weight_scale_), b) : at::linear(x, w, b));
  }
  at::Tensor out;
  int64_t column = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor part = !gelu.empty() && gelu[i] ? fused::GeluTanh(parts[i]) : parts[i];
    const int64_t k = part.size(-1);
    const at::Tensor x2d = part.reshape({-1, k});
    const at::Tensor wt = w.slice(1, column, column + k).t();  // [k, out], a strided view: no copy.
    if (!out.defined()) {
      out = b.defined() ? at::addmm(b, x2d, wt) : at::mm(x2d, wt);
    } else {
      out.addmm_(x2d, wt);
    }
    column += k;
  }
  TORCH_CHECK(column == in_features_, "Linear::ForwardConcat: the parts have ", column, " features; the layer takes ",
              in_features_);
  std::vector<int64_t> shape = parts.front().sizes().vec();
  shape.back() = out_features_;
  return out.view(shape);
}

RMSNorm::RMSNorm(int64_t dim, double eps, bool affine, const LayerOptions& options,
                 bool cast_before_weight)
    : Module("RMSNorm"), eps_(eps), cast_before_weight_(cast_before_weight) {
  if (affine) weight_ = AddParameter("weight", Empty({dim}, options));
}

at::Tensor RMSNorm::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean({-1}, /*keepdim=*/true) + eps_);
  if (weight_ < 0) return y.to(x.scalar_type());
  const at::Tensor& w = tensor(weight_);
  if (cast_before_weight_) return y.to(w.scalar_type()) * w;
  return (y * w.to(at::kFloat)).to(x.scalar_type());
}

void RMSNorm::CheckFusable() const {
  TORCH_CHECK(cast_before_weight_ && weight_ >= 0,
              "RMSNorm: the fused forms need a weight applied after the cast (diffusers' RMSNorm)");
}

at::Tensor RMSNorm::ForwardScaled(const at::Tensor& x, const at::Tensor& scale) {
  ForwardScope scope(*this);
  CheckFusable();
  return fused::RmsNorm(x, tensor(weight_), eps_, scale);
}

at::Tensor RMSNorm::ForwardGatedResidual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& y) {
  ForwardScope scope(*this);
  CheckFusable();
  return fused::GatedRmsNormResidual(residual, gate, y, tensor(weight_), eps_);
}

at::Tensor RMSNorm::ForwardRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset,
                                const at::Tensor& out) {
  ForwardScope scope(*this);
  CheckFusable();
  return fused::RmsNormRope(x, tensor(weight_), eps_, cos, sin, offset, out);
}

LayerNorm::LayerNorm(int64_t dim, double eps, bool affine, const LayerOptions& options)
    : Module("LayerNorm"), dim_(dim), eps_(eps) {
  if (affine) {
    weight_ = AddParameter("weight", Empty({dim}, options));
    bias_ = AddParameter("bias", Empty({dim}, options));
  }
}

at::Tensor LayerNorm::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor w = weight_ >= 0 ? tensor(weight_).to(at::kFloat) : at::Tensor();
  const at::Tensor b = bias_ >= 0 ? tensor(bias_).to(at::kFloat) : at::Tensor();
  return at::layer_norm(xf, {dim_}, w, b, eps_).to(x.scalar_type());
}

GroupNorm::GroupNorm(int64_t groups, int64_t channels, double eps, const LayerOptions& options)
    : Module("GroupNorm"), groups_(groups), eps_(eps) {
  weight_ = AddParameter("weight", Empty({channels}, options));
  bias_ = AddParameter("bias", Empty({channels}, options));
}

at::Tensor GroupNorm::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  // bfloat16 on CUDA (the fused path): LibTorch's kernel reads bfloat16 and keeps the statistics
  // in float32 — diffusers' nn.GroupNorm in a bfloat16 VAE — without float32 copies of the input and
  // the output (by their shapes a 1024² decode's 256-channel norms at full size made two float32
  // blocks of 1 GiB, the largest the decode allocates, and the size multi-tenant run 12's failed VAE
  // allocations asked for).
  if (fused::Active(x) && tensor(weight_).scalar_type() == x.scalar_type()) {
    return at::group_norm(x, groups_, tensor(weight_), tensor(bias_), eps_);
  }
  return at::group_norm(x.to(at::kFloat), groups_, tensor(weight_).to(at::kFloat),
                        tensor(bias_).to(at::kFloat), eps_)
      .to(x.scalar_type());
}

Conv2d::Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride,
               int64_t padding, const LayerOptions& options)
    : Module("Conv2d"), stride_(stride), padding_(padding) {
  weight_ = AddParameter("weight", Empty({out_channels, in_channels, kernel, kernel}, options));
  bias_ = AddParameter("bias", Empty({out_channels}, options));
}

at::Tensor Conv2d::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  const at::Tensor& weight = tensor(weight_);
  const at::Tensor& bias = tensor(bias_);
  // On the thread's convolution lane where it has one (the device's worker: models/core/conv_lane.h).
  ConvLane* lane = ConvLane::ForThisThread();
  if (lane == nullptr) return at::conv2d(x, weight, bias, {stride_, stride_}, {padding_, padding_});
  at::Tensor y;
  lane->RunOn(x.device(), [&] { y = at::conv2d(x, weight, bias, {stride_, stride_}, {padding_, padding_}); });
  return y;
}

Embedding::Embedding(int64_t num_embeddings, int64_t dim, const LayerOptions& options)
    : Module("Embedding") {
  weight_ = AddParameter("weight", Empty({num_embeddings, dim}, options));
}

at::Tensor Embedding::Forward(const at::Tensor& ids) {
  ForwardScope scope(*this);
  return at::embedding(tensor(weight_), ids);
}

ResnetBlock2D::ResnetBlock2D(int64_t in, int64_t out, int64_t groups, const LayerOptions& o)
    : Module("ResnetBlock2D") {
  norm1_ = AddChild("norm1", std::make_unique<GroupNorm>(groups, in, 1e-6, o));
  conv1_ = AddChild("conv1", std::make_unique<Conv2d>(in, out, 3, 1, 1, o));
  norm2_ = AddChild("norm2", std::make_unique<GroupNorm>(groups, out, 1e-6, o));
  conv2_ = AddChild("conv2", std::make_unique<Conv2d>(out, out, 3, 1, 1, o));
  if (in != out) conv_shortcut_ = AddChild("conv_shortcut", std::make_unique<Conv2d>(in, out, 1, 1, 0, o));
}

at::Tensor ResnetBlock2D::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  at::Tensor h = conv1_->Forward(at::silu(norm1_->Forward(x)));
  h = conv2_->Forward(at::silu(norm2_->Forward(h)));
  return (conv_shortcut_ != nullptr ? conv_shortcut_->Forward(x) : x) + h;
}

at::Tensor ScaledDotProductAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& key_mask, bool causal) {
  at::Tensor mask;
  if (key_mask.defined()) mask = key_mask.unsqueeze(1).unsqueeze(1);  // [B, 1, 1, keys]
  if (causal) {
    const at::Tensor lower = at::ones({q.size(-2), k.size(-2)}, q.options().dtype(at::kBool)).tril();
    mask = mask.defined() ? mask.logical_and(lower) : lower;
  }
#if TORCH_VERSION_MAJOR >= 2
  // An undefined tensor is not "no mask" to SDPA: pass nullopt.
  return mask.defined() ? at::scaled_dot_product_attention(q, k, v, mask)
                        : at::scaled_dot_product_attention(q, k, v, c10::nullopt);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  at::Tensor scores = at::matmul(q.to(at::kFloat), k.to(at::kFloat).transpose(-2, -1)) * scale;
  if (mask.defined()) scores = scores.masked_fill(mask.logical_not(), -INFINITY);
  return at::matmul(at::softmax(scores, -1), v.to(at::kFloat)).to(q.scalar_type());
#endif
}

SelfAttention::SelfAttention(int64_t dim, int64_t heads, bool qk_norm, const LayerOptions& options)
    : Module("SelfAttention"), heads_(heads) {
  to_q_ = AddChild("to_q", std::make_unique<Linear>(dim, dim, true, options));
  to_k_ = AddChild("to_k", std::make_unique<Linear>(dim, dim, true, options));
  to_v_ = AddChild("to_v", std::make_unique<Linear>(dim, dim, true, options));
  to_out_ = AddChild("to_out", std::make_unique<Linear>(dim, dim, true, options));
  if (qk_norm) {
    norm_q_ = AddChild("norm_q", std::make_unique<RMSNorm>(dim / heads, 1e-6, true, options));
    norm_k_ = AddChild("norm_k", std::make_unique<RMSNorm>(dim / heads, 1e-6, true, options));
  }
}

at::Tensor SelfAttention::Forward(const at::Tensor& x, const at::Tensor& key_mask) {
  ForwardScope scope(*this);
  const int64_t batch = x.size(0);
  const int64_t tokens = x.size(1);
  auto split = [&](const at::Tensor& t) {
    return t.view({batch, tokens, heads_, -1}).transpose(1, 2);  // [B, H, L, D]
  };
  at::Tensor q = split(to_q_->Forward(x));
  at::Tensor k = split(to_k_->Forward(x));
  const at::Tensor v = split(to_v_->Forward(x));
  if (norm_q_ != nullptr) {
    q = norm_q_->Forward(q);
    k = norm_k_->Forward(k);
  }
  const at::Tensor out = ScaledDotProductAttention(q, k, v, key_mask);
  return to_out_->Forward(out.transpose(1, 2).reshape({batch, tokens, -1}));
}

FeedForward::FeedForward(int64_t dim, int64_t hidden, const LayerOptions& options)
    : Module("FeedForward") {
  fc1_ = AddChild("fc1", std::make_unique<Linear>(dim, hidden, true, options));
  fc2_ = AddChild("fc2", std::make_unique<Linear>(hidden, dim, true, options));
}

at::Tensor FeedForward::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  return fc2_->Forward(at::gelu(fc1_->Forward(x), "tanh"));
}

}  // namespace stowage
