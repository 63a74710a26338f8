// An 8-bit checkpoint loaded from a diffusers-format folder: the loader dequantizes it into the
// module (the compute-dtype host copy) and hands the stored 8-bit bytes to the component; placement
// passes them to 8-bit group offloading, which then streams exactly the checkpoint's values — the
// streamed forward equals the resident one bit for bit. Quantizing the host copy again instead (the
// path without the checkpoint's bytes) is measurably not exact, which is what the hand-over is for.
#include <sys/stat.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "models/pipelines/component.h"
#include "models/core/diffusers_format.h"
#include "models/core/weight_init.h"
#include "models/nets/zimage_transformer.h"
#include "offload/compressed_safetensors.h"
#include "offload/safetensors.h"
#include "placement/placement_manager.h"

namespace stowage {
namespace {

constexpr char kFixture[] = "tests/fixtures/zimage_tiny/pipeline/transformer";

// Writes the fixture transformer as an int8 checkpoint whose scales are twice what absmax
// quantization would choose (|q| <= 64): valid by the convention, and not what quantizing the
// dequantized weights again would give.
std::string WriteInt8Checkpoint() {
  const std::string dir = std::string(::testing::TempDir()) + "/int8_transformer";
  ::mkdir(dir.c_str(), 0755);
  {
    std::ifstream in(std::string(kFixture) + "/config.json", std::ios::binary);
    std::ofstream out(dir + "/config.json", std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
  }
  absl::StatusOr<ComponentWeights> weights = ReadComponentWeights(kFixture);
  EXPECT_TRUE(weights.ok()) << weights.status();
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, t] : weights->tensors) {
    if (t.dim() >= 2 && t.is_floating_point()) {
      const at::Tensor rows = t.to(at::kFloat).flatten(1);
      const at::Tensor scale = rows.abs().amax(1).clamp_min(1e-8) / 64.0;
      const at::Tensor q = (rows / scale.unsqueeze(1)).round().clamp(-127, 127).to(at::kChar).view(t.sizes());
      tensors.emplace_back(name, q.contiguous());
      tensors.emplace_back(name + ".scale", scale.contiguous());
    } else {
      tensors.emplace_back(name, t.contiguous());
    }
  }
  EXPECT_TRUE(WriteSafetensors(dir + "/diffusion_pytorch_model.safetensors", tensors,
                               {{kCompressMetadataKey, "int8"}})
                  .ok());
  return dir;
}

TEST(QuantizedCheckpointTest, GroupOffloadStreamsTheCheckpointsOwnBytes) {
  const std::string dir = WriteInt8Checkpoint();
  absl::StatusOr<google::protobuf::Struct> json = ReadJsonFile(dir + "/config.json");
  ASSERT_TRUE(json.ok());
  absl::StatusOr<ZImageTransformerConfig> config = ZImageTransformerConfigFromJson(*json, dir);
  ASSERT_TRUE(config.ok()) << config.status();
  auto module = std::make_unique<ZImageTransformer>(*config, LayerOptions{at::kFloat});
  CheckpointQuantization quantization;
  ASSERT_TRUE(LoadComponentWeights(*module, dir, at::kFloat, {}, &quantization).ok());
  ASSERT_NE(quantization.weights, nullptr);
  EXPECT_EQ(quantization.format, CompressFormat::kInt8);
  // The host copy is the dequantized checkpoint: q × scale.
  // Not a structured binding: the lambda below captures the name (C++17 forbids that for clang).
  const std::string name = quantization.weights->begin()->first;
  const QuantizedTensor& stored = quantization.weights->begin()->second;
  at::Tensor host;
  module->ForEachSlot([&](Module& m, TensorSlot& slot) {
    if (m.SlotPath(slot) == name) host = slot.value;
  });
  ASSERT_TRUE(host.defined()) << name;
  EXPECT_TRUE(at::equal(host, Dequantize(stored, CompressFormat::kInt8, at::kFloat))) << name;

  absl::StatusOr<std::unique_ptr<Component>> made = Component::Create("transformer", std::move(module), at::kFloat);
  ASSERT_TRUE(made.ok());
  std::unique_ptr<Component> component = *std::move(made);
  component->set_prequantized(quantization.weights, quantization.format);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  PlacementManager placement(backend.get());
  ASSERT_TRUE(placement.Register("q", component.get()).ok());
  placement.MarkReady("q");

  c10::InferenceMode guard;
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor latents = at::randn({config->in_channels, 1, 8, 8}, gen);
  const at::Tensor caption = at::randn({9, config->cap_feat_dim}, gen);
  auto& dit = static_cast<ZImageTransformer&>(component->module());
  auto forward = [&] {
    at::Tensor out;
    EXPECT_TRUE(placement.Run(*component, [&] { out = dit.Forward(latents, 0.3, caption); }).ok());
    return out;
  };
  const at::Tensor resident = forward();

  GroupOffloadOptions options;
  options.use_stream = true;
  options.compress = CompressFormat::kInt8;
  ASSERT_TRUE(placement.EnableGroupOffload("q/transformer", options).ok());
  EXPECT_TRUE(at::equal(forward(), resident));  // The checkpoint's bytes, widened: exact.
  ASSERT_TRUE(placement.DisableGroupOffload("q/transformer").ok());

  // Without them the store quantizes the host copy again (absmax scales): not the same weights.
  component->set_prequantized(nullptr, CompressFormat::kNone);
  ASSERT_TRUE(placement.EnableGroupOffload("q/transformer", options).ok());
  const at::Tensor requantized = forward();
  EXPECT_FALSE(at::equal(requantized, resident));
  EXPECT_LT((requantized - resident).norm().item<double>() / resident.norm().item<double>(), 0.05);
  ASSERT_TRUE(placement.DisableGroupOffload("q/transformer").ok());
  placement.Unregister("q");
}

// compress AUTO under a device's host memory budget: the fixture transformer's host copies are
// views of its safetensors mapping (dropped from RSS once compressed), so a budget below its
// weights picks grouped int8, a tighter one int4, one below every estimate the smallest (int4,
// "over the host budget"); no budget: uncompressed. Each choice is a "compress" decision, and what
// placement then counts on the host fits the budget.
TEST(QuantizedCheckpointTest, CompressAutoChoosesTheFormatUnderTheHostBudget) {
  absl::StatusOr<google::protobuf::Struct> json = ReadJsonFile(std::string(kFixture) + "/config.json");
  ASSERT_TRUE(json.ok());
  absl::StatusOr<ZImageTransformerConfig> config = ZImageTransformerConfigFromJson(*json, kFixture);
  ASSERT_TRUE(config.ok()) << config.status();
  struct Case {
    double budget_fraction;  // Of the uncompressed host bytes; 0: no budget.
    const char* want;
    bool over;
  };
  // Fractions of the fp32 weights: grouped int8 needs ~0.26 of them, int4 ~0.16 (plus the 1-D tensors).
  for (const Case& c : {Case{0, "none", false}, Case{0.5, "int8_grouped", false}, Case{0.22, "int4", false},
                        Case{0.01, "int4", true}, Case{2.0, "none", false}}) {
    auto module = std::make_unique<ZImageTransformer>(*config, LayerOptions{at::kFloat});
    ASSERT_TRUE(LoadComponentWeights(*module, kFixture, at::kFloat, {}, nullptr).ok());
    int64_t mapped = 0, total = 0;
    module->ForEachSlot([&](Module&, TensorSlot& slot) {
      total += static_cast<int64_t>(slot.value.nbytes());
      if (!MappedFilesContaining({slot.value.data_ptr()}).empty()) mapped += static_cast<int64_t>(slot.value.nbytes());
    });
    ASSERT_EQ(mapped, total) << "the fixture's host copies should be views of its mapping";
    absl::StatusOr<std::unique_ptr<Component>> made = Component::Create("transformer", std::move(module), at::kFloat);
    ASSERT_TRUE(made.ok());
    std::unique_ptr<Component> component = *std::move(made);
    std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
    PlacementManager placement(backend.get());
    const auto budget = static_cast<int64_t>(c.budget_fraction * static_cast<double>(total));
    placement.set_host_memory_budget(budget);
    ASSERT_TRUE(placement.Register("q", component.get()).ok());
    EXPECT_EQ(placement.HostBytes(), total);
    GroupOffloadOptions options;
    options.use_stream = true;
    options.choose_compress = true;
    ASSERT_TRUE(placement.EnableGroupOffload("q/transformer", options).ok()) << c.want;
    auto stats = placement.GroupOffloadStatsOf("q/transformer");
    ASSERT_TRUE(stats.ok());
    EXPECT_EQ(stats->compress, c.want) << c.budget_fraction;
    const std::vector<PlacementDecision> log = placement.DecisionLog(100);
    const PlacementDecision* decision = nullptr;
    for (const PlacementDecision& d : log) {
      if (d.action == "compress") decision = &d;
    }
    ASSERT_NE(decision, nullptr);
    EXPECT_EQ(decision->component, "q/transformer");
    EXPECT_NE(decision->reason.find(c.want), std::string::npos) << decision->reason;
    EXPECT_EQ(decision->reason.find("over the host budget") != std::string::npos, c.over) << decision->reason;
    if (budget > 0 && !c.over) {
      EXPECT_LE(placement.HostBytes(), budget) << c.want;
      EXPECT_LE(placement.HostBytes(), decision->bytes + 4096) << c.want;  // The estimate, within alignment.
    }
    ASSERT_TRUE(placement.DisableGroupOffload("q/transformer").ok());
    EXPECT_EQ(placement.HostBytes(), total);
    placement.Unregister("q");
  }
}

// On the heap (weights drawn, not mapped) compressing adds a copy beside the originals: AUTO keeps
// them uncompressed, over a budget too (the fewest host bytes).
TEST(QuantizedCheckpointTest, CompressAutoKeepsHeapWeightsUncompressed) {
  absl::StatusOr<google::protobuf::Struct> json = ReadJsonFile(std::string(kFixture) + "/config.json");
  ASSERT_TRUE(json.ok());
  absl::StatusOr<ZImageTransformerConfig> config = ZImageTransformerConfigFromJson(*json, kFixture);
  ASSERT_TRUE(config.ok());
  auto module = std::make_unique<ZImageTransformer>(*config, LayerOptions{at::kFloat});
  InitializeRandomWeights(*module, 7);
  absl::StatusOr<std::unique_ptr<Component>> made = Component::Create("transformer", std::move(module), at::kFloat);
  ASSERT_TRUE(made.ok()) << made.status();
  std::unique_ptr<Component> component = *std::move(made);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  PlacementManager placement(backend.get());
  placement.set_host_memory_budget(1024);
  ASSERT_TRUE(placement.Register("h", component.get()).ok());
  GroupOffloadOptions options;
  options.choose_compress = true;
  ASSERT_TRUE(placement.EnableGroupOffload("h/transformer", options).ok());
  EXPECT_EQ(placement.GroupOffloadStatsOf("h/transformer")->compress, "none");
  const std::vector<PlacementDecision> log = placement.DecisionLog(10);
  ASSERT_FALSE(log.empty());
  bool recorded = false;
  for (const PlacementDecision& d : log) {
    if (d.action == "compress") recorded = d.reason.find("none, over the host budget") != std::string::npos;
  }
  EXPECT_TRUE(recorded);
  ASSERT_TRUE(placement.DisableGroupOffload("h/transformer").ok());
  placement.Unregister("h");
  // Apply itself refuses an unresolved choice.
  ZImageTransformer other(*config, LayerOptions{at::kFloat});
  InitializeRandomWeights(other, 8);
  absl::StatusOr<std::unique_ptr<HostWeights>> weights = HostWeights::Capture(other);
  ASSERT_TRUE(weights.ok()) << weights.status();
  GroupOffloadOptions unresolved;
  unresolved.choose_compress = true;
  const auto applied = GroupOffloader::Apply("x", other, **weights, *backend, unresolved);
  ASSERT_FALSE(applied.ok());
  EXPECT_EQ(applied.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(applied.status().message().find("compress AUTO"), std::string::npos) << applied.status();
}

// A folder whose 8-bit file lacks a scale is refused naming it; 8-bit tensors of the wrong shape or
// name are refused by the loader like any other weights.
TEST(QuantizedCheckpointTest, BrokenCheckpointsAreRefusedNamingTheFile) {
  const std::string dir = std::string(::testing::TempDir()) + "/broken_int8";
  ::mkdir(dir.c_str(), 0755);
  const at::Tensor q = at::ones({4, 3}, at::TensorOptions().dtype(at::kChar));
  ASSERT_TRUE(WriteSafetensors(dir + "/diffusion_pytorch_model.safetensors", {{"w", q}},
                               {{kCompressMetadataKey, "int8"}})
                  .ok());
  absl::StatusOr<ComponentWeights> read = ReadComponentWeights(dir);
  ASSERT_FALSE(read.ok());
  EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(read.status().message().find("diffusion_pytorch_model.safetensors"), std::string::npos)
      << read.status();

  // A valid 8-bit file whose tensors do not fit the model: wrong shape, then an unknown name.
  ZImageTransformerConfig config;
  config.in_channels = 4;
  config.dim = 64;
  config.n_heads = 2;
  config.n_layers = 1;
  config.n_refiner_layers = 0;
  config.cap_feat_dim = 48;
  config.axes_dims = {8, 12, 12};
  config.axes_lens = {128, 64, 64};
  ZImageTransformer model(config, LayerOptions{});
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  model.ForEachSlot([&](Module& owner, TensorSlot& slot) {
    at::Tensor t = at::zeros(slot.value.sizes());
    tensors.emplace_back(owner.SlotPath(slot), t);
  });
  const std::string shaped = std::string(::testing::TempDir()) + "/bad_shape_int8";
  ::mkdir(shaped.c_str(), 0755);
  for (auto& [name, t] : tensors) {
    if (name == "all_x_embedder.2-1.weight") t = at::zeros({64, 8});  // The model needs [64, 16].
  }
  ASSERT_TRUE(WriteCompressedSafetensors(shaped + "/diffusion_pytorch_model.safetensors", tensors, CompressFormat::kInt8).ok());
  absl::Status bound = LoadComponentWeights(model, shaped, at::kFloat);
  EXPECT_EQ(bound.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bound.message().find("all_x_embedder.2-1.weight"), std::string::npos) << bound;
  EXPECT_NE(bound.message().find("has shape"), std::string::npos) << bound;
  const std::string named = std::string(::testing::TempDir()) + "/bad_name_int8";
  ::mkdir(named.c_str(), 0755);
  for (auto& [name, t] : tensors) {
    if (name == "all_x_embedder.2-1.weight") t = at::zeros({64, 16});
  }
  tensors.emplace_back("layers.9.attention.to_q.weight", at::zeros({64, 64}));
  ASSERT_TRUE(WriteCompressedSafetensors(named + "/diffusion_pytorch_model.safetensors", tensors, CompressFormat::kInt8).ok());
  bound = LoadComponentWeights(model, named, at::kFloat);
  EXPECT_EQ(bound.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bound.message().find("does not use: layers.9.attention.to_q.weight"), std::string::npos) << bound;
}

}  // namespace
}  // namespace stowage
