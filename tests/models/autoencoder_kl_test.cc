#include "models/nets/autoencoder_kl.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "absl/status/statusor.h"
#include "models/core/conv_lane.h"
#include "models/core/diffusers_format.h"
#include "models/core/weight_init.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/host_weights.h"

namespace stowage {
namespace {

AutoencoderKLConfig Tiny() {
  AutoencoderKLConfig c;
  c.latent_channels = 4;
  c.block_out_channels = {8, 16};
  c.layers_per_block = 1;
  c.norm_num_groups = 4;
  return c;
}

TEST(AutoencoderKLTest, DecoderNamesAndShapesMatchDiffusers) {
  AutoencoderKLDecoder vae(Tiny(), LayerOptions{});
  std::map<std::string, std::vector<int64_t>> shapes;
  vae.ForEachSlot([&](Module& m, TensorSlot& s) { shapes[m.SlotPath(s)] = s.value.sizes().vec(); });
  EXPECT_EQ(shapes.at("decoder.conv_in.weight"), (std::vector<int64_t>{16, 4, 3, 3}));
  EXPECT_EQ(shapes.at("decoder.mid_block.resnets.1.conv2.weight"), (std::vector<int64_t>{16, 16, 3, 3}));
  EXPECT_EQ(shapes.at("decoder.mid_block.attentions.0.to_out.0.weight"), (std::vector<int64_t>{16, 16}));
  EXPECT_EQ(shapes.at("decoder.mid_block.attentions.0.group_norm.bias"), (std::vector<int64_t>{16}));
  // reversed(block_out_channels) = [16, 8]: block 0 keeps 16 and upsamples; block 1 goes 16 → 8.
  EXPECT_EQ(shapes.at("decoder.up_blocks.0.upsamplers.0.conv.weight"), (std::vector<int64_t>{16, 16, 3, 3}));
  EXPECT_EQ(shapes.at("decoder.up_blocks.1.resnets.0.conv_shortcut.weight"), (std::vector<int64_t>{8, 16, 1, 1}));
  EXPECT_EQ(shapes.count("decoder.up_blocks.1.upsamplers.0.conv.weight"), 0u);
  EXPECT_EQ(shapes.at("decoder.up_blocks.1.resnets.1.conv1.weight"), (std::vector<int64_t>{8, 8, 3, 3}));
  EXPECT_EQ(shapes.at("decoder.conv_norm_out.weight"), (std::vector<int64_t>{8}));
  EXPECT_EQ(shapes.at("decoder.conv_out.weight"), (std::vector<int64_t>{3, 8, 3, 3}));
  // conv_in 2; mid resnets 2 × 8; attention 2 + 4 × 2; up block 0: 2 resnets × 8 + upsampler 2;
  // up block 1: resnet with shortcut 10 + resnet 8; conv_norm_out 2; conv_out 2.
  EXPECT_EQ(shapes.size(), 2u + 16 + 10 + 18 + 18 + 2 + 2);
}

// The tiny decoder with random weights, a latent and its image decoded plainly (what the offloading and
// lane tests compare with); OffloadUpBlocks group-offloads its up blocks on a simulated device.
class TinyDecodeTest : public ::testing::Test {
 protected:
  TinyDecodeTest() : vae_(Tiny(), LayerOptions{}) {
    InitializeRandomWeights(vae_, 4);
    c10::InferenceMode guard;
    z_ = at::randn({1, 4, 5, 6});
    image_ = vae_.Decode(z_);
  }

  // Nested blocks, named explicitly.
  absl::StatusOr<std::unique_ptr<GroupOffloader>> OffloadUpBlocks() {
    weights_ = *HostWeights::Capture(vae_);
    backend_ = CreateSimulatedBackend({});
    GroupOffloadOptions options;
    options.block_modules = {"decoder.up_blocks"};
    options.use_stream = true;
    return GroupOffloader::Apply("vae", vae_, *weights_, *backend_, options);
  }

  AutoencoderKLDecoder vae_;
  at::Tensor z_;
  at::Tensor image_;
  std::unique_ptr<HostWeights> weights_;
  std::unique_ptr<DeviceBackend> backend_;
};

TEST_F(TinyDecodeTest, DecodesAndStaysExactUnderNestedBlockOffloading) {
  c10::InferenceMode guard;
  EXPECT_EQ(image_.sizes(), (std::vector<int64_t>{1, 3, 10, 12}));
  auto offloader = OffloadUpBlocks();
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ((*offloader)->stats().streamed_groups, 2);
  EXPECT_TRUE(at::equal(vae_.Decode(z_), image_));
  EXPECT_TRUE(at::equal(vae_.Decode(z_), image_));
}

// With a convolution lane on the thread (models/core/conv_lane.h, as a device's worker has) every
// convolution of the decode runs there — the offloading hooks around them still on the caller — and
// the image is bit-identical to the decode without one.
TEST_F(TinyDecodeTest, DecodesBitIdenticallyWithItsConvolutionsOnALane) {
  c10::InferenceMode guard;
  ConvLane lane;
  ConvLane::SetForThisThread(&lane);
  const at::Tensor laned = vae_.Decode(z_);
  // conv_in; mid block 2 resnets × 2; up block 0: 2 resnets × 2 + upsampler; up block 1: resnet with
  // shortcut 3 + resnet 2; conv_out.
  const int64_t convolutions = 1 + 4 + 5 + 5 + 1;
  const int64_t after_one = lane.runs();
  auto offloader = OffloadUpBlocks();
  const at::Tensor streamed = offloader.ok() ? vae_.Decode(z_) : at::Tensor();
  ConvLane::SetForThisThread(nullptr);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  EXPECT_EQ(after_one, convolutions);
  EXPECT_EQ(lane.runs(), 2 * convolutions);
  EXPECT_TRUE(at::equal(laned, image_));
  EXPECT_TRUE(at::equal(streamed, image_));
}

TEST(AutoencoderKLTest, EncoderWeightsAreIgnoredOnlyWhenAskedTo) {
  AutoencoderKLDecoder vae(Tiny(), LayerOptions{});
  ComponentWeights weights;
  vae.ForEachSlot([&](Module& m, TensorSlot& s) {
    weights.tensors[m.SlotPath(s)] = at::zeros(s.value.sizes());
    weights.file_of[m.SlotPath(s)] = "vae.safetensors";
  });
  weights.tensors["encoder.conv_in.weight"] = at::zeros({1});
  EXPECT_FALSE(BindWeights(vae, weights, at::kFloat, "vae").ok());
  EXPECT_TRUE(BindWeights(vae, weights, at::kFloat, "vae", {"encoder."}).ok());
}

TEST(AutoencoderKLTest, ConfigFromJson) {
  google::protobuf::Struct json;
  auto* boc = (*json.mutable_fields())["block_out_channels"].mutable_list_value();
  for (int v : {128, 256, 512, 512}) boc->add_values()->set_number_value(v);
  (*json.mutable_fields())["scaling_factor"].set_number_value(0.3611);
  auto c = AutoencoderKLConfigFromJson(json);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->latent_channels, 16);
  EXPECT_DOUBLE_EQ(c->scaling_factor, 0.3611);
  (*json.mutable_fields())["use_post_quant_conv"].set_bool_value(true);
  EXPECT_EQ(AutoencoderKLConfigFromJson(json).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace stowage
