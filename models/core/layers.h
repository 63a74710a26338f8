// The layer library: LibTorch-backed layers built on offload::Module, so every layer is a hook
// point for offloading. Forward passes are pure functions of their inputs and the layer's tensors;
// they run under at::InferenceMode set by the caller.
//
// Weights are created uninitialised (at::empty) in the requested dtype; a loader or
// InitializeRandomWeights (weight_init.h) fills them.
#ifndef STOWAGE_MODELS_CORE_LAYERS_H_
#define STOWAGE_MODELS_CORE_LAYERS_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "models/core/fused_ops.h"
#include "models/core/lora.h"
#include "offload/module.h"

namespace stowage {

// Options for creating a layer's tensors.
struct LayerOptions {
  at::ScalarType dtype = at::kFloat;
};

// Mixed-adapter batches run the packed per-row LoRA path (lora.h) where the fused kernels run
// (CUDA); true makes every device run it (tests of that path on the CPU). Process-wide.
void SetPackedLoraEverywhere(bool on);

// The input several layers read (Linear::ForwardShared), made in the form they need: a tensor as
// given, or LayerNorm + modulation of one (fused::LayerNormModulate), made when first asked — straight
// into its per-token FP8 quantisation when every reader runs an FP8 GEMM (fused::LayerNormModulateFp8:
// the bfloat16 values are never written), otherwise in bfloat16. One forward's, on one thread.
class SharedInput {
 public:
  explicit SharedInput(at::Tensor x) : x_(std::move(x)) {}
  static SharedInput LayerNormModulated(at::Tensor x, at::Tensor scale, at::Tensor shift, double eps);
  // The bfloat16 (or the layers' dtype) values.
  const at::Tensor& Values();
  // Their FP8 quantisation; undefined where the FP8 GEMM path does not apply (fused::QuantizeInputFp8).
  const fused::Fp8Input& Fp8();
  // The given tensor, or the one the values are made from: the same sizes, dtype and device.
  const at::Tensor& probe() const { return x_.defined() ? x_ : source_; }

 private:
  at::Tensor x_;
  at::Tensor source_, scale_, shift_;  // LayerNormModulated: what x_ is made from.
  double eps_ = 0;
  fused::Fp8Input fp8_;
  bool fp8_made_ = false;
};

class Linear : public Module {
 public:
  Linear(int64_t in_features, int64_t out_features, bool bias, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);
  // Forward(cat(parts, -1)) — with gelu_tanh applied first to the parts flagged in `gelu` (empty:
  // none) — without building the concatenation when the fused kernels serve the parts: bf16, one
  // GEMM per part over its slice of the weight's columns, accumulated in place (flagged parts through
  // fused::GeluTanh); FP8, one kernel quantises the parts (GELU included) for one FP8 GEMM
  // (fused::Fp8LinearConcat). Elsewhere exactly Forward(fused::GeluConcat(parts, gelu)).
  at::Tensor ForwardConcat(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu = {});
  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }

  // FP8 compute: replaces the weight by its float8 e4m3 quantisation with one float32 scale per
  // output channel (a new buffer "weight_scale"), where the weight is now; Forward then runs
  // fused::Fp8Linear. The weight must be present (not offloaded). UNIMPLEMENTED without float8 in
  // the build; a second call changes nothing.
  // `deferred` (a weight in a safetensors file's mapping; one in RAM converts now): the codes and
  // scales are declared, not computed
  // (Module::DeferFp8, the same bytes once written): the layer then runs only through HostWeights,
  // which writes them when first needed — or never, when a compressed store makes its int4 copy
  // straight from the weight (one pass at load instead of an FP8 copy made and read again).
  absl::Status ConvertToFp8(bool deferred = false);
  bool is_fp8() const { return weight_scale_ >= 0; }
  friend absl::StatusOr<int64_t> ConvertBlockLinearsToFp8(Module& root,
                                                          const std::function<absl::Status(Module&)>& after_block,
                                                          bool deferred);

  // Forward(x) of each layer, for layers that read the same x (Q, K and V; SwiGLU's gate and up
  // projections). With the fused kernels active and the layers' weights (and biases) side by side in
  // one allocation (Module::AddAdjacentGroup, placed so by HostWeights::OnloadAll) and no hooks on
  // the layers: one GEMM over the combined weight, each result a view of its columns. When they all
  // run FP8 GEMMs: x is quantised once for all of them, and with their FP8 weights, scales (and
  // biases) side by side and no hooks, one FP8 GEMM over the combined rows. Otherwise each layer's
  // Forward.
  static std::vector<at::Tensor> ForwardShared(const std::vector<Linear*>& layers, const at::Tensor& x);
  static std::vector<at::Tensor> ForwardShared(const std::vector<Linear*>& layers, SharedInput& x);
  // gelu_tanh(Forward(x)); with the fused kernels active, the GELU runs in the GEMM's epilogue.
  at::Tensor ForwardGelu(const at::Tensor& x);
  // Declares `layers`' weights (and biases, when they have them) adjacent on `owner`
  // (Module::AddAdjacentGroup), for ForwardShared's single GEMM.
  static void DeclareAdjacent(Module& owner, const std::vector<Linear*>& layers);

  // LoRA adapters (models/core/lora.h), by name: every forward adds the deltas of those active on
  // the running thread (ScopedLoras). Attached and detached between runs only (the device's
  // worker). INVALID_ARGUMENT when A's columns or B's rows do not match this layer.
  absl::Status AttachLora(const std::string& name, LoraWeights weights);
  bool DetachLora(const std::string& name);
  const std::map<std::string, LoraWeights>& loras() const { return loras_; }

 private:
  // The layers' weights (with FP8, their scales) and biases as one matrix each, when onloading laid
  // them side by side and the weights take `in_features` columns; `weight` undefined otherwise.
  struct Combined {
    at::Tensor weight, scale, bias;
  };
  static Combined Combine(const std::vector<Linear*>& layers, int64_t in_features);
  // Each layer's columns of the combined output y.
  static std::vector<at::Tensor> SplitColumns(const std::vector<Linear*>& layers, const at::Tensor& y);
  // A LoRA delta applies to this forward (an attached adapter is active).
  bool LoraActive() const;
  // y plus the active adapters' deltas for input x.
  at::Tensor WithLoras(const at::Tensor& x, at::Tensor y) const;

  int64_t in_features_;
  int64_t out_features_;
  int weight_;
  int bias_ = -1;
  int weight_scale_ = -1;
  std::map<std::string, LoraWeights> loras_;
  // The packed per-row path's concatenated adapters (lora.h), rebuilt when a batch's set changes.
  mutable LoraPack lora_pack_;
};

// Converts every Linear inside the block lists of `root` (the ModuleLists nearest the root: a
// transformer's block lists, T5's encoder.block, CLIP's text_model.encoder.layers — where nearly all
// the FLOPs are; embedders and the final layer stay in their dtype) to
// FP8 (Linear::ConvertToFp8). Layers whose weights were declared adjacent (Linear::DeclareAdjacent)
// get their new scales declared adjacent too (ForwardShared's single FP8 GEMM). Returns how many
// were converted. `after_block`, when set, runs on each block (a block list's child) once its layers
// are converted, before the next block's are: e.g. to move the block's new FP8 host copies out of RAM
// (SpillHeapTensors) so that the conversion never holds the whole component's; its error stops the
// conversion and is returned. `deferred`: each layer's ConvertToFp8(true) (the tree then runs only
// through HostWeights).
absl::StatusOr<int64_t> ConvertBlockLinearsToFp8(Module& root,
                                                 const std::function<absl::Status(Module&)>& after_block = nullptr,
                                                 bool deferred = false);

// Root-mean-square normalisation over the last dimension, computed in float32.
// `cast_before_weight` follows diffusers' RMSNorm: the normalised value is cast to the weight's
// dtype before the multiplication (otherwise the weight is applied in float32, as Qwen's is not).
class RMSNorm : public Module {
 public:
  RMSNorm(int64_t dim, double eps, bool affine, const LayerOptions& options,
          bool cast_before_weight = false);
  at::Tensor Forward(const at::Tensor& x);

  // The fused forms (models/core/fused_ops.h: one CUDA kernel for bfloat16 on CUDA, the plain ops
  // elsewhere), for norms with a weight and cast_before_weight. Each runs this module's hooks.
  // RmsNorm(x) · scale (scale [B or 1, 1, D]).
  at::Tensor ForwardScaled(const at::Tensor& x, const at::Tensor& scale);
  // residual + gate · RmsNorm(y).
  at::Tensor ForwardGatedResidual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& y);
  // The rotary embedding of RmsNorm(x) for x [B, S, H, D] (fused::RmsNormRope).
  at::Tensor ForwardRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t offset = 0,
                         const at::Tensor& out = at::Tensor());

 private:
  void CheckFusable() const;

  double eps_;
  bool cast_before_weight_;
  int weight_ = -1;
};

// A module without tensors standing in for an activation inside a numbered Sequential, so that the
// layers after it keep their published names (e.g. "mlp.2" after a SiLU at "mlp.1").
class Activation : public Module {
 public:
  explicit Activation(std::string kind) : Module(std::move(kind)) {}
};

// A plain grouping node whose children carry the published names (e.g. "self_attn" holding
// "q_proj", or diffusers' ModuleDict keyed "2-1"); the owner calls the children directly.
class Container : public Module {
 public:
  explicit Container(std::string kind) : Module(std::move(kind)) {}
};

// A numbered container with heterogeneous children ("0", "1", ...), like torch's nn.Sequential.
// Its kind is "ModuleList", so block-level offloading treats its children as blocks.
class Sequential : public Module {
 public:
  Sequential() : Module("ModuleList") {}
  template <typename T>
  T* Add(std::unique_ptr<T> child) {
    return AddChild(std::to_string(size_++), std::move(child));
  }

 private:
  int size_ = 0;
};

class LayerNorm : public Module {
 public:
  LayerNorm(int64_t dim, double eps, bool affine, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  int64_t dim_;
  double eps_;
  int weight_ = -1;
  int bias_ = -1;
};

class GroupNorm : public Module {
 public:
  GroupNorm(int64_t groups, int64_t channels, double eps, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  int64_t groups_;
  double eps_;
  int weight_;
  int bias_;
};

class Conv2d : public Module {
 public:
  Conv2d(int64_t in_channels, int64_t out_channels, int64_t kernel, int64_t stride, int64_t padding,
         const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  int64_t stride_;
  int64_t padding_;
  int weight_;
  int bias_;
};

class Embedding : public Module {
 public:
  Embedding(int64_t num_embeddings, int64_t dim, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& ids);

 private:
  int weight_;
};

// diffusers' ResnetBlock2D without a time embedding: GroupNorm → SiLU → 3×3 conv, twice, plus the
// input (through a 1×1 "conv_shortcut" when the channel count changes). Norm eps 1e-6.
class ResnetBlock2D : public Module {
 public:
  ResnetBlock2D(int64_t in, int64_t out, int64_t groups, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  GroupNorm* norm1_;
  Conv2d* conv1_;
  GroupNorm* norm2_;
  Conv2d* conv2_;
  Conv2d* conv_shortcut_ = nullptr;
};

// Scaled dot-product attention over [batch, heads, tokens, head_dim] tensors. `key_mask`, if
// defined, is a bool [batch, keys] tensor that is true for keys to attend to; `causal` lets query i
// see keys 0..i only.
at::Tensor ScaledDotProductAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& key_mask, bool causal = false);

// Multi-head self-attention with optional RMS normalisation of queries and keys.
class SelfAttention : public Module {
 public:
  SelfAttention(int64_t dim, int64_t heads, bool qk_norm, const LayerOptions& options);
  // x: [batch, tokens, dim]; key_mask: optional [batch, tokens] bool.
  at::Tensor Forward(const at::Tensor& x, const at::Tensor& key_mask);

 private:
  int64_t heads_;
  Linear* to_q_;
  Linear* to_k_;
  Linear* to_v_;
  Linear* to_out_;
  RMSNorm* norm_q_ = nullptr;
  RMSNorm* norm_k_ = nullptr;
};

// Two-layer GELU (tanh approximation) MLP.
class FeedForward : public Module {
 public:
  FeedForward(int64_t dim, int64_t hidden, const LayerOptions& options);
  at::Tensor Forward(const at::Tensor& x);

 private:
  Linear* fc1_;
  Linear* fc2_;
};

// An ordered list of blocks, named "0", "1", ... Block-level offloading groups the children of
// every ModuleList at the top of a component (or of explicitly named block modules).
template <typename T>
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  T* Append(std::unique_ptr<T> block) {
    T* raw = AddChild(std::to_string(blocks_.size()), std::move(block));
    blocks_.push_back(raw);
    return raw;
  }
  size_t size() const { return blocks_.size(); }
  T& operator[](size_t i) { return *blocks_[i]; }
  typename std::vector<T*>::iterator begin() { return blocks_.begin(); }
  typename std::vector<T*>::iterator end() { return blocks_.end(); }

 private:
  std::vector<T*> blocks_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_LAYERS_H_
