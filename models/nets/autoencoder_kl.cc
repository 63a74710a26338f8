#include "models/nets/autoencoder_kl.h"

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "models/core/config_checks.h"
#include "models/core/diffusers_format.h"
#include "base/status_macros.h"

namespace stowage {
absl::StatusOr<AutoencoderKLConfig> AutoencoderKLConfigFromJson(const google::protobuf::Struct& json,
                                                               const std::string& file) {
  AutoencoderKLConfig c;
  ASSIGN_OR_RETURN(c.in_channels, ConfigInt(json, "in_channels", c.in_channels, file));
  ASSIGN_OR_RETURN(c.use_quant_conv, ConfigBool(json, "use_quant_conv", c.use_quant_conv, file));
  ASSIGN_OR_RETURN(c.latent_channels, ConfigInt(json, "latent_channels", c.latent_channels, file));
  ASSIGN_OR_RETURN(c.out_channels, ConfigInt(json, "out_channels", c.out_channels, file));
  ASSIGN_OR_RETURN(c.block_out_channels, ConfigIntList(json, "block_out_channels", c.block_out_channels, file));
  ASSIGN_OR_RETURN(c.layers_per_block, ConfigInt(json, "layers_per_block", c.layers_per_block, file));
  ASSIGN_OR_RETURN(c.norm_num_groups, ConfigInt(json, "norm_num_groups", c.norm_num_groups, file));
  ASSIGN_OR_RETURN(c.scaling_factor, ConfigDouble(json, "scaling_factor", c.scaling_factor, file));
  ASSIGN_OR_RETURN(c.shift_factor, ConfigDouble(json, "shift_factor", c.shift_factor, file));
  ASSIGN_OR_RETURN(c.mid_block_add_attention,
                   ConfigBool(json, "mid_block_add_attention", c.mid_block_add_attention, file));
  ASSIGN_OR_RETURN(const bool post_quant_conv, ConfigBool(json, "use_post_quant_conv", false, file));
  if (post_quant_conv) {
    return absl::UnimplementedError(absl::StrCat(file, ": AutoencoderKL with use_post_quant_conv is not supported yet"));
  }
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const AutoencoderKLConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Size("in_channels", c.in_channels)
      .Size("latent_channels", c.latent_channels)
      .Size("out_channels", c.out_channels)
      .Size("norm_num_groups", c.norm_num_groups)
      .Range("layers_per_block", c.layers_per_block, 0, kMaxConfigLayers)
      .Range("block_out_channels (count)", static_cast<int64_t>(c.block_out_channels.size()), 1, 8)
      .Above("scaling_factor", c.scaling_factor, 0.0, 1e6)
      .Between("shift_factor", c.shift_factor, -1e6, 1e6);
  for (size_t i = 0; i < c.block_out_channels.size() && check.ok(); ++i) {
    const std::string field = absl::StrCat("block_out_channels[", i, "]");
    check.Size(field, c.block_out_channels[i])
        .MultipleOf(field, c.block_out_channels[i], "norm_num_groups", c.norm_num_groups);
  }
  RETURN_IF_ERROR(check.status());
  // Conv 3×3 weights dominate; norms and biases are counted generously.
  const std::vector<int64_t>& boc = c.block_out_channels;
  const int64_t top = boc.back();
  auto resnet = [](ParameterCount& p, int64_t in, int64_t out) {
    p.Add({9, in + out, out});
    p.Add({in + 1, out});  // Shortcut and biases.
    p.Add({4, in + out});  // Norms.
  };
  ParameterCount total;
  total.Add({9 * c.latent_channels + 1, top});
  resnet(total, top, top);
  resnet(total, top, top);
  if (c.mid_block_add_attention) total.Add({4, top + 1, top + 2});
  for (size_t i = 0; i < boc.size(); ++i) {
    const int64_t out = boc[boc.size() - 1 - i];
    const int64_t in = i == 0 ? top : boc[boc.size() - i];
    for (int64_t layer = 0; layer <= c.layers_per_block; ++layer) resnet(total, layer == 0 ? in : out, out);
    total.Add({9 * out + 1, out});  // Upsampler (the last block has none; over-counted).
  }
  total.Add({9 * boc.front() + 1, c.out_channels + 2});
  // The encoder mirrors the decoder with one resnet fewer per block; counted as much again.
  total.Add({9 * c.in_channels + 1, boc.front()});
  total.Add({9 * top + 1, 2 * c.latent_channels});
  total.Add({2 * c.latent_channels + 1, 2 * c.latent_channels});
  ParameterCount twice;
  twice.AddTimes(2, total);
  return twice.Check(file);
}

VaeAttention::VaeAttention(int64_t channels, int64_t groups, const LayerOptions& o) : Module("Attention") {
  group_norm_ = AddChild("group_norm", std::make_unique<GroupNorm>(groups, channels, 1e-6, o));
  to_q_ = AddChild("to_q", std::make_unique<Linear>(channels, channels, true, o));
  to_k_ = AddChild("to_k", std::make_unique<Linear>(channels, channels, true, o));
  to_v_ = AddChild("to_v", std::make_unique<Linear>(channels, channels, true, o));
  auto* out = AddChild("to_out", std::make_unique<ModuleList<Linear>>());
  to_out_ = out->Append(std::make_unique<Linear>(channels, channels, true, o));
}

at::Tensor VaeAttention::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  const int64_t b = x.size(0), c = x.size(1), h = x.size(2), w = x.size(3);
  const at::Tensor tokens = group_norm_->Forward(x).view({b, c, h * w}).transpose(1, 2);  // [B, HW, C]
  const at::Tensor q = to_q_->Forward(tokens).unsqueeze(1);
  const at::Tensor k = to_k_->Forward(tokens).unsqueeze(1);
  const at::Tensor v = to_v_->Forward(tokens).unsqueeze(1);
  const at::Tensor o = ScaledDotProductAttention(q, k, v, at::Tensor()).squeeze(1).to(x.scalar_type());
  return to_out_->Forward(o).transpose(1, 2).reshape({b, c, h, w}) + x;
}

VaeMidBlock::VaeMidBlock(int64_t channels, int64_t groups, bool attention, const LayerOptions& o)
    : Module("UNetMidBlock2D") {
  auto* resnets = AddChild("resnets", std::make_unique<ModuleList<ResnetBlock2D>>());
  resnet0_ = resnets->Append(std::make_unique<ResnetBlock2D>(channels, channels, groups, o));
  resnet1_ = resnets->Append(std::make_unique<ResnetBlock2D>(channels, channels, groups, o));
  if (attention) {
    attention_ = AddChild("attentions", std::make_unique<ModuleList<VaeAttention>>())
                     ->Append(std::make_unique<VaeAttention>(channels, groups, o));
  }
}

at::Tensor VaeMidBlock::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  at::Tensor h = resnet0_->Forward(x);
  if (attention_ != nullptr) h = attention_->Forward(h);
  return resnet1_->Forward(h);
}

VaeUpDecoderBlock::VaeUpDecoderBlock(int64_t in, int64_t out, int64_t layers, bool upsample, int64_t groups,
                                     const LayerOptions& o)
    : Module("UpDecoderBlock2D") {
  resnets_ = AddChild("resnets", std::make_unique<ModuleList<ResnetBlock2D>>());
  for (int64_t i = 0; i < layers; ++i) resnets_->Append(std::make_unique<ResnetBlock2D>(i == 0 ? in : out, out, groups, o));
  if (upsample) {
    auto* ups = AddChild("upsamplers", std::make_unique<ModuleList<Container>>());
    upsample_conv_ = ups->Append(std::make_unique<Container>("Upsample2D"))
                         ->AddChild("conv", std::make_unique<Conv2d>(out, out, 3, 1, 1, o));
  }
}

at::Tensor VaeUpDecoderBlock::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  at::Tensor h = x;
  for (ResnetBlock2D* r : *resnets_) h = r->Forward(h);
  if (upsample_conv_ != nullptr) {
    h = upsample_conv_->Forward(at::upsample_nearest2d(h, {h.size(2) * 2, h.size(3) * 2}));
  }
  return h;
}

AutoencoderKLDecoder::AutoencoderKLDecoder(const AutoencoderKLConfig& c, const LayerOptions& o)
    : Module("AutoencoderKL"), config_(c) {
  auto* decoder = AddChild("decoder", std::make_unique<Container>("Decoder"));
  const std::vector<int64_t>& boc = c.block_out_channels;
  const int64_t top = boc.back();
  const int64_t g = c.norm_num_groups;
  conv_in_ = decoder->AddChild("conv_in", std::make_unique<Conv2d>(c.latent_channels, top, 3, 1, 1, o));
  mid_block_ = decoder->AddChild("mid_block", std::make_unique<VaeMidBlock>(top, g, c.mid_block_add_attention, o));
  up_blocks_ = decoder->AddChild("up_blocks", std::make_unique<ModuleList<VaeUpDecoderBlock>>());
  const std::vector<int64_t> rev(boc.rbegin(), boc.rend());
  for (size_t i = 0; i < rev.size(); ++i) {
    const int64_t in = i == 0 ? rev[0] : rev[i - 1];
    up_blocks_->Append(std::make_unique<VaeUpDecoderBlock>(in, rev[i], c.layers_per_block + 1,
                                                           i + 1 < rev.size(), g, o));
  }
  conv_norm_out_ = decoder->AddChild("conv_norm_out", std::make_unique<GroupNorm>(g, boc.front(), 1e-6, o));
  conv_out_ = decoder->AddChild("conv_out", std::make_unique<Conv2d>(boc.front(), c.out_channels, 3, 1, 1, o));
}

at::Tensor AutoencoderKLDecoder::Decode(const at::Tensor& latents) {
  ForwardScope scope(*this);
  const at::Tensor z = latents / config_.scaling_factor + config_.shift_factor;
  at::Tensor h = mid_block_->Forward(conv_in_->Forward(z));
  for (VaeUpDecoderBlock* up : *up_blocks_) h = up->Forward(h);
  return conv_out_->Forward(at::silu(conv_norm_out_->Forward(h)));
}

VaeDownEncoderBlock::VaeDownEncoderBlock(int64_t in, int64_t out, int64_t layers, bool downsample, int64_t groups,
                                         const LayerOptions& o)
    : Module("DownEncoderBlock2D") {
  resnets_ = AddChild("resnets", std::make_unique<ModuleList<ResnetBlock2D>>());
  for (int64_t i = 0; i < layers; ++i) resnets_->Append(std::make_unique<ResnetBlock2D>(i == 0 ? in : out, out, groups, o));
  if (downsample) {
    auto* downs = AddChild("downsamplers", std::make_unique<ModuleList<Container>>());
    downsample_conv_ = downs->Append(std::make_unique<Container>("Downsample2D"))
                           ->AddChild("conv", std::make_unique<Conv2d>(out, out, 3, 2, 0, o));
  }
}

at::Tensor VaeDownEncoderBlock::Forward(const at::Tensor& x) {
  ForwardScope scope(*this);
  at::Tensor h = x;
  for (ResnetBlock2D* r : *resnets_) h = r->Forward(h);
  if (downsample_conv_ != nullptr) h = downsample_conv_->Forward(at::constant_pad_nd(h, {0, 1, 0, 1}, 0));
  return h;
}

AutoencoderKLEncoder::AutoencoderKLEncoder(const AutoencoderKLConfig& c, const LayerOptions& o)
    : Module("AutoencoderKL"), config_(c) {
  auto* encoder = AddChild("encoder", std::make_unique<Container>("Encoder"));
  const std::vector<int64_t>& boc = c.block_out_channels;
  const int64_t top = boc.back();
  const int64_t g = c.norm_num_groups;
  conv_in_ = encoder->AddChild("conv_in", std::make_unique<Conv2d>(c.in_channels, boc.front(), 3, 1, 1, o));
  down_blocks_ = encoder->AddChild("down_blocks", std::make_unique<ModuleList<VaeDownEncoderBlock>>());
  for (size_t i = 0; i < boc.size(); ++i) {
    const int64_t in = i == 0 ? boc.front() : boc[i - 1];
    down_blocks_->Append(std::make_unique<VaeDownEncoderBlock>(in, boc[i], c.layers_per_block, i + 1 < boc.size(), g, o));
  }
  mid_block_ = encoder->AddChild("mid_block", std::make_unique<VaeMidBlock>(top, g, c.mid_block_add_attention, o));
  conv_norm_out_ = encoder->AddChild("conv_norm_out", std::make_unique<GroupNorm>(g, top, 1e-6, o));
  conv_out_ = encoder->AddChild("conv_out", std::make_unique<Conv2d>(top, 2 * c.latent_channels, 3, 1, 1, o));
  if (c.use_quant_conv) {
    quant_conv_ = AddChild("quant_conv", std::make_unique<Conv2d>(2 * c.latent_channels, 2 * c.latent_channels, 1, 1, 0, o));
  }
}

at::Tensor AutoencoderKLEncoder::Moments(const at::Tensor& pixels) {
  ForwardScope scope(*this);
  at::Tensor h = conv_in_->Forward(pixels);
  for (VaeDownEncoderBlock* down : *down_blocks_) h = down->Forward(h);
  h = mid_block_->Forward(h);
  h = conv_out_->Forward(at::silu(conv_norm_out_->Forward(h)));
  if (quant_conv_ != nullptr) h = quant_conv_->Forward(h);
  return h;
}

at::Tensor AutoencoderKLEncoder::SampleLatents(const at::Tensor& pixels, at::Generator& generator) {
  const std::vector<at::Tensor> parts = Moments(pixels).to(at::kFloat).chunk(2, 1);
  const at::Tensor mean = parts[0];
  const at::Tensor std = at::exp(0.5 * at::clamp(parts[1], -30.0, 20.0));
  const at::Tensor eps = at::randn(mean.sizes(), generator, at::TensorOptions().dtype(at::kFloat)).to(mean.device());
  return (mean + std * eps - config_.shift_factor) * config_.scaling_factor;
}

std::vector<std::string> VaeDecoderIgnoredPrefixes() { return {"encoder.", "quant_conv.", "post_quant_conv."}; }
std::vector<std::string> VaeEncoderIgnoredPrefixes(const AutoencoderKLConfig& config) {
  std::vector<std::string> ignored = {"decoder.", "post_quant_conv."};
  if (!config.use_quant_conv) ignored.push_back("quant_conv.");
  return ignored;
}

}  // namespace stowage
