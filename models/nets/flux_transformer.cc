#include "models/nets/flux_transformer.h"

#include <cmath>
#include <memory>
#include <tuple>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "models/core/config_checks.h"
#include "models/core/fused_ops.h"
#include "models/core/diffusers_format.h"

namespace stowage {
namespace {

constexpr double kNormEps = 1e-6;

// diffusers' apply_rotary_emb (use_real, unbind over the last dim): pairs (x0, x1) become
// (x0·cos − x1·sin, x1·cos + x0·sin), in float32. x: [B, S, H, D]; cos, sin: [S, D].
at::Tensor ApplyRope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const at::Tensor pairs = x.reshape({x.size(0), x.size(1), x.size(2), -1, 2});
  const at::Tensor real = pairs.select(-1, 0), imag = pairs.select(-1, 1);
  const at::Tensor rotated = at::stack({imag.neg(), real}, -1).flatten(3);
  const at::Tensor c = cos.unsqueeze(0).unsqueeze(2), s = sin.unsqueeze(0).unsqueeze(2);
  return (x.to(at::kFloat) * c + rotated.to(at::kFloat) * s).to(x.scalar_type());
}

// LayerNorm without affine (eps 1e-6), computed in float32.
at::Tensor PlainLayerNorm(const at::Tensor& x, int64_t dim) {
  return at::layer_norm(x.to(at::kFloat), {dim}, {}, {}, kNormEps).to(x.scalar_type());
}

// Two Linear layers named "<name>.linear_1" and "<name>.linear_2" under `parent`.
std::pair<Linear*, Linear*> TwoLinears(Module& parent, const std::string& name, int64_t in, int64_t hidden,
                                       int64_t out, const LayerOptions& o) {
  auto* m = parent.AddChild(name, std::make_unique<Container>("Embedding"));
  return {m->AddChild("linear_1", std::make_unique<Linear>(in, hidden, true, o)),
          m->AddChild("linear_2", std::make_unique<Linear>(hidden, out, true, o))};
}

// diffusers' FeedForward(activation "gelu-approximate"): net.0.proj, tanh GELU, net.2.
std::pair<Linear*, Linear*> GeluFeedForward(Module& parent, const std::string& name, int64_t dim,
                                            const LayerOptions& o) {
  auto* ff = parent.AddChild(name, std::make_unique<Container>("FeedForward"));
  auto* net = ff->AddChild("net", std::make_unique<Sequential>());
  auto* gelu = net->Add(std::make_unique<Container>("GELU"));
  Linear* in = gelu->AddChild("proj", std::make_unique<Linear>(dim, 4 * dim, true, o));
  net->Add(std::make_unique<Activation>("Dropout"));
  Linear* out = net->Add(std::make_unique<Linear>(4 * dim, dim, true, o));
  return {in, out};
}

// out(gelu_tanh(in(x))): with FP8 weights the GELU runs inside out's input quantisation (the
// GELU's output is never written) and a normed x goes straight into in's FP8 input; otherwise the
// GELU runs in in's GEMM epilogue where the fused kernels run.
at::Tensor GeluFeedForwardForward(Linear& in, Linear& out, SharedInput& x) {
  if (out.is_fp8()) return out.ForwardConcat({Linear::ForwardShared({&in}, x)[0]}, {true});
  return out.Forward(in.ForwardGelu(x.Values()));
}

// An AdaLayerNorm's projection: "<name>.linear" (its SiLU has no weights).
Linear* AdaLinear(Module& parent, const std::string& name, int64_t dim, int64_t chunks, const LayerOptions& o) {
  return parent.AddChild(name, std::make_unique<Container>("AdaLayerNorm"))
      ->AddChild("linear", std::make_unique<Linear>(dim, chunks * dim, true, o));
}

}  // namespace

absl::StatusOr<FluxTransformerConfig> FluxTransformerConfigFromJson(const google::protobuf::Struct& json,
                                                                   const std::string& file) {
  FluxTransformerConfig c;
  ASSIGN_OR_RETURN(c.patch_size, ConfigInt(json, "patch_size", c.patch_size, file));
  ASSIGN_OR_RETURN(c.in_channels, ConfigInt(json, "in_channels", c.in_channels, file));
  auto out = json.fields().find("out_channels");
  if (out != json.fields().end() && !out->second.has_null_value()) {
    ASSIGN_OR_RETURN(c.out_channels, ConfigInt(json, "out_channels", 0, file));
  }
  ASSIGN_OR_RETURN(c.num_layers, ConfigInt(json, "num_layers", c.num_layers, file));
  ASSIGN_OR_RETURN(c.num_single_layers, ConfigInt(json, "num_single_layers", c.num_single_layers, file));
  ASSIGN_OR_RETURN(c.attention_head_dim, ConfigInt(json, "attention_head_dim", c.attention_head_dim, file));
  ASSIGN_OR_RETURN(c.num_attention_heads, ConfigInt(json, "num_attention_heads", c.num_attention_heads, file));
  ASSIGN_OR_RETURN(c.joint_attention_dim, ConfigInt(json, "joint_attention_dim", c.joint_attention_dim, file));
  ASSIGN_OR_RETURN(c.pooled_projection_dim, ConfigInt(json, "pooled_projection_dim", c.pooled_projection_dim, file));
  ASSIGN_OR_RETURN(c.guidance_embeds, ConfigBool(json, "guidance_embeds", c.guidance_embeds, file));
  ASSIGN_OR_RETURN(c.axes_dims_rope, ConfigIntList(json, "axes_dims_rope", c.axes_dims_rope, file));
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const FluxTransformerConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Range("patch_size", c.patch_size, 1, kMaxConfigPatch)
      .Size("in_channels", c.in_channels)
      .Range("out_channels", c.out_channels, 0, kMaxConfigDim)
      .Range("num_layers", c.num_layers, 0, kMaxConfigLayers)
      .Range("num_single_layers", c.num_single_layers, 0, kMaxConfigLayers)
      .Require(c.num_layers + c.num_single_layers > 0, "num_layers", "and num_single_layers are both 0")
      .Size("attention_head_dim", c.attention_head_dim)
      .Size("num_attention_heads", c.num_attention_heads)
      .Size("joint_attention_dim", c.joint_attention_dim)
      .Size("pooled_projection_dim", c.pooled_projection_dim)
      .Require(c.axes_dims_rope.size() == 3, "axes_dims_rope",
               absl::StrCat("has ", c.axes_dims_rope.size(), " entries; must have 3"));
  RETURN_IF_ERROR(check.status());
  check.Size("inner dim num_attention_heads * attention_head_dim", c.num_attention_heads * c.attention_head_dim);
  int64_t axes_sum = 0;
  for (size_t i = 0; i < 3; ++i) {
    const std::string field = absl::StrCat("axes_dims_rope[", i, "]");
    check.Range(field, c.axes_dims_rope[i], 2, kMaxConfigDim).Even(field, c.axes_dims_rope[i]);
    axes_sum += c.axes_dims_rope[i];
  }
  RETURN_IF_ERROR(check.status());
  check.Equals("sum of axes_dims_rope", axes_sum, "attention_head_dim", c.attention_head_dim);
  RETURN_IF_ERROR(check.status());
  const int64_t d = c.inner_dim(), hd = c.attention_head_dim;
  ParameterCount joint;
  joint.Add({2, d + 1, 6 * d});        // norm1, norm1_context.
  joint.Add({8, d + 1, d});            // to_q/k/v/out, add_q/k/v_proj, to_add_out.
  joint.Add({4, hd});                  // Four RMSNorms.
  joint.Add({2, d + 1, 4 * d});        // ff and ff_context: in.
  joint.Add({2, 4 * d + 1, d});        // ff and ff_context: out.
  ParameterCount single;
  single.Add({d + 1, 3 * d});          // norm.linear.
  single.Add({3, d + 1, d});           // to_q/k/v.
  single.Add({2, hd});
  single.Add({d + 1, 4 * d});          // proj_mlp.
  single.Add({5 * d + 1, d});          // proj_out.
  ParameterCount total;
  total.Add({(c.guidance_embeds ? 2 : 1), 257 + d + 1, d});  // Timestep (and guidance) embedders.
  total.Add({c.pooled_projection_dim + 1 + d + 1, d});       // text_embedder.
  total.Add({c.joint_attention_dim + 1, d});                 // context_embedder.
  total.Add({c.in_channels + 1, d});                         // x_embedder.
  total.Add({d + 1, 2 * d});                                 // norm_out.
  total.Add({d + 1, c.patch_size * c.patch_size * c.out()}); // proj_out.
  total.AddTimes(c.num_layers, joint);
  total.AddTimes(c.num_single_layers, single);
  return total.Check(file);
}

FluxAttention::FluxAttention(int64_t dim, int64_t heads, int64_t head_dim, bool joint, bool pre_only,
                             const LayerOptions& o)
    : Module("FluxAttention"), heads_(heads), head_dim_(head_dim) {
  const int64_t inner = heads * head_dim;
  norm_q_ = AddChild("norm_q", std::make_unique<RMSNorm>(head_dim, kNormEps, true, o, true));
  norm_k_ = AddChild("norm_k", std::make_unique<RMSNorm>(head_dim, kNormEps, true, o, true));
  to_q_ = AddChild("to_q", std::make_unique<Linear>(dim, inner, true, o));
  to_k_ = AddChild("to_k", std::make_unique<Linear>(dim, inner, true, o));
  to_v_ = AddChild("to_v", std::make_unique<Linear>(dim, inner, true, o));
  if (!pre_only) {
    auto* out = AddChild("to_out", std::make_unique<Sequential>());
    to_out_ = out->Add(std::make_unique<Linear>(inner, dim, true, o));
    Linear::DeclareAdjacent(*this, {to_q_, to_k_, to_v_});  // A single block groups them with its MLP.
  }
  if (joint) {
    norm_added_q_ = AddChild("norm_added_q", std::make_unique<RMSNorm>(head_dim, kNormEps, true, o, true));
    norm_added_k_ = AddChild("norm_added_k", std::make_unique<RMSNorm>(head_dim, kNormEps, true, o, true));
    add_q_proj_ = AddChild("add_q_proj", std::make_unique<Linear>(dim, inner, true, o));
    add_k_proj_ = AddChild("add_k_proj", std::make_unique<Linear>(dim, inner, true, o));
    add_v_proj_ = AddChild("add_v_proj", std::make_unique<Linear>(dim, inner, true, o));
    to_add_out_ = AddChild("to_add_out", std::make_unique<Linear>(inner, dim, true, o));
    Linear::DeclareAdjacent(*this, {add_q_proj_, add_k_proj_, add_v_proj_});
  }
}

at::Tensor FluxAttention::ForwardProjected(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const FluxRope& rope) {
  ForwardScope scope(*this);
  auto heads = [&](const at::Tensor& t) { return t.view({t.size(0), t.size(1), heads_, head_dim_}); };
  const at::Tensor qr = norm_q_->ForwardRope(heads(q), rope.pair_cos, rope.pair_sin);
  const at::Tensor kr = norm_k_->ForwardRope(heads(k), rope.pair_cos, rope.pair_sin);
  return ScaledDotProductAttention(qr.transpose(1, 2), kr.transpose(1, 2), heads(v).transpose(1, 2), at::Tensor())
      .transpose(1, 2)
      .flatten(2, 3)
      .to(q.scalar_type());
}

std::pair<at::Tensor, at::Tensor> FluxAttention::Forward(const at::Tensor& x, const at::Tensor& context,
                                                         const FluxRope& rope) {
  if (rope.pair_cos.defined()) {
    SharedInput xi(x), ci(context);
    return Forward(xi, context.defined() ? &ci : nullptr, rope);
  }
  ForwardScope scope(*this);
  auto heads = [&](const at::Tensor& t) { return t.view({t.size(0), t.size(1), heads_, head_dim_}); };
  const bool joint = add_q_proj_ != nullptr && context.defined();
  at::Tensor q = norm_q_->Forward(heads(to_q_->Forward(x)));
  at::Tensor k = norm_k_->Forward(heads(to_k_->Forward(x)));
  at::Tensor v = heads(to_v_->Forward(x));
  if (joint) {
    q = at::cat({norm_added_q_->Forward(heads(add_q_proj_->Forward(context))), q}, 1);
    k = at::cat({norm_added_k_->Forward(heads(add_k_proj_->Forward(context))), k}, 1);
    v = at::cat({heads(add_v_proj_->Forward(context)), v}, 1);
  }
  return Attend(ApplyRope(q, rope.cos, rope.sin), ApplyRope(k, rope.cos, rope.sin), v, joint,
                joint ? context.size(1) : 0);
}

std::pair<at::Tensor, at::Tensor> FluxAttention::Forward(SharedInput& x, SharedInput* context, const FluxRope& rope) {
  ForwardScope scope(*this);
  auto heads = [&](const at::Tensor& t) { return t.view({t.size(0), t.size(1), heads_, head_dim_}); };
  const at::Tensor& xp = x.probe();
  const bool joint = add_q_proj_ != nullptr && context != nullptr && context->probe().defined();
  // Norm and rotation in one kernel, written straight into the joint [text; image] tensors.
  const int64_t text = joint ? context->probe().size(1) : 0;
  const std::vector<int64_t> shape = {xp.size(0), text + xp.size(1), heads_, head_dim_};
  const at::Tensor q = at::empty(shape, xp.options());
  const at::Tensor k = at::empty(shape, xp.options());
  at::Tensor context_v;
  if (joint) {
    const std::vector<at::Tensor> added = Linear::ForwardShared({add_q_proj_, add_k_proj_, add_v_proj_}, *context);
    norm_added_q_->ForwardRope(heads(added[0]), rope.pair_cos, rope.pair_sin, 0, q);
    norm_added_k_->ForwardRope(heads(added[1]), rope.pair_cos, rope.pair_sin, 0, k);
    context_v = heads(added[2]);
  }
  const std::vector<at::Tensor> qkv = Linear::ForwardShared({to_q_, to_k_, to_v_}, x);
  norm_q_->ForwardRope(heads(qkv[0]), rope.pair_cos, rope.pair_sin, text, q);
  norm_k_->ForwardRope(heads(qkv[1]), rope.pair_cos, rope.pair_sin, text, k);
  const at::Tensor v = joint ? fused::ConcatTokens({context_v, heads(qkv[2])}) : heads(qkv[2]);
  return Attend(q, k, v, joint, text);
}

std::pair<at::Tensor, at::Tensor> FluxAttention::Attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        bool joint, int64_t text) {
  at::Tensor o = ScaledDotProductAttention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), at::Tensor())
                     .transpose(1, 2)
                     .flatten(2, 3)
                     .to(q.scalar_type());
  if (!joint) return {to_out_ != nullptr ? to_out_->Forward(o) : o, at::Tensor()};
  const at::Tensor text_out = to_add_out_->Forward(o.slice(1, 0, text).contiguous());
  const at::Tensor image_out = to_out_->Forward(o.slice(1, text).contiguous());
  return {image_out, text_out};
}

FluxTransformerBlock::FluxTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim, const LayerOptions& o)
    : Module("FluxTransformerBlock") {
  norm1_ = AdaLinear(*this, "norm1", dim, 6, o);
  norm1_context_ = AdaLinear(*this, "norm1_context", dim, 6, o);
  attn_ = AddChild("attn", std::make_unique<FluxAttention>(dim, heads, head_dim, /*joint=*/true, false, o));
  std::tie(ff_in_, ff_out_) = GeluFeedForward(*this, "ff", dim, o);
  std::tie(ff_context_in_, ff_context_out_) = GeluFeedForward(*this, "ff_context", dim, o);
}

std::pair<at::Tensor, at::Tensor> FluxTransformerBlock::Forward(const at::Tensor& x, const at::Tensor& context,
                                                                const at::Tensor& silu_temb, const FluxRope& rope) {
  ForwardScope scope(*this);
  const int64_t dim = x.size(2);
  // AdaLayerNormZero: shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp.
  const std::vector<at::Tensor> m = norm1_->Forward(silu_temb).unsqueeze(1).chunk(6, 2);
  const std::vector<at::Tensor> c = norm1_context_->Forward(silu_temb).unsqueeze(1).chunk(6, 2);
  if (rope.pair_cos.defined()) {
    // Norm + modulation in one kernel (with FP8 projections, writing their FP8 input directly);
    // gated residuals in one.
    SharedInput nx = SharedInput::LayerNormModulated(x, 1 + m[1], m[0], kNormEps);
    SharedInput nc = SharedInput::LayerNormModulated(context, 1 + c[1], c[0], kNormEps);
    const auto [attn, context_attn] = attn_->Forward(nx, &nc, rope);
    at::Tensor h = fused::GatedAdd(x, m[2], attn);
    SharedInput hm = SharedInput::LayerNormModulated(h, 1 + m[4], m[3], kNormEps);
    h = fused::GatedAdd(h, m[5], GeluFeedForwardForward(*ff_in_, *ff_out_, hm));
    at::Tensor t = fused::GatedAdd(context, c[2], context_attn);
    SharedInput tm = SharedInput::LayerNormModulated(t, 1 + c[4], c[3], kNormEps);
    t = fused::GatedAdd(t, c[5], GeluFeedForwardForward(*ff_context_in_, *ff_context_out_, tm));
    return {t, h};
  }
  const at::Tensor nx = PlainLayerNorm(x, dim) * (1 + m[1]) + m[0];
  const at::Tensor nc = PlainLayerNorm(context, dim) * (1 + c[1]) + c[0];
  const auto [attn, context_attn] = attn_->Forward(nx, nc, rope);
  at::Tensor h = x + m[2] * attn;
  const at::Tensor hm = PlainLayerNorm(h, dim) * (1 + m[4]) + m[3];
  h = h + m[5] * ff_out_->Forward(at::gelu(ff_in_->Forward(hm), "tanh"));
  at::Tensor t = context + c[2] * context_attn;
  const at::Tensor tm = PlainLayerNorm(t, dim) * (1 + c[4]) + c[3];
  t = t + c[5] * ff_context_out_->Forward(at::gelu(ff_context_in_->Forward(tm), "tanh"));
  return {t, h};
}

FluxSingleTransformerBlock::FluxSingleTransformerBlock(int64_t dim, int64_t heads, int64_t head_dim,
                                                       const LayerOptions& o)
    : Module("FluxSingleTransformerBlock") {
  norm_ = AdaLinear(*this, "norm", dim, 3, o);
  proj_mlp_ = AddChild("proj_mlp", std::make_unique<Linear>(dim, 4 * dim, true, o));
  proj_out_ = AddChild("proj_out", std::make_unique<Linear>(5 * dim, dim, true, o));
  attn_ = AddChild("attn", std::make_unique<FluxAttention>(dim, heads, head_dim, /*joint=*/false, /*pre_only=*/true, o));
  std::vector<Linear*> shared = attn_->projections();
  shared.push_back(proj_mlp_);
  Linear::DeclareAdjacent(*this, shared);
}

at::Tensor FluxSingleTransformerBlock::Forward(const at::Tensor& x, const at::Tensor& silu_temb, const FluxRope& rope) {
  ForwardScope scope(*this);
  // AdaLayerNormZeroSingle: shift_msa, scale_msa, gate_msa.
  const std::vector<at::Tensor> m = norm_->Forward(silu_temb).unsqueeze(1).chunk(3, 2);
  if (rope.pair_cos.defined()) {
    // Q, K, V and the MLP input in one GEMM when their weights are adjacent.
    SharedInput n = SharedInput::LayerNormModulated(x, 1 + m[1], m[0], kNormEps);
    std::vector<Linear*> layers = attn_->projections();
    layers.push_back(proj_mlp_);
    const std::vector<at::Tensor> p = Linear::ForwardShared(layers, n);
    const at::Tensor attn = attn_->ForwardProjected(p[0], p[1], p[2], rope);
    // proj_out reads [attn, gelu(mlp)]: neither the GELU nor the concatenation is written out.
    return fused::GatedAdd(x, m[2], proj_out_->ForwardConcat({attn, p[3]}, {false, true}));
  }
  const at::Tensor n = PlainLayerNorm(x, x.size(2)) * (1 + m[1]) + m[0];
  const at::Tensor mlp = at::gelu(proj_mlp_->Forward(n), "tanh");
  const at::Tensor attn = attn_->Forward(n, at::Tensor(), rope).first;
  return x + m[2] * proj_out_->Forward(at::cat({attn, mlp}, 2));
}

FluxTransformer::FluxTransformer(const FluxTransformerConfig& c, const LayerOptions& o)
    : Module("FluxTransformer2DModel"), config_(c) {
  const int64_t d = c.inner_dim();
  auto* tte = AddChild("time_text_embed", std::make_unique<Container>(
                                              c.guidance_embeds ? "CombinedTimestepGuidanceTextProjEmbeddings"
                                                                : "CombinedTimestepTextProjEmbeddings"));
  std::tie(t_linear_1_, t_linear_2_) = TwoLinears(*tte, "timestep_embedder", 256, d, d, o);
  if (c.guidance_embeds) std::tie(g_linear_1_, g_linear_2_) = TwoLinears(*tte, "guidance_embedder", 256, d, d, o);
  std::tie(text_linear_1_, text_linear_2_) = TwoLinears(*tte, "text_embedder", c.pooled_projection_dim, d, d, o);
  context_embedder_ = AddChild("context_embedder", std::make_unique<Linear>(c.joint_attention_dim, d, true, o));
  x_embedder_ = AddChild("x_embedder", std::make_unique<Linear>(c.in_channels, d, true, o));
  blocks_ = AddChild("transformer_blocks", std::make_unique<ModuleList<FluxTransformerBlock>>());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    blocks_->Append(std::make_unique<FluxTransformerBlock>(d, c.num_attention_heads, c.attention_head_dim, o));
  }
  single_blocks_ = AddChild("single_transformer_blocks", std::make_unique<ModuleList<FluxSingleTransformerBlock>>());
  for (int64_t i = 0; i < c.num_single_layers; ++i) {
    single_blocks_->Append(
        std::make_unique<FluxSingleTransformerBlock>(d, c.num_attention_heads, c.attention_head_dim, o));
  }
  norm_out_ = AdaLinear(*this, "norm_out", d, 2, o);
  proj_out_ = AddChild("proj_out", std::make_unique<Linear>(d, c.patch_size * c.patch_size * c.out(), true, o));
}

at::Tensor FluxTransformer::TimestepProjection(const at::Tensor& scaled) {
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat).device(scaled.device());
  const at::Tensor exponent = at::arange(0, 128, f32) * (-std::log(10000.0) / 128.0);
  const at::Tensor args = scaled.to(at::kFloat).unsqueeze(1) * at::exp(exponent).unsqueeze(0);
  return at::cat({at::cos(args), at::sin(args)}, -1);  // flip_sin_to_cos.
}

std::pair<at::Tensor, at::Tensor> FluxTransformer::Rope(const at::Tensor& ids) const {
  std::vector<at::Tensor> cos, sin;
  const at::Tensor pos = ids.to(at::kDouble);
  for (int64_t axis = 0; axis < 3; ++axis) {
    const int64_t dim = config_.axes_dims_rope[static_cast<size_t>(axis)];
    const at::Tensor freqs =
        1.0 / at::pow(10000.0, at::arange(0, dim, 2, pos.options()) / static_cast<double>(dim));
    const at::Tensor angles = at::outer(pos.select(1, axis), freqs);
    cos.push_back(at::cos(angles).repeat_interleave(2, 1).to(at::kFloat));
    sin.push_back(at::sin(angles).repeat_interleave(2, 1).to(at::kFloat));
  }
  return {at::cat(cos, -1), at::cat(sin, -1)};
}

at::Tensor FluxTransformer::Forward(const at::Tensor& hidden, const at::Tensor& text, const at::Tensor& pooled,
                                    const at::Tensor& timestep, const at::Tensor& img_ids, const at::Tensor& txt_ids,
                                    const at::Tensor& guidance) {
  ForwardScope scope(*this);
  TORCH_CHECK(guidance.defined() == config_.guidance_embeds,
              config_.guidance_embeds ? "FluxTransformer: this model (guidance_embeds) needs a guidance value"
                                      : "FluxTransformer: this model takes no guidance value");
  const at::ScalarType dtype = hidden.scalar_type();
  at::Tensor x = x_embedder_->Forward(hidden);
  // The timestep (and guidance) are cast to the model dtype, then scaled by 1000, as diffusers does.
  auto embed = [&](const at::Tensor& t, Linear* l1, Linear* l2) {
    const at::Tensor projected = TimestepProjection(t.to(dtype) * 1000).to(dtype);
    return l2->Forward(at::silu(l1->Forward(projected)));
  };
  at::Tensor temb = embed(timestep, t_linear_1_, t_linear_2_);
  if (config_.guidance_embeds) temb = temb + embed(guidance, g_linear_1_, g_linear_2_);
  temb = temb + text_linear_2_->Forward(at::silu(text_linear_1_->Forward(pooled.to(dtype))));
  at::Tensor context = context_embedder_->Forward(text.to(dtype));
  const auto [cos, sin] = Rope(at::cat({txt_ids, img_ids}, 0));
  FluxRope rope{cos.to(hidden.device()), sin.to(hidden.device()), at::Tensor(), at::Tensor()};
  if (fused::Active(x)) {  // The pair tables: every other column (the angles are repeated per pair).
    rope.pair_cos = rope.cos.slice(1, 0, rope.cos.size(1), 2).contiguous();
    rope.pair_sin = rope.sin.slice(1, 0, rope.sin.size(1), 2).contiguous();
  }
  // The rest of the forward reads nothing but these and the weights.
  auto rest = [&](at::Tensor xi, at::Tensor ci, const at::Tensor& te, const FluxRope& r) {
    const at::Tensor silu_te = at::silu(te);  // Every block's AdaLayerNorm reads it.
    for (FluxTransformerBlock* block : *blocks_) std::tie(ci, xi) = block->Forward(xi, ci, silu_te, r);
    const int64_t text_len = ci.size(1);
    at::Tensor u = at::cat({ci, xi}, 1);
    for (FluxSingleTransformerBlock* block : *single_blocks_) u = block->Forward(u, silu_te, r);
    xi = u.slice(1, text_len);
    // AdaLayerNormContinuous: scale first, then shift.
    const std::vector<at::Tensor> ss = norm_out_->Forward(silu_te.to(dtype)).unsqueeze(1).chunk(2, 2);
    xi = PlainLayerNorm(xi, xi.size(2)) * (1 + ss[0]) + ss[1];
    return proj_out_->Forward(xi);
  };
  if (!rope.pair_cos.defined()) return rest(x, context, temb, rope);
  const std::vector<at::Tensor> inputs = {x, context, temb, rope.cos, rope.sin, rope.pair_cos, rope.pair_sin};
  return graphs_
      .Run(*this, inputs,
           [&](const std::vector<at::Tensor>& in) {
             return std::vector<at::Tensor>{rest(in[0], in[1], in[2], FluxRope{in[3], in[4], in[5], in[6]})};
           })
      .front();
}

}  // namespace stowage
