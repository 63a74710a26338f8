// An 8-bit checkpoint loaded from a diffusers-format folder: the loader dequantizes it into the
// module (the compute-dtype host copy) and hands the stored 8-bit bytes to the component; placement
// passes them to 8-bit group offloading, which then streams exactly the checkpoint's values — the
// streamed forward equals the resident one bit for bit. Quantizing the host copy again instead (the
// path without the checkpoint's bytes) is measurably not exact, which is what the hand-over is for.
#include <sys/stat.h>

#include <fstream>
#include <iterator>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"

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

// Rewrites a safetensors file so that its U8 tensors are declared F8_E4M3 (this LibTorch has no
// float8 type to write them with): the bytes stay, the header changes.
void DeclareU8AsFloat8(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  std::string header = bytes.substr(8, length);
  const std::string data = bytes.substr(8 + length);
  for (size_t at = header.find("\"dtype\":\"U8\""); at != std::string::npos; at = header.find("\"dtype\":\"U8\"", at)) {
    header.replace(at, 12, "\"dtype\":\"F8_E4M3\"");
  }
  while (header.size() % 8 != 0) header.push_back(' ');
  length = header.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(&length), 8);
  out << header << data;
}

// The fixture transformer as an fp8 checkpoint in one of the common layouts: "compressed-tensors"
// (per-channel "<w>_scale" [out, 1], activation "input_scale"s), "comfy" (a per-tensor
// "<layer>.scale_weight", "scale_input"s and the "scaled_fp8" marker) or "plain" (no scales).
// Returns the folder; `expected` gets each weight's bytes and per-channel scales.
std::string WriteFp8Checkpoint(const std::string& layout, PrequantizedWeights* expected) {
  const std::string dir = std::string(::testing::TempDir()) + "/fp8_" + layout;
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
    // Every 2-D weight the store would compress is fp8 here (the pad tokens without a scale), so
    // streaming sends only the checkpoint's bytes.
    if (t.dim() != 2 || !t.is_floating_point()) {
      tensors.emplace_back(name, t.contiguous());
      continue;
    }
    const bool weight = absl::EndsWith(name, ".weight");
    const at::Tensor rows = t.to(at::kFloat);
    at::Tensor scale = layout == "plain" || !weight ? at::ones({rows.size(0)})
                       : layout == "comfy" ? rows.abs().amax().clamp_min(1e-8).div(kFp8E4M3Max).expand({rows.size(0)})
                                           : rows.abs().amax(1).clamp_min(1e-8).div(kFp8E4M3Max);
    const at::Tensor q = EncodeFp8E4M3((rows / scale.unsqueeze(1)).contiguous());
    tensors.emplace_back(name, q);
    (*expected)[name] = QuantizedTensor{q, scale.contiguous()};
    if (!weight) continue;
    const std::string layer = name.substr(0, name.size() - 7);
    if (layout == "compressed-tensors") {
      tensors.emplace_back(name + "_scale", scale.reshape({-1, 1}).contiguous());
      tensors.emplace_back(layer + ".input_scale", at::ones({1}));
    } else if (layout == "comfy") {
      tensors.emplace_back(layer + ".scale_weight", scale.narrow(0, 0, 1).reshape({}).contiguous());
      tensors.emplace_back(layer + ".scale_input", at::ones({}));
    }
  }
  // ComfyUI's marker is itself an F8_E4M3 tensor (it names the dtype): U8 here, declared F8 below.
  if (layout == "comfy") tensors.emplace_back("scaled_fp8", at::zeros({2}, at::TensorOptions().dtype(at::kByte)));
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  EXPECT_TRUE(WriteSafetensors(file, tensors).ok());
  DeclareU8AsFloat8(file);
  return dir;
}

// A checkpoint folder's transformer, loaded as the diffusers-format loader loads it (8-bit values
// kept as the component's prequantized weights) and registered on a simulated device: its host copy
// of a weight, and forwards on fixed inputs, resident or group-offloaded.
struct CheckpointHarness {
  explicit CheckpointHarness(const std::string& dir) {
    absl::StatusOr<google::protobuf::Struct> json = ReadJsonFile(dir + "/config.json");
    EXPECT_TRUE(json.ok()) << json.status();
    absl::StatusOr<ZImageTransformerConfig> parsed = ZImageTransformerConfigFromJson(*json, dir);
    EXPECT_TRUE(parsed.ok()) << parsed.status();
    config = *parsed;
    auto module = std::make_unique<ZImageTransformer>(config, LayerOptions{at::kFloat});
    loaded = LoadComponentWeights(*module, dir, at::kFloat, {}, &quantization);
    component = std::move(*Component::Create("transformer", std::move(module), at::kFloat));
    component->set_prequantized(quantization.weights, quantization.format);
    EXPECT_TRUE(placement.Register("q", component.get()).ok());
    placement.MarkReady("q");
    at::Generator gen = at::detail::createCPUGenerator(5);
    latents = at::randn({config.in_channels, 1, 8, 8}, gen);
    caption = at::randn({9, config.cap_feat_dim}, gen);
  }
  ~CheckpointHarness() { placement.Unregister("q"); }
  // The host copy of weight `name` (undefined when there is none).
  at::Tensor Host(const std::string& name) {
    for (const HostWeights::Entry& entry : component->host_weights().entries()) {
      if (entry.module->SlotPath(*entry.slot) == name) return entry.host;
    }
    return at::Tensor();
  }
  at::Tensor Forward() {
    c10::InferenceMode guard;
    auto& dit = static_cast<ZImageTransformer&>(component->module());
    at::Tensor out;
    EXPECT_TRUE(placement.Run(*component, [&] { out = dit.Forward(latents, 0.3, caption); }).ok());
    return out;
  }
  // A forward with the transformer group-offloaded, its groups sent in `format`.
  at::Tensor StreamedForward(CompressFormat format) {
    GroupOffloadOptions options;
    options.use_stream = true;
    options.compress = format;
    EXPECT_TRUE(placement.EnableGroupOffload("q/transformer", options).ok());
    const at::Tensor out = Forward();
    EXPECT_TRUE(placement.DisableGroupOffload("q/transformer").ok());
    return out;
  }

  ZImageTransformerConfig config;
  CheckpointQuantization quantization;
  absl::Status loaded;
  std::unique_ptr<Component> component;
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  PlacementManager placement{backend.get()};
  at::Tensor latents, caption;
};

// The fp8 checkpoints people download load as they are: each layout's F8_E4M3 weights with their
// scales (per channel, per tensor, none) become this server's fp8 host copies (value x scale) and
// its prequantized bytes; streamed with compress fp8, the checkpoint's own bytes go to the device
// and the output equals the resident one.
TEST(QuantizedCheckpointTest, CommonFp8LayoutsLoadAndStreamTheirOwnBytes) {
  for (const std::string layout : {"compressed-tensors", "comfy", "plain"}) {
    SCOPED_TRACE(layout);
    PrequantizedWeights expected;
    CheckpointHarness h(WriteFp8Checkpoint(layout, &expected));
    ASSERT_TRUE(h.loaded.ok()) << h.loaded;
    ASSERT_NE(h.quantization.weights, nullptr);
    EXPECT_EQ(h.quantization.format, CompressFormat::kFp8E4M3);
    ASSERT_EQ(h.quantization.weights->size(), expected.size());
    for (const auto& [name, want] : expected) {
      const QuantizedTensor& got = h.quantization.weights->at(name);
      EXPECT_TRUE(at::equal(got.q, want.q)) << name;
      EXPECT_TRUE(at::equal(got.scale, want.scale)) << name;
    }
    const std::string name = expected.begin()->first;
    const at::Tensor host = h.Host(name);
    ASSERT_TRUE(host.defined()) << name;
    EXPECT_TRUE(at::equal(host, Dequantize(expected.at(name), CompressFormat::kFp8E4M3, at::kFloat))) << name;
    const at::Tensor resident = h.Forward();
    const at::Tensor streamed = h.StreamedForward(CompressFormat::kFp8E4M3);
    EXPECT_TRUE(at::equal(streamed, resident)) << "max diff " << (streamed - resident).abs().max().item<double>()
        << " of " << resident.abs().max().item<double>();
  }
}

TEST(QuantizedCheckpointTest, ShardedFp8CheckpointsPairScalesAcrossShards) {
  PrequantizedWeights expected;
  const std::string single = WriteFp8Checkpoint("compressed-tensors", &expected);
  absl::StatusOr<ComponentWeights> whole = ReadComponentWeights(single);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const std::string dir = std::string(::testing::TempDir()) + "/fp8_sharded";
  ::mkdir(dir.c_str(), 0755);
  {
    std::ifstream in(single + "/config.json", std::ios::binary);
    std::ofstream out(dir + "/config.json", std::ios::binary | std::ios::trunc);
    out << in.rdbuf();
  }
  // Shard 1: the F8 weights; shard 2: their scales, activation scales and every other tensor.
  std::vector<std::pair<std::string, at::Tensor>> weights, rest;
  std::string map;
  for (const auto& [name, q] : *whole->quantized) {
    weights.emplace_back(name, q.q);
    rest.emplace_back(name + "_scale", q.scale.reshape({-1, 1}).contiguous());
    rest.emplace_back(name.substr(0, name.size() - 7) + ".input_scale", at::ones({1}));
  }
  for (const auto& [name, t] : whole->tensors) rest.emplace_back(name, t.contiguous());
  for (const auto& [name, t] : weights) map += "\"" + name + "\": \"a.safetensors\", ";
  for (const auto& [name, t] : rest) map += "\"" + name + "\": \"b.safetensors\", ";
  map.resize(map.size() - 2);
  ASSERT_TRUE(WriteSafetensors(dir + "/a.safetensors", weights).ok());
  DeclareU8AsFloat8(dir + "/a.safetensors");
  ASSERT_TRUE(WriteSafetensors(dir + "/b.safetensors", rest).ok());
  {
    std::ofstream index(dir + "/diffusion_pytorch_model.safetensors.index.json");
    index << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  }
  absl::StatusOr<ComponentWeights> sharded = ReadComponentWeights(dir);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_EQ(sharded->format, CompressFormat::kFp8E4M3);
  ASSERT_EQ(sharded->quantized->size(), expected.size());
  for (const auto& [name, want] : expected) {
    EXPECT_TRUE(at::equal(sharded->quantized->at(name).q, want.q)) << name;
    EXPECT_TRUE(at::equal(sharded->quantized->at(name).scale, want.scale)) << name;
  }
  EXPECT_EQ(sharded->tensors.size(), whole->tensors.size()) << "scales or activation scales left as weights";
}

TEST(QuantizedCheckpointTest, BrokenFp8CheckpointsAreRefusedNamingTheTensor) {
  auto refused = [](const std::string& name, std::vector<std::pair<std::string, at::Tensor>> tensors,
                    const std::string& needle) {
    const std::string dir = std::string(::testing::TempDir()) + "/broken_fp8_" + name;
    ::mkdir(dir.c_str(), 0755);
    const std::string file = dir + "/diffusion_pytorch_model.safetensors";
    ASSERT_TRUE(WriteSafetensors(file, tensors).ok());
    DeclareU8AsFloat8(file);
    absl::StatusOr<ComponentWeights> read = ReadComponentWeights(dir);
    ASSERT_FALSE(read.ok()) << name;
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument) << name;
    EXPECT_NE(read.status().message().find(needle), std::string::npos) << read.status();
    EXPECT_NE(read.status().message().find("diffusion_pytorch_model.safetensors"), std::string::npos) << read.status();
  };
  const at::TensorOptions u8 = at::TensorOptions().dtype(at::kByte);
  refused("rank1", {{"w.weight", at::full({8}, 0x38, u8)}}, "F8_E4M3 tensor 'w.weight' has rank 1");
  refused("nan", {{"w.weight", at::full({2, 4}, 0x7F, u8)}}, "NaN bit patterns");
  refused("nan_negative", {{"w.weight", at::full({2, 4}, 0xFF, u8)}}, "NaN bit patterns");
  refused("scale_shape", {{"w.weight", at::full({2, 4}, 0x38, u8)}, {"w.weight_scale", at::ones({3})}},
          "scale 'w.weight_scale' must be F32, BF16 or F16 of shape");
  refused("scale_sign", {{"w.weight", at::full({2, 4}, 0x38, u8)}, {"w.scale_weight", -at::ones({})}},
          "not finite and positive");
}

TEST(QuantizedCheckpointTest, GroupOffloadStreamsTheCheckpointsOwnBytes) {
  CheckpointHarness h(WriteInt8Checkpoint());
  ASSERT_TRUE(h.loaded.ok()) << h.loaded;
  ASSERT_NE(h.quantization.weights, nullptr);
  EXPECT_EQ(h.quantization.format, CompressFormat::kInt8);
  // The host copy is the dequantized checkpoint: q × scale.
  const auto& [name, stored] = *h.quantization.weights->begin();
  const at::Tensor host = h.Host(name);
  ASSERT_TRUE(host.defined()) << name;
  EXPECT_TRUE(at::equal(host, Dequantize(stored, CompressFormat::kInt8, at::kFloat))) << name;
  const at::Tensor resident = h.Forward();
  // The checkpoint's bytes, widened: exact.
  EXPECT_TRUE(at::equal(h.StreamedForward(CompressFormat::kInt8), resident));
  // Without them the store quantizes the host copy again (absmax scales): not the same weights.
  h.component->set_prequantized(nullptr, CompressFormat::kNone);
  const at::Tensor requantized = h.StreamedForward(CompressFormat::kInt8);
  EXPECT_FALSE(at::equal(requantized, resident));
  EXPECT_LT((requantized - resident).norm().item<double>() / resident.norm().item<double>(), 0.05);
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
