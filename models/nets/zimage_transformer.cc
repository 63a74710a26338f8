#include "models/nets/zimage_transformer.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "models/core/config_checks.h"
#include "models/core/fused_ops.h"
#include "models/core/device_copy.h"
#include "models/core/diffusers_format.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

constexpr int64_t kSeqMultiple = 32;

int64_t PadTo(int64_t n) { return (kSeqMultiple - n % kSeqMultiple) % kSeqMultiple; }

// Rows [0, valid) of `rows`, then `pad` copies of the last valid row.
at::Tensor PadWithLastRow(const at::Tensor& rows, int64_t pad) {
  if (pad == 0) return rows;
  return at::cat({rows, rows.slice(0, rows.size(0) - 1).expand({pad, rows.size(1)})}, 0);
}

// Replaces rows from `valid` on with `token` ([1, D]).
at::Tensor FillPadRows(const at::Tensor& rows, int64_t valid, const at::Tensor& token) {
  if (valid == rows.size(0)) return rows;
  return at::cat({rows.slice(0, 0, valid), token.to(rows.scalar_type()).expand({rows.size(0) - valid, rows.size(1)})}, 0);
}

// Interleaved-pair rotary embedding: x [B, S, H, hd], freqs complex [S, hd / 2] or [B, S, hd / 2].
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& freqs) {
  const at::Tensor pairs = x.to(at::kFloat).reshape({x.size(0), x.size(1), x.size(2), -1, 2}).contiguous();
  const at::Tensor f = freqs.dim() == 2 ? freqs.unsqueeze(0) : freqs;
  const at::Tensor rotated = at::view_as_complex(pairs) * f.unsqueeze(2);
  return at::view_as_real(rotated).flatten(3).to(x.scalar_type());
}

ZImageRope MakeRope(const at::Tensor& freqs, bool fused) {
  ZImageRope rope{freqs, at::Tensor(), at::Tensor()};
  if (fused) {
    rope.cos = at::real(freqs).contiguous();
    rope.sin = at::imag(freqs).contiguous();
  }
  return rope;
}

}  // namespace

absl::StatusOr<ZImageTransformerConfig> ZImageTransformerConfigFromJson(const google::protobuf::Struct& json,
                                                                       const std::string& file) {
  ZImageTransformerConfig c;
  ASSIGN_OR_RETURN(std::vector<int64_t> patch, ConfigIntList(json, "all_patch_size", {c.patch_size}, file));
  ASSIGN_OR_RETURN(std::vector<int64_t> f_patch, ConfigIntList(json, "all_f_patch_size", {c.f_patch_size}, file));
  if (patch.empty()) return absl::InvalidArgumentError(absl::StrCat(file, ": all_patch_size is empty"));
  if (f_patch.empty()) return absl::InvalidArgumentError(absl::StrCat(file, ": all_f_patch_size is empty"));
  c.patch_size = patch[0];
  c.f_patch_size = f_patch[0];
  ASSIGN_OR_RETURN(c.in_channels, ConfigInt(json, "in_channels", c.in_channels, file));
  ASSIGN_OR_RETURN(c.dim, ConfigInt(json, "dim", c.dim, file));
  ASSIGN_OR_RETURN(c.n_layers, ConfigInt(json, "n_layers", c.n_layers, file));
  ASSIGN_OR_RETURN(c.n_refiner_layers, ConfigInt(json, "n_refiner_layers", c.n_refiner_layers, file));
  ASSIGN_OR_RETURN(c.n_heads, ConfigInt(json, "n_heads", c.n_heads, file));
  // The attention here has as many key/value heads as query heads (as diffusers' does).
  ASSIGN_OR_RETURN(const int64_t n_kv_heads, ConfigInt(json, "n_kv_heads", c.n_heads, file));
  ASSIGN_OR_RETURN(c.norm_eps, ConfigDouble(json, "norm_eps", c.norm_eps, file));
  ASSIGN_OR_RETURN(c.cap_feat_dim, ConfigInt(json, "cap_feat_dim", c.cap_feat_dim, file));
  ASSIGN_OR_RETURN(c.rope_theta, ConfigDouble(json, "rope_theta", c.rope_theta, file));
  ASSIGN_OR_RETURN(c.t_scale, ConfigDouble(json, "t_scale", c.t_scale, file));
  ASSIGN_OR_RETURN(c.axes_dims, ConfigIntList(json, "axes_dims", c.axes_dims, file));
  ASSIGN_OR_RETURN(c.axes_lens, ConfigIntList(json, "axes_lens", c.axes_lens, file));
  ASSIGN_OR_RETURN(c.qk_norm, ConfigBool(json, "qk_norm", c.qk_norm, file));
  auto siglip = json.fields().find("siglip_feat_dim");
  if (siglip != json.fields().end() && !siglip->second.has_null_value()) {
    return absl::UnimplementedError(absl::StrCat(file, ": ZImageTransformer2DModel with siglip_feat_dim (omni mode) "
                                                 "is not supported"));
  }
  RETURN_IF_ERROR(Validate(c, file));
  ConfigCheck check(file);
  check.Equals("n_kv_heads", n_kv_heads, "n_heads", c.n_heads);
  RETURN_IF_ERROR(check.status());
  return c;
}

absl::Status Validate(const ZImageTransformerConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Range("all_patch_size[0]", c.patch_size, 1, kMaxConfigPatch)
      .Range("all_f_patch_size[0]", c.f_patch_size, 1, 1)
      .Size("in_channels", c.in_channels)
      .Size("dim", c.dim)
      .Size("n_heads", c.n_heads)
      .Divides("n_heads", c.n_heads, "dim", c.dim)
      .Range("n_layers", c.n_layers, 1, kMaxConfigLayers)
      .Range("n_refiner_layers", c.n_refiner_layers, 0, kMaxConfigLayers)
      .Size("cap_feat_dim", c.cap_feat_dim)
      .Above("norm_eps", c.norm_eps, 0.0, 1.0)
      .Above("rope_theta", c.rope_theta, 0.0, 1e12)
      .Above("t_scale", c.t_scale, 0.0, 1e6)
      .Require(c.axes_dims.size() == 3, "axes_dims", absl::StrCat("has ", c.axes_dims.size(), " entries; must have 3"))
      .Require(c.axes_lens.size() == 3, "axes_lens", absl::StrCat("has ", c.axes_lens.size(), " entries; must have 3"));
  RETURN_IF_ERROR(check.status());
  int64_t axes_sum = 0;
  ParameterCount rope;
  for (size_t i = 0; i < 3; ++i) {
    // RoPE rotates pairs of channels: each axis needs an even, non-zero share of the head dim.
    const std::string dim_field = absl::StrCat("axes_dims[", i, "]");
    check.Range(dim_field, c.axes_dims[i], 2, kMaxConfigDim).Even(dim_field, c.axes_dims[i]);
    check.Size(absl::StrCat("axes_lens[", i, "]"), c.axes_lens[i]);
    if (!check.ok()) break;
    axes_sum += c.axes_dims[i];
    rope.Add({c.axes_lens[i], c.axes_dims[i]});  // Complex [len, d / 2]: d floats per row.
  }
  check.Equals("sum of axes_dims", axes_sum, "the head dim dim / n_heads", c.dim / c.n_heads);
  RETURN_IF_ERROR(check.status());

  const int64_t d = c.dim, hd = c.head_dim(), ada = c.adaln_dim(), ffn = c.ffn_hidden();
  const int64_t patch_dim = c.f_patch_size * c.patch_size * c.patch_size * c.in_channels;
  ParameterCount block;
  block.Add({4, d, d});                // to_q, to_k, to_v, to_out.
  if (c.qk_norm) block.Add({2, hd});
  block.Add({3, d, ffn});              // w1, w2, w3.
  block.Add({4, d});                   // Four norms.
  ParameterCount modulation;
  modulation.Add({ada + 1, 4, d});     // adaLN_modulation (weight and bias).
  ParameterCount total;
  total.Add({patch_dim + 1, d});       // x_embedder.
  total.Add({d + 1, patch_dim});       // final linear.
  total.Add({ada + 1, d});             // final modulation.
  total.Add({257, 1024});              // t_embedder.
  total.Add({1025, ada});
  total.Add({c.cap_feat_dim + 1, d + 1});  // cap_embedder norm and linear (over-counted by one).
  total.Add({2, d});                   // Pad tokens.
  total.AddTimes(c.n_layers + 2 * c.n_refiner_layers, block);
  total.AddTimes(c.n_layers + c.n_refiner_layers, modulation);
  total.AddTimes(1, rope);
  return total.Check(file);
}

ZImageAttention::ZImageAttention(const ZImageTransformerConfig& c, const LayerOptions& o)
    : Module("ZImageAttention"), heads_(c.n_heads) {
  to_q_ = AddChild("to_q", std::make_unique<Linear>(c.dim, c.dim, false, o));
  to_k_ = AddChild("to_k", std::make_unique<Linear>(c.dim, c.dim, false, o));
  to_v_ = AddChild("to_v", std::make_unique<Linear>(c.dim, c.dim, false, o));
  Linear::DeclareAdjacent(*this, {to_q_, to_k_, to_v_});  // One Q/K/V GEMM when resident.
  auto* out = AddChild("to_out", std::make_unique<Sequential>());
  to_out_ = out->Add(std::make_unique<Linear>(c.dim, c.dim, false, o));
  if (c.qk_norm) {
    norm_q_ = AddChild("norm_q", std::make_unique<RMSNorm>(c.head_dim(), 1e-5, true, o, true));
    norm_k_ = AddChild("norm_k", std::make_unique<RMSNorm>(c.head_dim(), 1e-5, true, o, true));
  }
}

at::Tensor ZImageAttention::Forward(const at::Tensor& x, const ZImageRope& rope, const at::Tensor& key_mask) {
  ForwardScope scope(*this);
  const int64_t s = x.size(1);
  auto heads = [&](const at::Tensor& t) { return t.view({x.size(0), s, heads_, -1}); };
  const std::vector<at::Tensor> qkv = Linear::ForwardShared({to_q_, to_k_, to_v_}, x);
  at::Tensor q = heads(qkv[0]);
  at::Tensor k = heads(qkv[1]);
  const at::Tensor v = heads(qkv[2]);
  if (rope.cos.defined()) {  // One kernel per tensor: the head norm and the rotation.
    q = norm_q_ != nullptr ? norm_q_->ForwardRope(q, rope.cos, rope.sin)
                           : fused::RmsNormRope(q, at::Tensor(), 0.0, rope.cos, rope.sin);
    k = norm_k_ != nullptr ? norm_k_->ForwardRope(k, rope.cos, rope.sin)
                           : fused::RmsNormRope(k, at::Tensor(), 0.0, rope.cos, rope.sin);
  } else {
    if (norm_q_ != nullptr) {
      q = norm_q_->Forward(q);
      k = norm_k_->Forward(k);
    }
    q = ApplyRope(q, rope.freqs);
    k = ApplyRope(k, rope.freqs);
  }
  const at::Tensor o = ScaledDotProductAttention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), key_mask);
  return to_out_->Forward(o.transpose(1, 2).flatten(2, 3).to(x.scalar_type()));
}

ZImageBlock::ZImageBlock(const ZImageTransformerConfig& c, bool modulation, const LayerOptions& o)
    : Module("ZImageTransformerBlock") {
  attention_ = AddChild("attention", std::make_unique<ZImageAttention>(c, o));
  auto* ff = AddChild("feed_forward", std::make_unique<Container>("FeedForward"));
  w1_ = ff->AddChild("w1", std::make_unique<Linear>(c.dim, c.ffn_hidden(), false, o));
  w2_ = ff->AddChild("w2", std::make_unique<Linear>(c.ffn_hidden(), c.dim, false, o));
  w3_ = ff->AddChild("w3", std::make_unique<Linear>(c.dim, c.ffn_hidden(), false, o));
  Linear::DeclareAdjacent(*this, {w1_, w3_});
  attention_norm1_ = AddChild("attention_norm1", std::make_unique<RMSNorm>(c.dim, c.norm_eps, true, o, true));
  ffn_norm1_ = AddChild("ffn_norm1", std::make_unique<RMSNorm>(c.dim, c.norm_eps, true, o, true));
  attention_norm2_ = AddChild("attention_norm2", std::make_unique<RMSNorm>(c.dim, c.norm_eps, true, o, true));
  ffn_norm2_ = AddChild("ffn_norm2", std::make_unique<RMSNorm>(c.dim, c.norm_eps, true, o, true));
  if (modulation) {
    auto* mod = AddChild("adaLN_modulation", std::make_unique<Sequential>());
    modulation_ = mod->Add(std::make_unique<Linear>(c.adaln_dim(), 4 * c.dim, true, o));
  }
}

at::Tensor ZImageBlock::Forward(const at::Tensor& x, const ZImageRope& rope, const at::Tensor& c,
                                const at::Tensor& key_mask) {
  ForwardScope scope(*this);
  const bool fused = rope.cos.defined();
  auto ffn = [&](const at::Tensor& h) {
    if (!fused) return w2_->Forward(at::silu(w1_->Forward(h)) * w3_->Forward(h));
    const std::vector<at::Tensor> gate_up = Linear::ForwardShared({w1_, w3_}, h);
    return w2_->Forward(fused::SiluMul(gate_up[0], gate_up[1]));
  };
  if (modulation_ == nullptr) {
    at::Tensor h = x + attention_norm2_->Forward(attention_->Forward(attention_norm1_->Forward(x), rope, key_mask));
    return h + ffn_norm2_->Forward(ffn(ffn_norm1_->Forward(h)));
  }
  // Order: scale_msa, gate_msa, scale_mlp, gate_mlp; no shift; tanh gates.
  const std::vector<at::Tensor> mod = modulation_->Forward(c).unsqueeze(1).chunk(4, 2);
  const at::Tensor scale_msa = 1.0 + mod[0];
  const at::Tensor gate_msa = at::tanh(mod[1]);
  const at::Tensor scale_mlp = 1.0 + mod[2];
  const at::Tensor gate_mlp = at::tanh(mod[3]);
  if (fused) {  // Norm, modulation, gate and residual add in one kernel each.
    const at::Tensor attn = attention_->Forward(attention_norm1_->ForwardScaled(x, scale_msa), rope, key_mask);
    const at::Tensor h = attention_norm2_->ForwardGatedResidual(x, gate_msa, attn);
    return ffn_norm2_->ForwardGatedResidual(h, gate_mlp, ffn(ffn_norm1_->ForwardScaled(h, scale_mlp)));
  }
  const at::Tensor attn = attention_->Forward(attention_norm1_->Forward(x) * scale_msa, rope, key_mask);
  at::Tensor h = x + gate_msa * attention_norm2_->Forward(attn);
  return h + gate_mlp * ffn_norm2_->Forward(ffn(ffn_norm1_->Forward(h) * scale_mlp));
}

ZImageTransformer::ZImageTransformer(const ZImageTransformerConfig& c, const LayerOptions& o)
    : Module("ZImageTransformer2DModel"), config_(c) {
  const std::string key = absl::StrCat(c.patch_size, "-", c.f_patch_size);
  const int64_t patch_dim = c.f_patch_size * c.patch_size * c.patch_size * c.in_channels;
  x_embedder_ = AddChild("all_x_embedder", std::make_unique<Container>("ModuleDict"))
                    ->AddChild(key, std::make_unique<Linear>(patch_dim, c.dim, true, o));
  auto* final_layer = AddChild("all_final_layer", std::make_unique<Container>("ModuleDict"))
                          ->AddChild(key, std::make_unique<Container>("FinalLayer"));
  final_linear_ = final_layer->AddChild("linear", std::make_unique<Linear>(c.dim, patch_dim, true, o));
  auto* final_mod = final_layer->AddChild("adaLN_modulation", std::make_unique<Sequential>());
  final_mod->Add(std::make_unique<Activation>("SiLU"));
  final_modulation_ = final_mod->Add(std::make_unique<Linear>(c.adaln_dim(), c.dim, true, o));
  auto* mlp = AddChild("t_embedder", std::make_unique<Container>("TimestepEmbedder"))
                  ->AddChild("mlp", std::make_unique<Sequential>());
  t_fc1_ = mlp->Add(std::make_unique<Linear>(256, 1024, true, o));
  mlp->Add(std::make_unique<Activation>("SiLU"));
  t_fc2_ = mlp->Add(std::make_unique<Linear>(1024, c.adaln_dim(), true, o));
  auto* cap = AddChild("cap_embedder", std::make_unique<Sequential>());
  cap_norm_ = cap->Add(std::make_unique<RMSNorm>(c.cap_feat_dim, c.norm_eps, true, o, true));
  cap_linear_ = cap->Add(std::make_unique<Linear>(c.cap_feat_dim, c.dim, true, o));
  noise_refiner_ = AddChild("noise_refiner", std::make_unique<ModuleList<ZImageBlock>>());
  context_refiner_ = AddChild("context_refiner", std::make_unique<ModuleList<ZImageBlock>>());
  for (int64_t i = 0; i < c.n_refiner_layers; ++i) {
    noise_refiner_->Append(std::make_unique<ZImageBlock>(c, /*modulation=*/true, o));
    context_refiner_->Append(std::make_unique<ZImageBlock>(c, /*modulation=*/false, o));
  }
  x_pad_token_ = AddParameter("x_pad_token", at::empty({1, c.dim}, at::TensorOptions().dtype(o.dtype)));
  cap_pad_token_ = AddParameter("cap_pad_token", at::empty({1, c.dim}, at::TensorOptions().dtype(o.dtype)));
  layers_ = AddChild("layers", std::make_unique<ModuleList<ZImageBlock>>());
  for (int64_t i = 0; i < c.n_layers; ++i) layers_->Append(std::make_unique<ZImageBlock>(c, true, o));

  // RoPE tables: angles in float64, cast to float32, then unit complex numbers.
  for (size_t axis = 0; axis < 3; ++axis) {
    const int64_t d = c.axes_dims[axis];
    const at::Tensor exponents = at::arange(0, d, 2, at::TensorOptions().dtype(at::kDouble)) / static_cast<double>(d);
    const at::Tensor freqs = 1.0 / at::pow(c.rope_theta, exponents);
    const at::Tensor positions = at::arange(c.axes_lens[axis], at::TensorOptions().dtype(at::kDouble));
    const at::Tensor angles = at::outer(positions, freqs).to(at::kFloat);
    rope_tables_.push_back(at::polar(at::ones_like(angles), angles));
  }
}

at::Tensor ZImageTransformer::RopeFactors(const at::Tensor& positions) const {
  std::vector<at::Tensor> parts;
  for (int64_t axis = 0; axis < 3; ++axis) {
    const at::Tensor ids = positions.select(1, axis).to(at::kLong).cpu();
    TORCH_CHECK(ids.numel() == 0 || ids.max().item<int64_t>() < config_.axes_lens[axis],
                "ZImageTransformer: position on axis ", axis, " exceeds axes_lens (", config_.axes_lens[axis],
                "): image or caption too large");
    parts.push_back(rope_tables_[static_cast<size_t>(axis)].index_select(0, ids));
  }
  return at::cat(parts, -1).to(positions.device());
}

const ZImageTransformer::RopeFreqs& ZImageTransformer::Freqs(const RopeLayout& layout, int64_t n, int64_t nx) {
  for (const RopeFreqs& cached : rope_cache_) {
    if (cached.layout == layout) return cached;
  }
  // Another grid or device makes the cached layouts useless; a bound keeps odd traffic from growing it.
  if (!rope_cache_.empty()) {
    const RopeLayout& kept = rope_cache_.front().layout;
    const bool same_grid = kept.ft == layout.ft && kept.ht == layout.ht && kept.wt == layout.wt && kept.device == layout.device;
    if (!same_grid || rope_cache_.size() >= 16) rope_cache_.clear();
  }
  const at::TensorOptions i64 = at::TensorOptions().dtype(at::kLong);
  const int64_t lc = layout.lc, ft = layout.ft, ht = layout.ht, wt = layout.wt;
  const at::Tensor cap_pos = at::stack({at::arange(1, lc + 1, i64), at::zeros({lc}, i64), at::zeros({lc}, i64)}, 1);
  const at::Tensor grid_f = at::arange(ft, i64).view({ft, 1, 1}).expand({ft, ht, wt}).reshape({-1}) + (lc + 1);
  const at::Tensor grid_h = at::arange(ht, i64).view({1, ht, 1}).expand({ft, ht, wt}).reshape({-1});
  const at::Tensor grid_w = at::arange(wt, i64).view({1, 1, wt}).expand({ft, ht, wt}).reshape({-1});
  at::Tensor x_pos = at::stack({grid_f, grid_h, grid_w}, 1);
  if (nx > n) x_pos = at::cat({x_pos, at::zeros({nx - n, 3}, i64)}, 0);
  rope_cache_.push_back(RopeFreqs{layout, RopeFactors(x_pos).to(layout.device), RopeFactors(cap_pos).to(layout.device)});
  return rope_cache_.back();
}

at::Tensor ZImageTransformer::Forward(const at::Tensor& latents, double t, const at::Tensor& caption) {
  return ForwardBatch({latents}, t, {caption}).front();
}

std::vector<at::Tensor> ZImageTransformer::ForwardBatch(const std::vector<at::Tensor>& latents, double t,
                                                        const std::vector<at::Tensor>& captions) {
  ForwardScope scope(*this);
  const ZImageTransformerConfig& c = config_;
  TORCH_CHECK(!latents.empty() && latents.size() == captions.size(),
              "ZImageTransformer: a batch needs as many captions as latents, and at least one");
  const int64_t batch = static_cast<int64_t>(latents.size());
  const at::Tensor& first = latents.front();
  for (const at::Tensor& l : latents) {
    TORCH_CHECK(l.sizes() == first.sizes() && l.scalar_type() == first.scalar_type(),
                "ZImageTransformer: the latents of a batch must have one shape and dtype");
  }
  const at::ScalarType dtype = first.scalar_type();
  const c10::Device device = first.device();
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(device);

  // Timestep: t * t_scale, sinusoidal [cos, sin] in float32, MLP in the model dtype. One timestep
  // for the whole batch: [1, adaln_dim], broadcast over it.
  const at::Tensor freqs = at::exp(at::arange(0, 128, f32) * (-std::log(10000.0) / 128.0));
  const at::Tensor args = at::full({1, 1}, static_cast<float>(t * c.t_scale), f32) * freqs.unsqueeze(0);
  const at::Tensor t_freq = at::cat({at::cos(args), at::sin(args)}, -1);
  const at::Tensor adaln = t_fc2_->Forward(at::silu(t_fc1_->Forward(t_freq.to(dtype)))).to(dtype);

  // Captions: each padded with its last row to a multiple of 32 (lc_i); pads become cap_pad_token.
  // Across the batch, shorter ones are then padded with zeros to the longest (lmax) and masked.
  // The embedder runs once over the whole batch (each caption padded with its last row to lmax,
  // [B, lmax, cap_feat_dim]; a row's adapters apply to its row): a streamed (group-offloaded)
  // embedder is reached once a forward, as in the forward that recorded the groups' order, whatever
  // the batch size — run once per sample, its second sample reached it out of that order, a copy
  // the forward waited for and the prefetches after it redone (session 39, H100: 2.5 waits a
  // batched forward). Rows past lc_i are dropped before the zero padding: each row holds the values
  // it gets embedded alone (on a GPU within the rounding a larger GEMM may bring).
  std::vector<int64_t> lengths;
  std::vector<int64_t> lcs;
  int64_t lmax = 0;
  for (const at::Tensor& caption : captions) {
    const int64_t l = caption.size(0);
    lengths.push_back(l);
    lcs.push_back(l + PadTo(l));
    lmax = std::max(lmax, lcs.back());
  }
  std::vector<at::Tensor> padded;
  for (size_t row = 0; row < captions.size(); ++row) {
    padded.push_back(PadWithLastRow(captions[row].to(dtype), lmax - lengths[row]));
  }
  const at::Tensor embedded = cap_linear_->Forward(cap_norm_->Forward(at::stack(padded, 0)));
  std::vector<at::Tensor> caps;
  for (size_t row = 0; row < captions.size(); ++row) {
    caps.push_back(FillPadRows(embedded.select(0, static_cast<int64_t>(row)).slice(0, 0, lcs[row]), lengths[row],
                               tensor(cap_pad_token_)));
  }
  const bool ragged = std::any_of(lcs.begin(), lcs.end(), [&](int64_t lc) { return lc != lmax; });

  // Image: [C, F, H, W] → patches (f, h, w order; channel fastest inside a patch).
  const int64_t ch = first.size(0), f = first.size(1), h = first.size(2), w = first.size(3);
  const int64_t p = c.patch_size, pf = c.f_patch_size;
  const int64_t ft = f / pf, ht = h / p, wt = w / p;
  const int64_t n = ft * ht * wt;
  const int64_t nx = n + PadTo(n);
  std::vector<at::Tensor> xs;
  for (size_t row = 0; row < latents.size(); ++row) {
    const ScopedLoraRow lora_row(row);
    const at::Tensor& l = latents[row];
    const at::Tensor patches =
        l.view({ch, ft, pf, ht, p, wt, p}).permute({1, 3, 5, 2, 4, 6, 0}).reshape({n, pf * p * p * ch});
    xs.push_back(FillPadRows(x_embedder_->Forward(PadWithLastRow(patches, nx - n)), n, tensor(x_pad_token_)));
  }

  // RoPE: image positions follow each sample's own caption length; caption positions 1..lmax are
  // the same rows for every sample (a shorter caption's extra rows are masked).
  std::vector<at::Tensor> x_freqs_each;
  for (const int64_t lc : lcs) x_freqs_each.push_back(Freqs(RopeLayout{lc, ft, ht, wt, device}, n, nx).x);
  const at::Tensor cap_freqs = Freqs(RopeLayout{lmax, ft, ht, wt, device}, n, nx).cap;
  const at::Tensor x_freqs = ragged ? at::stack(x_freqs_each, 0) : x_freqs_each.front();

  at::Tensor cap_mask;  // [B, lmax], true where a caption token is.
  if (ragged) {
    for (size_t i = 0; i < caps.size(); ++i) {
      if (lcs[i] < lmax) caps[i] = at::cat({caps[i], at::zeros({lmax - lcs[i], c.dim}, caps[i].options())}, 0);
    }
    const at::Tensor positions = at::arange(lmax, at::TensorOptions().dtype(at::kLong)).unsqueeze(0);
    // Made on the host and copied without waiting for the device (device_copy.h): once a step.
    cap_mask = ToDeviceWithoutWaiting(positions.lt(at::tensor(lcs).unsqueeze(1)), device);
  }

  const at::Tensor x = at::stack(xs, 0);    // [B, nx, D]
  const at::Tensor cap = at::stack(caps, 0);  // [B, lmax, D]
  const bool fused = fused::Active(x);
  // Image first, then caption (then, for a shorter caption, masked padding).
  const at::Tensor u_freqs =
      ragged ? at::cat({x_freqs, cap_freqs.unsqueeze(0).expand({batch, lmax, cap_freqs.size(1)})}, 1)
             : at::cat({x_freqs, cap_freqs}, 0);
  at::Tensor u_mask;
  if (ragged) u_mask = at::cat({at::ones({batch, nx}, cap_mask.options()), cap_mask}, 1);
  const ZImageRope x_rope = MakeRope(x_freqs, fused);
  const ZImageRope cap_rope = MakeRope(cap_freqs, fused);
  const ZImageRope u_rope = MakeRope(u_freqs, fused);

  // The rest of the forward reads nothing but these, the masks and the weights.
  auto rest = [&](at::Tensor xi, at::Tensor ci, const at::Tensor& ada, const ZImageRope& xr, const ZImageRope& cr,
                  const ZImageRope& ur) {
    for (ZImageBlock* block : *noise_refiner_) xi = block->Forward(xi, xr, ada);
    for (ZImageBlock* block : *context_refiner_) ci = block->Forward(ci, cr, at::Tensor(), cap_mask);
    at::Tensor u = at::cat({xi, ci}, 1);
    for (ZImageBlock* block : *layers_) u = block->Forward(u, ur, ada, u_mask);
    const at::Tensor scale = 1.0 + final_modulation_->Forward(at::silu(ada));
    u = at::layer_norm(u, {c.dim}, {}, {}, 1e-6) * scale.unsqueeze(1);
    return final_linear_->Forward(u);
  };
  at::Tensor u;
  if (fused && !ragged) {
    // The fused path's RoPE is its cos/sin tables: they, the embedded tokens and the timestep
    // embedding are the graph's inputs.
    const std::vector<at::Tensor> inputs = {x, cap, adaln, x_rope.cos, x_rope.sin, cap_rope.cos, cap_rope.sin,
                                            u_rope.cos, u_rope.sin};
    u = graphs_.Run(*this, inputs, [&](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{rest(in[0], in[1], in[2], ZImageRope{at::Tensor(), in[3], in[4]},
                                          ZImageRope{at::Tensor(), in[5], in[6]}, ZImageRope{at::Tensor(), in[7], in[8]})};
    }).front();
  } else {
    u = rest(x, cap, adaln, x_rope, cap_rope, u_rope);
  }
  std::vector<at::Tensor> out;
  for (int64_t i = 0; i < batch; ++i) {
    out.push_back(u.select(0, i)
                      .slice(0, 0, n)
                      .view({ft, ht, wt, pf, p, p, ch})
                      .permute({6, 0, 3, 1, 4, 2, 5})
                      .reshape({ch, f, h, w}));
  }
  return out;
}

}  // namespace stowage
