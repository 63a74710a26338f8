#include "models/pipelines/tiny_models.h"

#include <cmath>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "models/tokenizers/byte_tokenizer.h"
#include "models/core/config_checks.h"
#include "models/core/diffusers_format.h"

namespace stowage {

// --- Configs ------------------------------------------------------------------------------------

absl::StatusOr<TinyTextEncoderConfig> TinyTextEncoderConfigFromJson(const google::protobuf::Struct& json,
                                                                    const TinyTextEncoderConfig& defaults,
                                                                    const std::string& file) {
  TinyTextEncoderConfig c = defaults;
  ASSIGN_OR_RETURN(c.vocab_size, ConfigInt(json, "vocab_size", c.vocab_size, file));
  ASSIGN_OR_RETURN(c.max_tokens, ConfigInt(json, "max_tokens", c.max_tokens, file));
  ASSIGN_OR_RETURN(c.dim, ConfigInt(json, "dim", c.dim, file));
  ASSIGN_OR_RETURN(c.heads, ConfigInt(json, "heads", c.heads, file));
  ASSIGN_OR_RETURN(c.layers, ConfigInt(json, "layers", c.layers, file));
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const TinyTextEncoderConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Range("vocab_size", c.vocab_size, ByteTokenizer::kVocabSize, kMaxConfigDim)
      .Range("max_tokens", c.max_tokens, 3, 65536)
      .Size("dim", c.dim)
      .Size("heads", c.heads)
      .Divides("heads", c.heads, "dim", c.dim)
      .Range("layers", c.layers, 0, kMaxConfigLayers);
  RETURN_IF_ERROR(check.status());
  ParameterCount layer;
  layer.Add({4 + 8, c.dim + 1, c.dim});  // Attention (4 d×d) and feed-forward (2 d×4d), biases.
  layer.Add({4, c.dim});
  ParameterCount total;
  total.Add({c.vocab_size + c.max_tokens + 1, c.dim});
  total.AddTimes(c.layers, layer);
  return total.Check(file);
}

absl::StatusOr<TinyDiTConfig> TinyDiTConfigFromJson(const google::protobuf::Struct& json,
                                                    const TinyDiTConfig& defaults, const std::string& file) {
  TinyDiTConfig c = defaults;
  ASSIGN_OR_RETURN(c.in_channels, ConfigInt(json, "in_channels", c.in_channels, file));
  ASSIGN_OR_RETURN(c.patch_size, ConfigInt(json, "patch_size", c.patch_size, file));
  ASSIGN_OR_RETURN(c.dim, ConfigInt(json, "dim", c.dim, file));
  ASSIGN_OR_RETURN(c.heads, ConfigInt(json, "heads", c.heads, file));
  ASSIGN_OR_RETURN(c.layers, ConfigInt(json, "layers", c.layers, file));
  ASSIGN_OR_RETURN(c.text_dim, ConfigInt(json, "text_dim", c.text_dim, file));
  ASSIGN_OR_RETURN(c.mlp_ratio, ConfigInt(json, "mlp_ratio", c.mlp_ratio, file));
  ASSIGN_OR_RETURN(c.timestep_dim, ConfigInt(json, "timestep_dim", c.timestep_dim, file));
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const TinyDiTConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Size("in_channels", c.in_channels)
      .Range("patch_size", c.patch_size, 1, kMaxConfigPatch)
      .Range("dim", c.dim, 4, kMaxConfigDim)
      .Size("heads", c.heads)
      .Divides("heads", c.heads, "dim", c.dim)
      .Range("layers", c.layers, 0, kMaxConfigLayers)
      .Size("text_dim", c.text_dim)
      .Range("mlp_ratio", c.mlp_ratio, 1, 64)
      .Range("timestep_dim", c.timestep_dim, 2, kMaxConfigDim)
      .Even("timestep_dim", c.timestep_dim);
  RETURN_IF_ERROR(check.status());
  const int64_t d = c.dim, patch_dim = c.in_channels * c.patch_size * c.patch_size;
  ParameterCount block;
  block.Add({4, d + 1, d});                 // Attention.
  block.Add({2, d + 1, c.mlp_ratio * d});   // Feed-forward.
  block.Add({6, d + 1, d});                 // Modulation.
  block.Add({4, d});                        // qk norms and slack.
  ParameterCount total;
  total.Add({2, patch_dim + 1, d});
  total.Add({c.text_dim + c.timestep_dim + d + 3, d});
  total.Add({3, d + 1, d});
  total.AddTimes(c.layers, block);
  return total.Check(file);
}

absl::StatusOr<TinyVaeDecoderConfig> TinyVaeDecoderConfigFromJson(const google::protobuf::Struct& json,
                                                                  const TinyVaeDecoderConfig& defaults,
                                                                  const std::string& file) {
  TinyVaeDecoderConfig c = defaults;
  ASSIGN_OR_RETURN(c.latent_channels, ConfigInt(json, "latent_channels", c.latent_channels, file));
  ASSIGN_OR_RETURN(c.groups, ConfigInt(json, "groups", c.groups, file));
  ASSIGN_OR_RETURN(c.scaling_factor, ConfigDouble(json, "scaling_factor", c.scaling_factor, file));
  ASSIGN_OR_RETURN(c.shift_factor, ConfigDouble(json, "shift_factor", c.shift_factor, file));
  ASSIGN_OR_RETURN(c.channels, ConfigIntList(json, "block_out_channels", c.channels, file));
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const TinyVaeDecoderConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Size("latent_channels", c.latent_channels)
      .Size("groups", c.groups)
      .Range("block_out_channels (count)", static_cast<int64_t>(c.channels.size()), 2, 8)
      .Above("scaling_factor", c.scaling_factor, 0.0, 1e6)
      .Between("shift_factor", c.shift_factor, -1e6, 1e6);
  for (size_t i = 0; i < c.channels.size() && check.ok(); ++i) {
    const std::string field = absl::StrCat("block_out_channels[", i, "]");
    check.Size(field, c.channels[i]).MultipleOf(field, c.channels[i], "groups", c.groups);
  }
  RETURN_IF_ERROR(check.status());
  ParameterCount total;
  total.Add({9 * c.latent_channels + 1, c.channels[0]});
  total.Add({9 * 2 * c.channels[0] + 8, c.channels[0]});
  for (size_t i = 1; i < c.channels.size(); ++i) {
    total.Add({9 * (c.channels[i - 1] + 2 * c.channels[i]) + c.channels[i - 1] + 8, c.channels[i]});
  }
  total.Add({9 * c.channels.back() + 3, 3});
  return total.Check(file);
}

namespace {

// Sinusoidal embedding of a [B] timestep tensor into [B, dim] (cos half, then sin half).
at::Tensor TimestepEmbedding(const at::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  const at::Tensor freqs =
      at::exp(at::arange(half, t.options().dtype(at::kFloat)) * (-std::log(10000.0) / half));
  const at::Tensor args = t.to(at::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  return at::cat({at::cos(args), at::sin(args)}, 1);
}

// Fixed 2D sin-cos position embedding for an h × w token grid: [h * w, dim].
at::Tensor GridPositionEmbedding(int64_t h, int64_t w, int64_t dim, const at::TensorOptions& opts) {
  const int64_t quarter = dim / 4;
  const at::Tensor freqs =
      at::exp(at::arange(quarter, opts.dtype(at::kFloat)) * (-std::log(10000.0) / quarter));
  const at::Tensor ys = at::arange(h, opts.dtype(at::kFloat)).unsqueeze(1) * freqs;  // [h, q]
  const at::Tensor xs = at::arange(w, opts.dtype(at::kFloat)).unsqueeze(1) * freqs;  // [w, q]
  const at::Tensor y_emb = at::cat({at::sin(ys), at::cos(ys)}, 1).unsqueeze(1).expand({h, w, 2 * quarter});
  const at::Tensor x_emb = at::cat({at::sin(xs), at::cos(xs)}, 1).unsqueeze(0).expand({h, w, 2 * quarter});
  at::Tensor emb = at::cat({y_emb, x_emb}, 2).reshape({h * w, 4 * quarter});
  if (4 * quarter < dim) emb = at::constant_pad_nd(emb, {0, dim - 4 * quarter});
  return emb;
}

at::Tensor Modulate(const at::Tensor& x, const at::Tensor& shift, const at::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

}  // namespace

// --- Text encoder -------------------------------------------------------------------------------

TinyTextEncoderLayer::TinyTextEncoderLayer(const TinyTextEncoderConfig& config,
                                           const LayerOptions& options)
    : Module("TinyTextEncoderLayer") {
  norm1_ = AddChild("norm1", std::make_unique<RMSNorm>(config.dim, 1e-6, true, options));
  attn_ = AddChild("attn", std::make_unique<SelfAttention>(config.dim, config.heads, false, options));
  norm2_ = AddChild("norm2", std::make_unique<RMSNorm>(config.dim, 1e-6, true, options));
  ff_ = AddChild("ff", std::make_unique<FeedForward>(config.dim, 4 * config.dim, options));
}

at::Tensor TinyTextEncoderLayer::Forward(const at::Tensor& x, const at::Tensor& mask) {
  ForwardScope scope(*this);
  at::Tensor h = x + attn_->Forward(norm1_->Forward(x), mask);
  return h + ff_->Forward(norm2_->Forward(h));
}

TinyTextEncoder::TinyTextEncoder(const TinyTextEncoderConfig& config, const LayerOptions& options)
    : Module("TinyTextEncoder"), config_(config) {
  embed_ = AddChild("embed", std::make_unique<Embedding>(config.vocab_size, config.dim, options));
  position_ = AddParameter(
      "position", at::empty({config.max_tokens, config.dim}, at::TensorOptions().dtype(options.dtype)));
  layers_ = AddChild("layers", std::make_unique<ModuleList<TinyTextEncoderLayer>>());
  for (int64_t i = 0; i < config.layers; ++i) {
    layers_->Append(std::make_unique<TinyTextEncoderLayer>(config, options));
  }
  norm_ = AddChild("norm", std::make_unique<RMSNorm>(config.dim, 1e-6, true, options));
}

at::Tensor TinyTextEncoder::Forward(const at::Tensor& ids, const at::Tensor& mask) {
  ForwardScope scope(*this);
  const int64_t length = ids.size(1);
  TORCH_CHECK(length <= config_.max_tokens, "TinyTextEncoder: ", length, " tokens exceed ",
              config_.max_tokens);
  at::Tensor x = embed_->Forward(ids) + tensor(position_).slice(0, 0, length).unsqueeze(0) * 0.1;
  for (TinyTextEncoderLayer* layer : *layers_) x = layer->Forward(x, mask);
  return norm_->Forward(x);
}

// --- Denoiser -----------------------------------------------------------------------------------

DiTBlock::DiTBlock(const TinyDiTConfig& config, const LayerOptions& options) : Module("DiTBlock") {
  norm1_ = AddChild("norm1", std::make_unique<LayerNorm>(config.dim, 1e-6, false, options));
  attn_ = AddChild("attn", std::make_unique<SelfAttention>(config.dim, config.heads, true, options));
  norm2_ = AddChild("norm2", std::make_unique<LayerNorm>(config.dim, 1e-6, false, options));
  ff_ = AddChild("ff", std::make_unique<FeedForward>(config.dim, config.mlp_ratio * config.dim, options));
  modulation_ = AddChild("modulation", std::make_unique<Linear>(config.dim, 6 * config.dim, true, options));
}

at::Tensor DiTBlock::Forward(const at::Tensor& x, const at::Tensor& c, const at::Tensor& mask) {
  ForwardScope scope(*this);
  const std::vector<at::Tensor> mod = modulation_->Forward(at::silu(c)).chunk(6, 1);
  at::Tensor h = x + mod[2].unsqueeze(1) * attn_->Forward(Modulate(norm1_->Forward(x), mod[0], mod[1]), mask);
  return h + mod[5].unsqueeze(1) * ff_->Forward(Modulate(norm2_->Forward(h), mod[3], mod[4]));
}

TinyDiT::TinyDiT(const TinyDiTConfig& config, const LayerOptions& options)
    : Module("TinyDiT"), config_(config) {
  const int64_t patch_dim = config.in_channels * config.patch_size * config.patch_size;
  patch_embed_ = AddChild("patch_embed", std::make_unique<Linear>(patch_dim, config.dim, true, options));
  text_proj_ = AddChild("text_proj", std::make_unique<Linear>(config.text_dim, config.dim, true, options));
  time_fc1_ = AddChild("time_fc1", std::make_unique<Linear>(config.timestep_dim, config.dim, true, options));
  time_fc2_ = AddChild("time_fc2", std::make_unique<Linear>(config.dim, config.dim, true, options));
  blocks_ = AddChild("blocks", std::make_unique<ModuleList<DiTBlock>>());
  for (int64_t i = 0; i < config.layers; ++i) blocks_->Append(std::make_unique<DiTBlock>(config, options));
  norm_out_ = AddChild("norm_out", std::make_unique<LayerNorm>(config.dim, 1e-6, false, options));
  modulation_out_ = AddChild("modulation_out", std::make_unique<Linear>(config.dim, 2 * config.dim, true, options));
  proj_out_ = AddChild("proj_out", std::make_unique<Linear>(config.dim, patch_dim, true, options));
}

at::Tensor TinyDiT::Forward(const at::Tensor& latents, const at::Tensor& timestep,
                            const at::Tensor& text, const at::Tensor& text_mask) {
  ForwardScope scope(*this);
  const int64_t b = latents.size(0);
  const int64_t ch = latents.size(1);
  const int64_t p = config_.patch_size;
  const int64_t gh = latents.size(2) / p;
  const int64_t gw = latents.size(3) / p;
  const at::ScalarType dtype = text.scalar_type();

  // [B, C, gh*p, gw*p] → [B, gh*gw, C*p*p]
  const at::Tensor patches = latents.reshape({b, ch, gh, p, gw, p})
                                 .permute({0, 2, 4, 1, 3, 5})
                                 .reshape({b, gh * gw, ch * p * p})
                                 .to(dtype);
  const at::Tensor image_tokens =
      patch_embed_->Forward(patches) +
      GridPositionEmbedding(gh, gw, config_.dim, latents.options()).to(dtype).unsqueeze(0);
  const at::Tensor text_tokens = text_proj_->Forward(text);
  const at::Tensor c =
      time_fc2_->Forward(at::silu(time_fc1_->Forward(TimestepEmbedding(timestep, config_.timestep_dim).to(dtype))));

  const int64_t text_len = text.size(1);
  at::Tensor x = at::cat({text_tokens, image_tokens}, 1);
  const at::Tensor mask = at::cat(
      {text_mask, at::ones({b, gh * gw}, text_mask.options())}, 1);
  for (DiTBlock* block : *blocks_) x = block->Forward(x, c, mask);

  const std::vector<at::Tensor> mod = modulation_out_->Forward(at::silu(c)).chunk(2, 1);
  const at::Tensor out = proj_out_->Forward(
      Modulate(norm_out_->Forward(x.slice(1, text_len)), mod[0], mod[1]));
  // [B, gh*gw, C*p*p] → [B, C, gh*p, gw*p]
  return out.reshape({b, gh, gw, ch, p, p})
      .permute({0, 3, 1, 4, 2, 5})
      .reshape({b, ch, gh * p, gw * p});
}

// --- VAE decoder --------------------------------------------------------------------------------

VaeUpBlock::VaeUpBlock(int64_t in, int64_t out, int64_t groups, const LayerOptions& options)
    : Module("VaeUpBlock") {
  resnet_ = AddChild("resnet", std::make_unique<ResnetBlock2D>(in, out, groups, options));
  upsample_conv_ = AddChild("upsample_conv", std::make_unique<Conv2d>(out, out, 3, 1, 1, options));
}

at::Tensor VaeUpBlock::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  const at::Tensor h = resnet_->Forward(x);
  return upsample_conv_->Forward(at::upsample_nearest2d(h, {h.size(2) * 2, h.size(3) * 2}));
}

TinyVaeDecoder::TinyVaeDecoder(const TinyVaeDecoderConfig& config, const LayerOptions& options)
    : Module("TinyVaeDecoder"), config_(config) {
  const std::vector<int64_t>& ch = config.channels;
  conv_in_ = AddChild("conv_in", std::make_unique<Conv2d>(config.latent_channels, ch[0], 3, 1, 1, options));
  mid_ = AddChild("mid", std::make_unique<ResnetBlock2D>(ch[0], ch[0], config.groups, options));
  up_blocks_ = AddChild("up_blocks", std::make_unique<ModuleList<VaeUpBlock>>());
  for (size_t i = 1; i < ch.size(); ++i) {
    up_blocks_->Append(std::make_unique<VaeUpBlock>(ch[i - 1], ch[i], config.groups, options));
  }
  norm_out_ = AddChild("norm_out", std::make_unique<GroupNorm>(config.groups, ch.back(), 1e-6, options));
  conv_out_ = AddChild("conv_out", std::make_unique<Conv2d>(ch.back(), 3, 3, 1, 1, options));
}

at::Tensor TinyVaeDecoder::Forward(const at::Tensor& latents) {
  ForwardScope scope(*this);
  const at::ScalarType dtype = latents.scalar_type();
  at::Tensor z = latents / config_.scaling_factor + config_.shift_factor;
  at::Tensor h = mid_->Forward(conv_in_->Forward(z.to(dtype)));
  for (VaeUpBlock* up : *up_blocks_) h = up->Forward(h);
  return at::tanh(conv_out_->Forward(at::silu(norm_out_->Forward(h))));
}

}  // namespace stowage
