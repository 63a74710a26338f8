// StepGraphs (models/core/step_graphs.h): everywhere, a forward that graphs cannot serve runs its
// body as it is; on a CUDA host (the GPU suite), the Z-Image and Flux transformers' forwards served
// by captured graphs equal their eager forwards step after step (new inputs each step), the weights
// moving makes the next forward capture again, and hooks or active adapters keep forwards eager.
#include "models/core/step_graphs.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/core/fused_ops.h"
#include "models/core/layers.h"
#include "models/core/lora.h"
#include "models/core/weight_init.h"
#include "models/nets/flux_latents.h"
#include "models/nets/flux_transformer.h"
#include "models/nets/zimage_transformer.h"
#include "offload/device_backend.h"
#include "offload/host_weights.h"
#include "tests/models/tiny_transformers.h"

namespace stowage {
namespace {

double RelL2(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kCPU).to(at::kDouble), w = want.to(at::kCPU).to(at::kDouble);
  return (g - w).norm().item<double>() / std::max(w.norm().item<double>(), 1e-30);
}

class GraphSwitch {
 public:
  explicit GraphSwitch(bool enabled) : saved_(CudaGraphsEnabled()) { SetCudaGraphsEnabled(enabled); }
  ~GraphSwitch() { SetCudaGraphsEnabled(saved_); }

 private:
  bool saved_;
};

TEST(StepGraphsTest, AForwardGraphsCannotServeRunsItsBody) {
  c10::InferenceMode mode;
  Linear linear(8, 8, true, LayerOptions{at::kFloat});
  linear.ForEachSlot([](Module&, TensorSlot& slot) { slot.value.normal_(); });
  StepGraphs graphs("test");
  const at::Tensor x = at::randn({3, 8});
  int calls = 0;
  for (int i = 0; i < 3; ++i) {  // Off CUDA (CPU inputs): never captured, always the body.
    const std::vector<at::Tensor> out = graphs.Run(linear, {x}, [&](const std::vector<at::Tensor>& in) {
      ++calls;
      return std::vector<at::Tensor>{linear.Forward(in[0])};
    });
    ASSERT_EQ(out.size(), 1u);
    EXPECT_TRUE(at::equal(out[0], linear.Forward(x)));
  }
  EXPECT_EQ(calls, 3);
  EXPECT_EQ(graphs.stats().eager, 3);
  EXPECT_EQ(graphs.stats().captures, 0);
  EXPECT_EQ(graphs.Release(), 0);
}

// --- CUDA ---------------------------------------------------------------------------------------

class StepGraphsCudaTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fused::Compiled() || !at::hasCUDA()) GTEST_SKIP() << "CUDA graphs need a CUDA build and a GPU";
    fused::SetEnabled(true);
    SetCudaGraphsEnabled(true);
    at::manual_seed(20261203);
    auto cuda = CreateCudaBackend(0);
    ASSERT_TRUE(cuda.ok()) << cuda.status();
    backend_ = *std::move(cuda);
  }
  void Onload(Module& model) {
    auto captured = HostWeights::Capture(model);
    ASSERT_TRUE(captured.ok()) << captured.status();
    weights_ = *std::move(captured);
    ASSERT_TRUE(weights_->OnloadAll(*backend_).ok());
  }
  std::unique_ptr<DeviceBackend> backend_;
  std::unique_ptr<HostWeights> weights_;
};

class NoopHook : public ModuleHook {};

TEST_F(StepGraphsCudaTest, ZImageStepsThroughGraphsEqualEagerSteps) {
  ZImageTransformer model(TinyZImageTransformerConfig(), LayerOptions{at::kBFloat16});
  InitializeRandomWeights(model, 3);
  Onload(model);
  c10::InferenceMode mode;
  const at::TensorOptions o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  // Two caption lengths (padded to 64 and 96 tokens: two shapes, two graphs sharing one pool),
  // alternating; every step draws new latents, a new caption and a new time.
  auto step = [&](int i) {
    const at::Tensor latents = at::randn({16, 1, 32, 32}, o);
    const at::Tensor caption = at::randn({i % 2 == 0 ? 40 : 70, 64}, o);
    const double t = 0.05 * (i + 1);
    at::Tensor eager;
    {
      GraphSwitch off(false);
      eager = model.Forward(latents, t, caption);
    }
    const at::Tensor graphed = model.Forward(latents, t, caption);
    std::printf("zimage step %d: rel_l2 %.3g, identical %d\n", i, RelL2(graphed, eager), at::equal(graphed, eager) ? 1 : 0);
    EXPECT_LT(RelL2(graphed, eager), 1e-3) << "step " << i;
  };
  for (int i = 0; i < 8; ++i) step(i);
  StepGraphStats s = model.graph_stats();
  EXPECT_EQ(s.captures, 2) << "one graph per caption length";
  EXPECT_EQ(s.replays, 6) << "each shape's first forward warms up eagerly; the rest replay";
  EXPECT_GT(s.held_bytes, 0);

  // The weights move (the old copies kept alive, so the new ones must land elsewhere), with no
  // release: the changed addresses alone make the next forwards capture again.
  std::vector<at::Tensor> old_weights;
  model.ForEachSlot([&](Module&, TensorSlot& slot) { old_weights.push_back(slot.value); });
  const void* old_address = old_weights.front().data_ptr();
  weights_->OffloadAll();
  ASSERT_TRUE(weights_->OnloadAll(*backend_).ok());
  const void* new_address = nullptr;
  model.ForEachSlot([&](Module&, TensorSlot& slot) {
    if (new_address == nullptr) new_address = slot.value.data_ptr();
  });
  ASSERT_NE(old_address, new_address);
  for (int i = 8; i < 12; ++i) step(i);
  s = model.graph_stats();
  EXPECT_EQ(s.captures, 4);
  EXPECT_EQ(s.failures, 0);
  old_weights.clear();
  EXPECT_GT(model.ReleaseDeviceCaches(), 0);
  EXPECT_EQ(model.graph_stats().held_bytes, 0);

  // A hook (as group offloading adds) keeps the forward eager; so do active adapters.
  const int64_t eager_before = model.graph_stats().eager;
  ASSERT_TRUE(model.AddHook("test", std::make_shared<NoopHook>()).ok());
  step(12);
  EXPECT_TRUE(model.RemoveHook("test"));
  LoraScales scales = {{"style", 0.5f}};
  {
    ScopedLoras loras(&scales);
    step(13);
  }
  // Each of those steps ran two eager forwards: the switched-off reference and the one kept eager.
  EXPECT_EQ(model.graph_stats().eager, eager_before + 4);
  EXPECT_EQ(model.graph_stats().captures, 4);
}

TEST_F(StepGraphsCudaTest, FluxStepsThroughGraphsEqualEagerSteps) {
  FluxTransformer model(TinyFluxTransformerConfig(), LayerOptions{at::kBFloat16});
  InitializeRandomWeights(model, 5);
  Onload(model);
  c10::InferenceMode mode;
  const at::TensorOptions o = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor text = at::randn({1, 40, 96}, o), pooled = at::randn({1, 32}, o);
  const at::Tensor guidance = at::full({1}, 3.5, o);
  const at::Tensor img_ids = LatentImageIds(32, 32).to(at::kCUDA);
  const at::Tensor txt_ids = at::zeros({40, 3}, img_ids.options());
  for (int i = 0; i < 4; ++i) {
    const at::Tensor hidden = at::randn({1, 256, 64}, o);
    const at::Tensor t = at::full({1}, 0.2 * (i + 1), o);
    at::Tensor eager;
    {
      GraphSwitch off(false);
      eager = model.Forward(hidden, text, pooled, t, img_ids, txt_ids, guidance);
    }
    const at::Tensor graphed = model.Forward(hidden, text, pooled, t, img_ids, txt_ids, guidance);
    std::printf("flux step %d: rel_l2 %.3g, identical %d\n", i, RelL2(graphed, eager), at::equal(graphed, eager) ? 1 : 0);
    EXPECT_LT(RelL2(graphed, eager), 1e-3) << "step " << i;
  }
  EXPECT_EQ(model.graph_stats().captures, 1);
  EXPECT_EQ(model.graph_stats().replays, 3);
}

}  // namespace
}  // namespace stowage
