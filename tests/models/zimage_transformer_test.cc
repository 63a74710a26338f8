#include "models/nets/zimage_transformer.h"

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/core/weight_init.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/host_weights.h"

namespace stowage {
namespace {

ZImageTransformerConfig Tiny() {
  ZImageTransformerConfig c;
  c.in_channels = 4;
  c.dim = 64;
  c.n_heads = 2;  // head dim 32 = 8 + 12 + 12
  c.n_layers = 2;
  c.n_refiner_layers = 1;
  c.cap_feat_dim = 48;
  c.axes_dims = {8, 12, 12};
  c.axes_lens = {128, 64, 64};
  return c;
}

std::map<std::string, std::vector<int64_t>> Shapes(Module& m) {
  std::map<std::string, std::vector<int64_t>> shapes;
  m.ForEachSlot([&](Module& owner, TensorSlot& slot) {
    shapes[owner.SlotPath(slot)] = slot.value.sizes().vec();
  });
  return shapes;
}

// The state-dict names and shapes diffusers' ZImageTransformer2DModel has for this config.
TEST(ZImageTransformerTest, ParameterNamesAndShapesMatchDiffusers) {
  ZImageTransformer model(Tiny(), LayerOptions{});
  const auto shapes = Shapes(model);
  const int64_t d = 64, ffn = 170 /* int(64 / 3 * 8) */, a = 64 /* min(dim, 256) */;
  std::map<std::string, std::vector<int64_t>> expected = {
      {"all_x_embedder.2-1.weight", {d, 16}}, {"all_x_embedder.2-1.bias", {d}},
      {"all_final_layer.2-1.linear.weight", {16, d}}, {"all_final_layer.2-1.linear.bias", {16}},
      {"all_final_layer.2-1.adaLN_modulation.1.weight", {d, a}},
      {"all_final_layer.2-1.adaLN_modulation.1.bias", {d}},
      {"t_embedder.mlp.0.weight", {1024, 256}}, {"t_embedder.mlp.0.bias", {1024}},
      {"t_embedder.mlp.2.weight", {a, 1024}}, {"t_embedder.mlp.2.bias", {a}},
      {"cap_embedder.0.weight", {48}}, {"cap_embedder.1.weight", {d, 48}}, {"cap_embedder.1.bias", {d}},
      {"x_pad_token", {1, d}}, {"cap_pad_token", {1, d}},
  };
  auto block = [&](const std::string& prefix, bool modulated) {
    for (const char* w : {"to_q", "to_k", "to_v"}) expected[prefix + "attention." + w + ".weight"] = {d, d};
    expected[prefix + "attention.to_out.0.weight"] = {d, d};
    expected[prefix + "attention.norm_q.weight"] = {32};
    expected[prefix + "attention.norm_k.weight"] = {32};
    expected[prefix + "feed_forward.w1.weight"] = {ffn, d};
    expected[prefix + "feed_forward.w2.weight"] = {d, ffn};
    expected[prefix + "feed_forward.w3.weight"] = {ffn, d};
    for (const char* n : {"attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"}) {
      expected[prefix + n + ".weight"] = {d};
    }
    if (modulated) {
      expected[prefix + "adaLN_modulation.0.weight"] = {4 * d, a};
      expected[prefix + "adaLN_modulation.0.bias"] = {4 * d};
    }
  };
  block("noise_refiner.0.", true);
  block("context_refiner.0.", false);
  block("layers.0.", true);
  block("layers.1.", true);
  EXPECT_EQ(shapes, expected);
}

TEST(ZImageTransformerTest, RopeUsesThreeAxesOfInterleavedFrequencies) {
  ZImageTransformer model(Tiny(), LayerOptions{});
  const at::Tensor pos = at::tensor(std::vector<int64_t>{5, 3, 7}).view({1, 3});
  const at::Tensor f = model.RopeFactors(pos);
  ASSERT_EQ(f.sizes(), (std::vector<int64_t>{1, 16}));
  const std::vector<std::pair<int64_t, int64_t>> axes = {{5, 8}, {3, 12}, {7, 12}};
  int64_t k = 0;
  for (const auto& [p, dim] : axes) {
    for (int64_t j = 0; j < dim / 2; ++j, ++k) {
      const double angle = static_cast<float>(p * std::pow(256.0, -2.0 * j / dim));
      EXPECT_NEAR(at::real(f[0][k]).item<double>(), std::cos(angle), 1e-6) << k;
      EXPECT_NEAR(at::imag(f[0][k]).item<double>(), std::sin(angle), 1e-6) << k;
    }
  }
  EXPECT_THROW(model.RopeFactors(at::tensor(std::vector<int64_t>{128, 0, 0}).view({1, 3})), c10::Error);
}

TEST(ZImageTransformerTest, ForwardShapesDeterminismAndGroupOffloadExactness) {
  ZImageTransformer model(Tiny(), LayerOptions{});
  InitializeRandomWeights(model, 3);
  c10::InferenceMode guard;
  const at::Tensor latents = at::randn({4, 1, 6, 10});   // 3 × 5 = 15 patches, padded to 32.
  const at::Tensor caption = at::randn({7, 48});         // Padded to 32.
  const at::Tensor a = model.Forward(latents, 0.25, caption);
  EXPECT_EQ(a.sizes(), latents.sizes());
  EXPECT_TRUE(at::equal(a, model.Forward(latents, 0.25, caption)));
  EXPECT_FALSE(at::equal(a, model.Forward(latents, 0.75, caption)));
  EXPECT_FALSE(at::equal(a, model.Forward(latents, 0.25, caption.slice(0, 0, 6))));
  EXPECT_TRUE(a.isfinite().all().item<bool>());

  auto weights = *HostWeights::Capture(model);
  auto backend = CreateSimulatedBackend({});
  GroupOffloadOptions options;
  options.use_stream = true;
  auto offloader = GroupOffloader::Apply("zimage", model, *weights, *backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  // Block lists: noise_refiner, context_refiner, layers and the cap_embedder Sequential.
  EXPECT_EQ((*offloader)->stats().streamed_groups, 1 + 1 + 2 + 2);
  for (int i = 0; i < 2; ++i) EXPECT_TRUE(at::equal(model.Forward(latents, 0.25, caption), a));
}

// Four samples whose captions pad to 32, 64, 96 and 64 tokens.
void RaggedBatch(std::vector<at::Tensor>& latents, std::vector<at::Tensor>& captions) {
  for (int64_t len : {7, 40, 70, 40}) {
    latents.push_back(at::randn({4, 1, 6, 10}));
    captions.push_back(at::randn({len, 48}));
  }
}

double RelativeError(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

// A batch gives each sample what it gets alone: captions of different padded lengths (32, 64, 96
// tokens) are masked, image positions follow each sample's own caption, one timestep for all.
TEST(ZImageTransformerTest, BatchedForwardMatchesEachSampleAlone) {
  ZImageTransformer model(Tiny(), LayerOptions{});
  InitializeRandomWeights(model, 5);
  c10::InferenceMode guard;
  std::vector<at::Tensor> latents, captions;
  RaggedBatch(latents, captions);
  const std::vector<at::Tensor> batch = model.ForwardBatch(latents, 0.4, captions);
  ASSERT_EQ(batch.size(), 4u);
  for (size_t i = 0; i < batch.size(); ++i) {
    const at::Tensor alone = model.Forward(latents[i], 0.4, captions[i]);
    EXPECT_EQ(batch[i].sizes(), alone.sizes());
    EXPECT_LT(RelativeError(batch[i], alone), 1e-5) << "sample " << i;
  }
  // Samples with equal caption lengths need no mask; a batch of one is Forward itself.
  const std::vector<at::Tensor> even = model.ForwardBatch({latents[1], latents[3]}, 0.4, {captions[1], captions[3]});
  EXPECT_LT(RelativeError(even[1], model.Forward(latents[3], 0.4, captions[3])), 1e-5);
  EXPECT_TRUE(at::equal(model.ForwardBatch({latents[2]}, 0.4, {captions[2]})[0], model.Forward(latents[2], 0.4, captions[2])));
  // Samples influence nothing but themselves: changing one leaves the others.
  std::vector<at::Tensor> changed = latents;
  changed[0] = at::randn({4, 1, 6, 10});
  const std::vector<at::Tensor> again = model.ForwardBatch(changed, 0.4, captions);
  EXPECT_GT(RelativeError(again[0], batch[0]), 1e-2);
  for (size_t i = 1; i < 4; ++i) EXPECT_LT(RelativeError(again[i], batch[i]), 1e-5) << i;
  // Mismatched shapes are refused, not broadcast.
  EXPECT_THROW(model.ForwardBatch({latents[0], at::randn({4, 1, 8, 10})}, 0.4, {captions[0], captions[1]}), c10::Error);
  EXPECT_THROW(model.ForwardBatch({latents[0]}, 0.4, {captions[0], captions[1]}), c10::Error);
}

// Streamed, a batched forward reaches each group once, in the order the forward that recorded it (the
// server's warm-up: one sample) did — no copy it waits for, one prefetch a streamed group. The
// caption embedder, itself a streamed group list, once ran per sample: its second sample reached it
// out of that order (session 39 on an H100: 2.5 waited-for copies a batched forward).
TEST(ZImageTransformerTest, AStreamedBatchedForwardReachesEachGroupOnceInTheRecordedOrder) {
  ZImageTransformer model(Tiny(), LayerOptions{});
  InitializeRandomWeights(model, 7);
  c10::InferenceMode guard;
  std::vector<at::Tensor> latents, captions;
  RaggedBatch(latents, captions);
  const std::vector<at::Tensor> resident = model.ForwardBatch(latents, 0.4, captions);
  auto weights = *HostWeights::Capture(model);
  auto backend = CreateSimulatedBackend({});
  ASSERT_TRUE(backend->supports_streams());
  GroupOffloadOptions options;
  options.use_stream = true;
  options.prefetch_depth = 4;  // 5 slots for 6 streamed groups: a skipped position shifts every slot.
  auto offloader = GroupOffloader::Apply("zimage", model, *weights, *backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  ASSERT_EQ((*offloader)->stats().streamed_groups, 6);
  for (int i = 0; i < 2; ++i) (void)model.Forward(latents[0], 0.4, captions[0]);
  const GroupOffloadStats before = (*offloader)->stats();
  for (int i = 0; i < 3; ++i) {
    const std::vector<at::Tensor> batch = model.ForwardBatch(latents, 0.4, captions);
    for (size_t k = 0; k < batch.size(); ++k) EXPECT_TRUE(at::equal(batch[k], resident[k])) << "forward " << i << " sample " << k;
  }
  const GroupOffloadStats after = (*offloader)->stats();
  EXPECT_EQ(after.forwards - before.forwards, 3);
  EXPECT_EQ(after.sync_onloads - before.sync_onloads, 0);
  EXPECT_EQ(after.prefetches - before.prefetches, 3 * 6);
}

TEST(ZImageTransformerTest, ConfigFromJsonValidates) {
  google::protobuf::Struct json;
  (*json.mutable_fields())["dim"].set_number_value(64);
  (*json.mutable_fields())["n_heads"].set_number_value(2);
  auto* axes = (*json.mutable_fields())["axes_dims"].mutable_list_value();
  for (int v : {8, 12, 12}) axes->add_values()->set_number_value(v);
  auto ok = ZImageTransformerConfigFromJson(json);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->head_dim(), 32);
  EXPECT_EQ(ok->axes_lens, (std::vector<int64_t>{1024, 512, 512}));
  (*json.mutable_fields())["n_heads"].set_number_value(4);  // head dim 16 != 32
  EXPECT_EQ(ZImageTransformerConfigFromJson(json).status().code(), absl::StatusCode::kInvalidArgument);
  (*json.mutable_fields())["n_heads"].set_number_value(2);
  (*json.mutable_fields())["siglip_feat_dim"].set_number_value(1152);
  EXPECT_EQ(ZImageTransformerConfigFromJson(json).status().code(), absl::StatusCode::kUnimplemented);
}

}  // namespace
}  // namespace stowage
