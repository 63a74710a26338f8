// LoRA adapters on Linear layers (models/core/lora.h): unmerged deltas equal the merged weight's
// output, only active adapters with non-zero scales count, every forward path of Linear applies
// them, and the PEFT / diffusers file layout is read with its errors named.
#include "models/core/lora.h"

#include <cstdio>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/core/fused_ops.h"
#include "models/core/layers.h"
#include "offload/safetensors.h"

namespace stowage {
namespace {

LoraWeights Random(int64_t in, int64_t out, int64_t rank, float alpha, uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  LoraWeights w;
  w.down = at::randn({rank, in}, gen);
  w.up = at::randn({out, rank}, gen);
  w.factor = alpha / static_cast<float>(rank);
  return w;
}

std::unique_ptr<Linear> Layer(int64_t in, int64_t out) {
  auto layer = std::make_unique<Linear>(in, out, true, LayerOptions{});
  at::Generator gen = at::detail::createCPUGenerator(3);
  for (TensorSlot& slot : layer->slots()) slot.value = at::randn(slot.value.sizes(), gen);
  return layer;
}

TEST(LoraTest, AnActiveAdapterEqualsTheMergedWeightAndAnInactiveOneChangesNothing) {
  auto layer = Layer(16, 12);
  const LoraWeights a = Random(16, 12, 4, 8.0f, 1);
  const LoraWeights b = Random(16, 12, 2, 0.0f, 2);
  ASSERT_TRUE(layer->AttachLora("a", a).ok());
  ASSERT_TRUE(layer->AttachLora("b", b).ok());
  const at::Tensor x = at::randn({3, 5, 16}, at::detail::createCPUGenerator(9));
  const at::Tensor base = layer->Forward(x);  // Nothing active on this thread.
  const at::Tensor& w = layer->slots()[0].value;
  const at::Tensor& bias = layer->slots()[1].value;
  {
    const LoraScales scales = {{"a", 0.5f}, {"b", 0.0f}};
    ScopedLoras scoped(&scales);
    const at::Tensor merged = w + 0.5 * a.factor * at::mm(a.up, a.down);
    EXPECT_TRUE(at::allclose(layer->Forward(x), at::linear(x, merged, bias), 1e-4, 1e-4));
    EXPECT_TRUE(at::allclose(layer->ForwardGelu(x), at::gelu(at::linear(x, merged, bias), "tanh"), 1e-4, 1e-4));
    EXPECT_TRUE(at::allclose(layer->ForwardConcat({x.narrow(-1, 0, 10), x.narrow(-1, 10, 6)}),
                             at::linear(x, merged, bias), 1e-4, 1e-4));
    {
      const LoraScales both = {{"a", 0.5f}, {"b", -2.0f}, {"not attached", 3.0f}};
      ScopedLoras inner(&both);
      const at::Tensor merged2 = merged - 2.0 * b.factor * at::mm(b.up, b.down);
      EXPECT_TRUE(at::allclose(layer->Forward(x), at::linear(x, merged2, bias), 1e-4, 1e-4));
    }
    EXPECT_TRUE(at::allclose(layer->Forward(x), at::linear(x, merged, bias), 1e-4, 1e-4)) << "scope not restored";
  }
  EXPECT_TRUE(at::equal(layer->Forward(x), base));
  ASSERT_TRUE(layer->DetachLora("a"));
  EXPECT_FALSE(layer->DetachLora("a"));
  const LoraScales scales = {{"a", 1.0f}};
  ScopedLoras scoped(&scales);
  EXPECT_TRUE(at::equal(layer->Forward(x), base)) << "a detached adapter still applies";
}

// Per-row adapters (a batch mixing requests): each row gets exactly what it gets alone — bit for
// bit in float32 and bf16 for rows with up to two adapters; a flattened input spreads each row over
// its block; an input of one row computed for the whole batch becomes one row per batch row; rows
// with the same adapters take the uniform path; ScopedLoraRow selects one row; a shape that fits
// no rule is refused.
TEST(LoraTest, PerRowAdaptersGiveEachRowWhatItGetsAlone) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto layer = Layer(16, 12);
    for (TensorSlot& slot : layer->slots()) slot.value = slot.value.to(dtype);
    LoraWeights a = Random(16, 12, 4, 8.0f, 1), b = Random(16, 12, 2, 0.0f, 2);
    for (LoraWeights* w : {&a, &b}) {
      w->down = w->down.to(dtype);
      w->up = w->up.to(dtype);
    }
    ASSERT_TRUE(layer->AttachLora("a", a).ok());
    ASSERT_TRUE(layer->AttachLora("b", b).ok());
    const LoraScales only_a = {{"a", 0.5f}}, b_then_a = {{"b", -2.0f}, {"a", 1.5f}}, none = {};
    const LoraRows rows = {&only_a, &b_then_a, &none};
    const at::Tensor x = at::randn({3, 5, 16}, at::detail::createCPUGenerator(9)).to(dtype);
    auto alone = [&](const LoraScales& scales, const at::Tensor& xi) {
      ScopedLoras scoped(&scales);
      return layer->Forward(xi);
    };
    at::Tensor mixed, flat, shared, selected;
    {
      ScopedLoraRows scoped(&rows);
      EXPECT_EQ(ActiveLoras(), nullptr);
      ASSERT_NE(ActiveLoraRows(), nullptr);
      EXPECT_TRUE(AnyLoraActive(layer->loras()));
      mixed = layer->Forward(x);
      flat = layer->Forward(x.reshape({15, 16}));
      shared = layer->Forward(x.narrow(0, 0, 1));
      {
        ScopedLoraRow row(1);
        EXPECT_EQ(ActiveLoras(), &b_then_a);
        selected = layer->Forward(x.narrow(0, 0, 1));
      }
      EXPECT_NE(ActiveLoraRows(), nullptr) << "row scope not restored";
      EXPECT_THROW(layer->Forward(x.reshape({5, 3, 16})), c10::Error);  // 5 rows in a batch of 3.
    }
    EXPECT_EQ(ActiveLoraRows(), nullptr);
    for (int64_t r = 0; r < 3; ++r) {
      const at::Tensor want = alone(*rows[static_cast<size_t>(r)], x.narrow(0, r, 1));
      EXPECT_TRUE(at::equal(mixed.narrow(0, r, 1), want)) << c10::toString(dtype) << " row " << r;
      EXPECT_TRUE(at::equal(flat.narrow(0, 5 * r, 5), want.view({5, 12}))) << c10::toString(dtype) << " row " << r;
      EXPECT_TRUE(at::equal(shared.narrow(0, r, 1), alone(*rows[static_cast<size_t>(r)], x.narrow(0, 0, 1))))
          << c10::toString(dtype) << " row " << r;
    }
    EXPECT_TRUE(at::equal(selected, alone(b_then_a, x.narrow(0, 0, 1))));
    // The same adapters in every row: the uniform path.
    const LoraRows same = {&only_a, &only_a};
    ScopedLoraRows scoped(&same);
    EXPECT_EQ(ActiveLoras(), &only_a);
    EXPECT_EQ(ActiveLoraRows(), nullptr);
  }
}

// The packed per-row path (two products a layer for every adapter a batch uses; what CUDA runs)
// against the one-at-a-time path: each row within rounding (it scales before the up-projection), a
// row without adapters exactly its base output; the concatenation is rebuilt when the batch's set of
// adapters changes or one is detached.
TEST(LoraTest, PackedPerRowAdaptersMatchTheOneAtATimePath) {
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16}) {
    auto layer = Layer(16, 12);
    for (TensorSlot& slot : layer->slots()) slot.value = slot.value.to(dtype);
    LoraWeights a = Random(16, 12, 4, 8.0f, 1), b = Random(16, 12, 2, 0.0f, 2), c = Random(16, 12, 3, 3.0f, 4);
    for (LoraWeights* w : {&a, &b, &c}) {
      w->down = w->down.to(dtype);
      w->up = w->up.to(dtype);
    }
    ASSERT_TRUE(layer->AttachLora("a", a).ok());
    ASSERT_TRUE(layer->AttachLora("b", b).ok());
    ASSERT_TRUE(layer->AttachLora("c", c).ok());
    const LoraScales only_a = {{"a", 0.5f}}, b_then_a = {{"b", -2.0f}, {"a", 1.5f}}, none = {}, only_c = {{"c", 1.0f}};
    const at::Tensor x = at::randn({3, 5, 16}, at::detail::createCPUGenerator(9)).to(dtype);
    // Relative L2 against the one-at-a-time path: float32 rounding, or bf16's (a few ulps of outputs
    // around 30 here).
    const double tolerance = dtype == at::kFloat ? 1e-6 : 1e-2;
    auto close = [&](const at::Tensor& got, const at::Tensor& want) {
      const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
      return (g - w).norm().item<double>() <= tolerance * w.norm().item<double>();
    };
    for (const LoraRows& rows : {LoraRows{&only_a, &b_then_a, &none}, LoraRows{&only_c, &none, &only_a}}) {
      at::Tensor reference, packed, flat, shared;
      {
        ScopedLoraRows scoped(&rows);
        reference = layer->Forward(x);
        SetPackedLoraEverywhere(true);
        packed = layer->Forward(x);
        flat = layer->Forward(x.reshape({15, 16}));
        shared = layer->Forward(x.narrow(0, 0, 1));
        SetPackedLoraEverywhere(false);
      }
      EXPECT_TRUE(close(packed, reference)) << c10::toString(dtype) << " max diff "
                                            << (packed - reference).abs().max().item<double>();
      EXPECT_TRUE(at::equal(flat.view({3, 5, 12}), packed));
      for (int64_t r = 0; r < 3; ++r) {
        if (rows[static_cast<size_t>(r)]->empty()) {
          EXPECT_TRUE(at::equal(packed.narrow(0, r, 1), reference.narrow(0, r, 1))) << "row without adapters";
        }
        ScopedLoras alone(rows[static_cast<size_t>(r)]);
        EXPECT_TRUE(close(shared.narrow(0, r, 1), layer->Forward(x.narrow(0, 0, 1)))) << c10::toString(dtype);
      }
    }
    // The uniform path's fast form (every row the same adapters: the up-projection accumulates into
    // the output, the scale on the float32 accumulator) within the same rounding.
    for (const LoraScales* uniform : {&b_then_a, &only_c}) {
      ScopedLoras scoped(uniform);
      const at::Tensor reference = layer->Forward(x);
      SetPackedLoraEverywhere(true);
      const at::Tensor fast = layer->Forward(x);
      SetPackedLoraEverywhere(false);
      EXPECT_TRUE(close(fast, reference)) << c10::toString(dtype) << " uniform, max diff "
                                          << (fast - reference).abs().max().item<double>();
    }
    // Detaching rebuilds the concatenation: the rows now see only what is attached.
    ASSERT_TRUE(layer->DetachLora("b"));
    const LoraRows rows = {&only_a, &b_then_a};
    ScopedLoraRows scoped(&rows);
    const at::Tensor reference = layer->Forward(x.narrow(0, 0, 2));
    SetPackedLoraEverywhere(true);
    const at::Tensor packed = layer->Forward(x.narrow(0, 0, 2));
    SetPackedLoraEverywhere(false);
    EXPECT_TRUE(close(packed, reference)) << c10::toString(dtype);
  }
}

TEST(LoraTest, SharedForwardAppliesEachLayersOwnAdapter) {
  auto q = Layer(8, 8), k = Layer(8, 8);
  const LoraWeights a = Random(8, 8, 2, 2.0f, 4);
  ASSERT_TRUE(k->AttachLora("a", a).ok());
  const at::Tensor x = at::randn({2, 8}, at::detail::createCPUGenerator(5));
  const LoraScales scales = {{"a", 1.0f}};
  ScopedLoras scoped(&scales);
  const std::vector<at::Tensor> out = Linear::ForwardShared({q.get(), k.get()}, x);
  EXPECT_TRUE(at::allclose(out[0], at::linear(x, q->slots()[0].value, q->slots()[1].value)));
  const at::Tensor merged = k->slots()[0].value + a.factor * at::mm(a.up, a.down);
  EXPECT_TRUE(at::allclose(out[1], at::linear(x, merged, k->slots()[1].value), 1e-4, 1e-4));
}

// On a CUDA device the layer's fused paths (one GEMM for shared Q/K/V, the GELU epilogue, the
// concatenated-parts GEMMs) and FP8 GEMMs are in play: an active adapter must still add exactly its
// delta there. Compared with the plain reference (the delta computed by at::linear) in float32;
// for FP8 layers, the difference the adapter makes. Skipped without CUDA (CI's LibTorch).
TEST(LoraTest, OnCudaEveryFusedAndFp8PathAddsTheDelta) {
  if (!fused::Compiled() || !at::hasCUDA()) GTEST_SKIP() << "needs the CUDA build and a GPU";
  const at::Device cuda(at::kCUDA, 0);
  auto on_cuda = [&](std::unique_ptr<Linear> layer) {
    for (TensorSlot& slot : layer->slots()) slot.value = slot.value.to(cuda);
    return layer;
  };
  auto q = on_cuda(Layer(64, 64)), k = on_cuda(Layer(64, 64)), g = on_cuda(Layer(64, 96));
  LoraWeights a = Random(64, 64, 4, 8.0f, 11);
  LoraWeights b = Random(64, 96, 4, 8.0f, 12);
  auto delta = [](const LoraWeights& w, const at::Tensor& x) {
    return at::linear(at::linear(x, w.down.to(x.device())), w.up.to(x.device())) * static_cast<double>(w.factor);
  };
  ASSERT_TRUE(k->AttachLora("a", LoraWeights{a.down.to(cuda), a.up.to(cuda), a.factor}).ok());
  ASSERT_TRUE(g->AttachLora("b", LoraWeights{b.down.to(cuda), b.up.to(cuda), b.factor}).ok());
  const at::Tensor x = at::randn({2, 7, 64}, at::detail::createCPUGenerator(13)).to(cuda);
  const LoraScales scales = {{"a", 1.0f}, {"b", 1.0f}};
  auto close = [](const at::Tensor& got, const at::Tensor& want) {
    return at::allclose(got.cpu(), want.cpu(), 2e-3, 2e-3);
  };
  at::Tensor base_k, base_g;
  {
    base_k = k->Forward(x);
    base_g = g->Forward(x);
    const ScopedLoras active(&scales);
    const std::vector<at::Tensor> shared = Linear::ForwardShared({q.get(), k.get()}, x);
    EXPECT_TRUE(close(shared[0], q->Forward(x)));
    EXPECT_TRUE(close(shared[1], base_k + delta(a, x))) << "shared Q/K";
    EXPECT_TRUE(close(g->ForwardGelu(x), at::gelu(base_g + delta(b, x), "tanh"))) << "GELU epilogue";
    EXPECT_TRUE(close(g->ForwardConcat({x.narrow(-1, 0, 40), x.narrow(-1, 40, 24)}), base_g + delta(b, x)))
        << "concatenated parts";
  }
  if (!fused::Fp8Supported(cuda).ok()) GTEST_SKIP() << "no FP8 GEMMs on this device";
  // FP8 layers run in bfloat16, as the pipelines run them: the delta within bfloat16's precision.
  auto f = Layer(64, 96);
  for (TensorSlot& slot : f->slots()) slot.value = slot.value.to(cuda, at::kBFloat16);
  ASSERT_TRUE(f->AttachLora("b", LoraWeights{b.down.to(cuda, at::kBFloat16), b.up.to(cuda, at::kBFloat16), b.factor}).ok());
  ASSERT_TRUE(f->ConvertToFp8().ok());
  const at::Tensor xb = x.to(at::kBFloat16);
  const at::Tensor fp8_base = f->Forward(xb).to(at::kFloat);
  const ScopedLoras active(&scales);
  const at::Tensor got = (f->Forward(xb).to(at::kFloat) - fp8_base).cpu();
  const at::Tensor want = delta(b, xb.to(at::kFloat)).cpu();
  EXPECT_LT(((got - want).norm() / want.norm()).item<double>(), 2e-2) << "FP8 GEMM";
}

TEST(LoraTest, AttachRefusesMatricesOfTheWrongShape) {
  auto layer = Layer(16, 12);
  const absl::Status status = layer->AttachLora("a", Random(15, 12, 4, 0, 1));
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(status.message().find("A [rank, 16]"), std::string::npos) << status.message();
}

std::string Write(const std::string& name, const std::vector<std::pair<std::string, at::Tensor>>& tensors) {
  const std::string path = std::string(::testing::TempDir()) + "/" + name + ".safetensors";
  EXPECT_TRUE(WriteSafetensors(path, tensors).ok());
  return path;
}

TEST(LoraFileTest, ReadsThePeftAndDiffusersLayout) {
  const std::string path = Write("peft", {
      {"transformer.layers.0.attention.to_q.lora_A.weight", at::ones({4, 16})},
      {"transformer.layers.0.attention.to_q.lora_B.weight", at::ones({12, 4})},
      {"transformer.layers.0.attention.to_q.alpha", at::full({}, 8.0)},
      {"base_model.model.layers.1.ff.lora_A.weight", at::ones({2, 16}).to(at::kBFloat16)},
      {"base_model.model.layers.1.ff.lora_B.weight", at::ones({16, 2}).to(at::kBFloat16)},
      {"text_encoder.layers.0.q_proj.lora_A.weight", at::ones({2, 8})},
      {"text_encoder.layers.0.q_proj.lora_B.weight", at::ones({8, 2})},
  });
  auto file = ReadLoraFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  ASSERT_EQ(file->layers.size(), 2u);
  const auto& transformer = file->layers.at("transformer");
  ASSERT_EQ(transformer.size(), 2u);
  EXPECT_EQ(transformer.at("layers.0.attention.to_q").rank(), 4);
  EXPECT_FLOAT_EQ(transformer.at("layers.0.attention.to_q").factor, 2.0f);  // alpha 8 / rank 4.
  EXPECT_FLOAT_EQ(transformer.at("layers.1.ff").factor, 1.0f);
  EXPECT_EQ(transformer.at("layers.1.ff").down.scalar_type(), at::kFloat);
  EXPECT_EQ(file->layers.at("text_encoder").count("layers.0.q_proj"), 1u);
  EXPECT_EQ(file->rank, 4);
  // An alpha for every layer without its own (PEFT's adapter_config.json lora_alpha).
  auto with_alpha = ReadLoraFile(path, "transformer", 4.0f);
  ASSERT_TRUE(with_alpha.ok());
  EXPECT_FLOAT_EQ(with_alpha->layers.at("transformer").at("layers.1.ff").factor, 2.0f);
}

// Kohya's layout: lora_unet_ / lora_te_ prefixes, underscored paths, lora_down / lora_up, alpha per
// layer; the names are matched onto the model's Linear paths, never split by guessing.
TEST(LoraFileTest, ReadsKohyasLayoutAndMatchesItsNamesOntoTheLayers) {
  const std::string path = Write("kohya", {
      {"lora_unet_layers_0_attention_to_q.lora_down.weight", at::ones({4, 16})},
      {"lora_unet_layers_0_attention_to_q.lora_up.weight", at::ones({12, 4})},
      {"lora_unet_layers_0_attention_to_q.alpha", at::full({}, 8.0)},
      {"lora_unet_noise_refiner_1_feed_forward_w1.lora_down.weight", at::ones({2, 16})},
      {"lora_unet_noise_refiner_1_feed_forward_w1.lora_up.weight", at::ones({32, 2})},
      {"lora_te_layers_0_self_attn_q_proj.lora_down.weight", at::ones({2, 8})},
      {"lora_te_layers_0_self_attn_q_proj.lora_up.weight", at::ones({8, 2})},
  });
  auto file = ReadLoraFile(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->underscored_paths);
  const std::map<std::string, std::vector<std::string>> linears = {
      {"transformer", {"layers.0.attention.to_q", "layers.0.attention.to_k", "noise_refiner.1.feed_forward.w1"}},
      {"text_encoder", {"layers.0.self_attn.q_proj"}}};
  LoraFile resolved = *file;
  ASSERT_TRUE(ResolveLayerPaths(resolved, linears).ok());
  EXPECT_FALSE(resolved.underscored_paths);
  const auto& transformer = resolved.layers.at("transformer");
  EXPECT_EQ(transformer.count("layers.0.attention.to_q"), 1u);
  EXPECT_FLOAT_EQ(transformer.at("layers.0.attention.to_q").factor, 2.0f);  // alpha 8 / rank 4.
  EXPECT_EQ(transformer.count("noise_refiner.1.feed_forward.w1"), 1u);  // Underscores inside names kept.
  EXPECT_EQ(resolved.layers.at("text_encoder").count("layers.0.self_attn.q_proj"), 1u);
  // A name that matches no layer, and one two layers would read the same, are refused naming them.
  LoraFile unmatched = *file;
  const absl::Status missing = ResolveLayerPaths(
      unmatched, {{"transformer", {"layers.0.attention.to_k", "noise_refiner.1.feed_forward.w1"}},
                  {"text_encoder", {"layers.0.self_attn.q_proj"}}});
  EXPECT_EQ(missing.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(missing.message().find("layers_0_attention_to_q' matches no Linear"), std::string::npos) << missing;
  LoraFile ambiguous = *file;
  const absl::Status clash = ResolveLayerPaths(
      ambiguous, {{"transformer", {"layers.0.attention.to_q", "layers_0.attention.to_q", "noise_refiner.1.feed_forward.w1"}},
                  {"text_encoder", {"layers.0.self_attn.q_proj"}}});
  EXPECT_EQ(clash.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(clash.message().find("could be"), std::string::npos) << clash;
  // Kohya and PEFT keys in one file: refused.
  auto mixed = ReadLoraFile(Write("mixed", {
      {"lora_unet_layers_0_attention_to_q.lora_down.weight", at::ones({4, 16})},
      {"lora_unet_layers_0_attention_to_q.lora_up.weight", at::ones({12, 4})},
      {"transformer.layers.1.ff.lora_A.weight", at::ones({2, 16})},
      {"transformer.layers.1.ff.lora_B.weight", at::ones({16, 2})},
  }));
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.status().message().find("mixes kohya keys"), std::string::npos) << mixed.status();
  // The original checkpoints' "diffusion_model." prefix is the transformer, with dotted paths.
  auto original = ReadLoraFile(Write("original", {
      {"diffusion_model.layers.0.attention.to_q.lora_A.weight", at::ones({4, 16})},
      {"diffusion_model.layers.0.attention.to_q.lora_B.weight", at::ones({12, 4})},
  }));
  ASSERT_TRUE(original.ok()) << original.status();
  EXPECT_FALSE(original->underscored_paths);
  EXPECT_EQ(original->layers.at("transformer").count("layers.0.attention.to_q"), 1u);
}

TEST(LoraFileTest, BrokenFilesAreRefusedNamingTheKey) {
  struct Case {
    std::string name;
    std::vector<std::pair<std::string, at::Tensor>> tensors;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"a_only", {{"x.lora_A.weight", at::ones({2, 4})}}, "has lora_A but no lora_B"},
      {"ranks", {{"x.lora_A.weight", at::ones({2, 4})}, {"x.lora_B.weight", at::ones({4, 3})}}, "rank 2, lora_B 3"},
      {"not_lora", {{"x.weight", at::ones({2, 4})}}, "'x.weight' is not a LoRA tensor"},
      {"ints", {{"x.lora_A.weight", at::ones({2, 4}, at::kInt)}, {"x.lora_B.weight", at::ones({4, 2})}}, "floating point"},
      {"nan", {{"x.lora_A.weight", at::full({2, 4}, NAN)}, {"x.lora_B.weight", at::ones({4, 2})}}, "NaN"},
      {"rank0", {{"x.lora_A.weight", at::ones({0, 4})}, {"x.lora_B.weight", at::ones({4, 0})}}, "rank 0"},
      {"3d", {{"x.lora_A.weight", at::ones({2, 4, 1})}, {"x.lora_B.weight", at::ones({4, 2})}}, "3 dimensions"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    auto file = ReadLoraFile(Write(c.name, c.tensors));
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(file.status().message().find(c.needle), std::string::npos) << file.status().message();
  }
  EXPECT_FALSE(ReadLoraFile("/nonexistent/lora.safetensors").ok());
}

}  // namespace
}  // namespace stowage
