#include "models/pipelines/flux_pipeline.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/core/diffusers_format.h"
#include "models/core/layers.h"
#include "models/pipeline_registry.h"
#include "tests/models/host_runner.h"

namespace stowage {
namespace {

GenerationParams Params(const std::string& prompt, float guidance, uint64_t seed, int steps = 3) {
  GenerationParams p;
  p.prompt = prompt;
  p.width = 64;
  p.height = 48;
  p.steps = steps;
  p.guidance_scale = guidance;
  p.seed = seed;
  return p;
}

std::unique_ptr<Pipeline> Tiny() {
  FluxPipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyFluxPipeline(options);
  EXPECT_TRUE(pipeline.ok()) << pipeline.status();
  return pipeline.ok() ? *std::move(pipeline) : nullptr;
}

absl::StatusOr<Image> Alone(Pipeline& pipeline, const GenerationParams& params, HostRunner* runner = nullptr) {
  HostRunner local;
  RunContext context(nullptr, nullptr);
  return pipeline.Run(params, runner != nullptr ? *runner : local, context);
}

TEST(FluxPipelineTest, TinyBuiltInRunsItsComponentsInOrderDeterministically) {
  auto pipeline = Tiny();
  ASSERT_NE(pipeline, nullptr);
  const PipelineLimits& limits = pipeline->limits();
  EXPECT_EQ(limits.size_multiple, 16);  // The VAE's 8 times 2 for packing.
  EXPECT_EQ(limits.default_width, 128);
  EXPECT_EQ(limits.default_steps, 28);  // [dev]: guidance embedded.
  EXPECT_EQ(limits.default_guidance_scale, 3.5f);
  EXPECT_NE(pipeline->description().find("[dev]"), std::string::npos);
  HostRunner runner;
  auto a = Alone(*pipeline, Params("a red lantern", 3.5f, 1), &runner);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->width, 64);
  EXPECT_EQ(a->height, 48);
  // CLIP, T5, one (distilled-guidance) transformer forward per step, the VAE.
  EXPECT_EQ(runner.calls, (std::vector<std::string>{"text_encoder", "text_encoder_2", "transformer", "transformer",
                                                    "transformer", "vae"}));
  auto same = Alone(*pipeline, Params("a red lantern", 3.5f, 1));
  auto seed = Alone(*pipeline, Params("a red lantern", 3.5f, 2));
  auto guidance = Alone(*pipeline, Params("a red lantern", 1.0f, 1));
  auto prompt = Alone(*pipeline, Params("a blue boat", 3.5f, 1));
  ASSERT_TRUE(same.ok() && seed.ok() && guidance.ok() && prompt.ok());
  EXPECT_EQ(a->rgb, same->rgb);
  EXPECT_NE(a->rgb, seed->rgb);
  EXPECT_NE(a->rgb, guidance->rgb);  // [dev] embeds the guidance scale.
  EXPECT_NE(a->rgb, prompt->rgb);
}

TEST(FluxPipelineTest, NegativePromptsAreRefusedSayingWhy) {
  auto pipeline = Tiny();
  ASSERT_NE(pipeline, nullptr);
  GenerationParams p = Params("a red lantern", 3.5f, 1);
  p.negative_prompt = "blur";
  auto refused = Alone(*pipeline, p);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("negative_prompt"), std::string::npos) << refused.status();
}

// One transformer forward per step for the whole batch; each member's image is its image alone
// (fp32: identical pixels), whatever its prompt, seed or guidance.
TEST(FluxPipelineTest, BatchMembersGetTheImageTheyGetAlone) {
  auto pipeline = Tiny();
  ASSERT_NE(pipeline, nullptr);
  ASSERT_TRUE(pipeline->batched());
  const std::vector<GenerationParams> params = {
      Params("a red lantern", 3.5f, 1),
      Params("a much longer prompt about a small blue boat drifting on a calm lake at dawn, with mist", 2.0f, 2),
      Params("a red lantern", 3.5f, 1)};
  std::vector<RunContext> contexts;
  for (size_t i = 0; i < params.size(); ++i) contexts.emplace_back(nullptr, nullptr);
  std::vector<BatchMember> members;
  for (size_t i = 0; i < params.size(); ++i) members.push_back(BatchMember{&params[i], &contexts[i]});
  HostRunner runner;
  std::vector<absl::StatusOr<Image>> batch = pipeline->RunBatch(members, runner);
  ASSERT_EQ(batch.size(), params.size());
  EXPECT_EQ(runner.calls, (std::vector<std::string>{"text_encoder", "text_encoder_2", "transformer", "transformer",
                                                    "transformer", "vae"}));
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(batch[i].ok()) << i << ": " << batch[i].status();
    auto alone = Alone(*pipeline, params[i]);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(batch[i]->rgb, alone->rgb) << "member " << i;
  }
  EXPECT_EQ(batch[0]->rgb, batch[2]->rgb);
  EXPECT_NE(batch[0]->rgb, batch[1]->rgb);
}

// Members with different LoRA adapters (on the transformer and on both text encoders) in one batch:
// the caller installs each member's adapters as a row (as the device worker does), and each image
// is the member's image alone with its adapters. fp32 on the CPU: identical pixels with Debian's
// LibTorch; the GPU host's torch 2.11 CPU kernels for the adapters' rank-2 matrix products depend on
// the number of rows (measured: one member off by a level), hence the bound of kMixedPixelBound.
TEST(FluxPipelineTest, MembersWithDifferentAdaptersGetTheImageTheyGetAlone) {
  auto pipeline = Tiny();
  ASSERT_NE(pipeline, nullptr);
  ASSERT_TRUE(pipeline->limits().mixes_adapters);
  // Two adapters on every Linear of every component but the VAE, random, fixed.
  uint64_t seed = 100;
  for (Component* c : pipeline->components()) {
    if (c->name().rfind("vae", 0) == 0) continue;
    c->module().ForEachModule([&](Module& m) {
      auto* linear = dynamic_cast<Linear*>(&m);
      if (linear == nullptr) return;
      for (const char* name : {"ink", "gold"}) {
        at::Generator gen = at::detail::createCPUGenerator(seed++);
        LoraWeights w;
        w.down = at::randn({2, linear->in_features()}, gen) * 0.2;
        w.up = at::randn({linear->out_features(), 2}, gen) * 0.2;
        ASSERT_TRUE(linear->AttachLora(name, w).ok());
      }
    });
  }
  std::vector<GenerationParams> params = {Params("a red lantern", 3.5f, 1), Params("a blue boat", 2.0f, 2),
                                          Params("a red lantern", 3.5f, 1), Params("a green hill", 3.5f, 4)};
  params[0].loras = {{"ink", 1.0f}};
  params[1].loras = {{"gold", 0.8f}, {"ink", -0.5f}};
  params[2].loras = {};  // Member 0's request without its adapter.
  params[3].loras = {{"gold", 1.0f}};
  std::vector<RunContext> contexts;
  for (size_t i = 0; i < params.size(); ++i) contexts.emplace_back(nullptr, nullptr);
  std::vector<BatchMember> members;
  for (size_t i = 0; i < params.size(); ++i) members.push_back(BatchMember{&params[i], &contexts[i]});
  LoraRows rows;
  for (const GenerationParams& p : params) rows.push_back(&p.loras);
  HostRunner runner;
  std::vector<absl::StatusOr<Image>> batch;
  {
    const ScopedLoraRows scoped(&rows);
    batch = pipeline->RunBatch(members, runner);
  }
  ASSERT_EQ(batch.size(), params.size());
  constexpr int kMixedPixelBound = 2;
  int exact = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(batch[i].ok()) << i << ": " << batch[i].status();
    const ScopedLoras scoped(&params[i].loras);
    auto alone = Alone(*pipeline, params[i]);
    ASSERT_TRUE(alone.ok());
    ASSERT_EQ(batch[i]->rgb.size(), alone->rgb.size());
    int worst = 0;
    for (size_t p = 0; p < alone->rgb.size(); ++p) {
      worst = std::max(worst, std::abs(static_cast<int>(batch[i]->rgb[p]) - static_cast<int>(alone->rgb[p])));
    }
    EXPECT_LE(worst, kMixedPixelBound) << "member " << i;
    exact += worst == 0 ? 1 : 0;
  }
  std::printf("mixed-adapter members identical to alone: %d of %zu\n", exact, params.size());
  EXPECT_NE(batch[0]->rgb, batch[2]->rgb) << "the adapter changed nothing";
}

TEST(FluxPipelineTest, OnlyTheMemberThatAsksGetsPreviewsAndNoImageChanges) {
  auto pipeline = Tiny();
  ASSERT_NE(pipeline, nullptr);
  std::vector<GenerationParams> params = {Params("a red lantern", 3.5f, 1), Params("a blue boat", 2.0f, 2)};
  for (GenerationParams& p : params) p.steps = 4;
  std::vector<RunContext> contexts;
  for (size_t i = 0; i < params.size(); ++i) contexts.emplace_back(nullptr, nullptr);
  std::vector<int> steps;
  contexts[1].set_previews(PreviewSteps(3, 4), [&](int, int step, const Image& image) {
    steps.push_back(step);
    EXPECT_EQ(image.width, params[1].width);
  });
  std::vector<BatchMember> members;
  for (size_t i = 0; i < params.size(); ++i) members.push_back(BatchMember{&params[i], &contexts[i]});
  HostRunner runner;
  std::vector<absl::StatusOr<Image>> batch = pipeline->RunBatch(members, runner);
  EXPECT_EQ(steps, (std::vector<int>{1, 2, 3}));
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(batch[i].ok()) << batch[i].status();
    auto alone = Alone(*pipeline, params[i]);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(batch[i]->rgb, alone->rgb) << "member " << i;
  }
}

TEST(FluxPipelineTest, InterruptedMemberLeavesAndTheOthersFinishAsAlone) {
  auto pipeline = Tiny();
  ASSERT_NE(pipeline, nullptr);
  const std::vector<GenerationParams> params = {Params("one", 3.5f, 7), Params("two two", 2.0f, 8),
                                                Params("three", 1.0f, 9)};
  int steps_seen = 0;
  std::vector<RunContext> contexts;
  contexts.emplace_back(nullptr, nullptr);
  contexts.emplace_back(
      [&]() { return steps_seen >= 1 ? absl::CancelledError("client went away") : absl::OkStatus(); },
      [&](const std::string& stage, int step, int) {
        if (stage == "denoise" && step > 0) steps_seen = step;
      });
  contexts.emplace_back(nullptr, nullptr);
  std::vector<BatchMember> members;
  for (size_t i = 0; i < params.size(); ++i) members.push_back(BatchMember{&params[i], &contexts[i]});
  HostRunner runner;
  std::vector<absl::StatusOr<Image>> batch = pipeline->RunBatch(members, runner);
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_EQ(batch[1].status().code(), absl::StatusCode::kCancelled);
  for (size_t i : {0u, 2u}) {
    ASSERT_TRUE(batch[i].ok()) << batch[i].status();
    EXPECT_EQ(batch[i]->rgb, Alone(*pipeline, params[i])->rgb) << i;
  }
}

TEST(FluxPipelineTest, RegisteredAsABuiltInAndAsADiffusersClass) {
  const PipelineRegistry& registry = DefaultPipelineRegistry();
  EXPECT_TRUE(registry.HasBuiltin("flux-tiny"));
  const std::vector<std::string> classes = registry.ClassNames();
  EXPECT_NE(std::find(classes.begin(), classes.end(), "FluxPipeline"), classes.end());
  PipelineLoadOptions options;
  options.name = "f";
  options.default_size = 256;
  auto pipeline = registry.CreateBuiltin("flux-tiny", options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  EXPECT_EQ((*pipeline)->name(), "f");
  EXPECT_EQ((*pipeline)->limits().default_width, 256);
  options.default_size = 100;  // Not a multiple of 16.
  auto odd = registry.CreateBuiltin("flux-tiny", options);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(odd.status().message()).find("default_size 100 is not a multiple of 16"), std::string::npos)
      << odd.status();
}

// A diffusers-format Flux folder: the reference fixture's configs, tokenizers (CLIP vocab.json +
// merges.txt, T5 spiece.model) and scheduler (dynamic shifting, as [dev]), with weights drawn from the
// configs and written by SaveComponent. Loaded back from the files, the pipeline draws exactly what
// the random-weights pipeline with the same weights drew: the weights bind by their diffusers names.
TEST(FluxPipelineTest, DirectoryWeightsRoundTripThroughTheDiffusersLayout) {
  const std::string fixture = "tests/fixtures/flux_tiny/pipeline";
  const std::string dir = std::string(::testing::TempDir()) + "/flux_dir";
  ASSERT_EQ(std::system(("rm -rf '" + dir + "' && cp -rL '" + fixture + "' '" + dir + "' && chmod -R u+w '" + dir +
                         "' && find '" + dir + "' -name '*.safetensors' -delete")
                            .c_str()),
            0);
  FluxPipelineOptions options;
  options.dtype = at::kFloat;
  options.max_sequence_length = 32;
  options.weight_seed = 5;
  auto drawn = LoadFluxPipeline(dir, options, /*random_weights=*/true);
  ASSERT_TRUE(drawn.ok()) << drawn.status();
  EXPECT_EQ((*drawn)->limits().default_width, 1024);  // Flux's, unless the config says otherwise.
  // Each component to its folder; the VAE's encoder and decoder share "vae".
  std::map<std::string, std::vector<Module*>> folders;
  for (Component* c : (*drawn)->components()) {
    folders[c->name() == "vae_encoder" ? "vae" : c->name()].push_back(&c->module());
  }
  EXPECT_EQ(folders.at("vae").size(), 2u);
  for (const auto& [folder, modules] : folders) {
    auto config = ReadJsonFile(dir + "/" + folder + "/config.json");
    ASSERT_TRUE(config.ok()) << config.status();
    ASSERT_TRUE(SaveComponent(modules, dir + "/" + folder, *config).ok()) << folder;
  }
  auto loaded = LoadFluxPipeline(dir, options, /*random_weights=*/false);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  GenerationParams p = Params("a red lantern at night", 3.5f, 4);
  auto want = Alone(**drawn, p);
  auto got = Alone(**loaded, p);
  ASSERT_TRUE(want.ok() && got.ok());
  EXPECT_EQ(got->rgb, want->rgb);
  // The same folder under another seed draws other weights: the comparison is not vacuous.
  options.weight_seed = 6;
  auto other = LoadFluxPipeline(dir, options, /*random_weights=*/true);
  ASSERT_TRUE(other.ok());
  EXPECT_NE(Alone(**other, p)->rgb, want->rgb);
}

// Files that disagree with each other are refused at load, naming the files.
// Sets a number field of a JSON config file.
absl::Status SetConfigNumber(const std::string& path, const std::string& field, double value) {
  absl::StatusOr<google::protobuf::Struct> config = ReadJsonFile(path);
  if (!config.ok()) return config.status();
  (*config->mutable_fields())[field].set_number_value(value);
  return WriteJsonFile(path, *config);
}

TEST(FluxPipelineTest, InconsistentFoldersAreRefusedNamingTheFiles) {
  // The committed reference folder is consistent.
  FluxPipelineOptions options;
  options.dtype = at::kFloat;
  ASSERT_TRUE(LoadFluxPipeline("tests/fixtures/flux_tiny/pipeline", options, true).ok());
  const std::string dir = std::string(::testing::TempDir()) + "/flux_bad";
  ASSERT_EQ(std::system(("rm -rf '" + dir + "' && cp -rL tests/fixtures/flux_tiny/pipeline '" + dir +
                         "' && chmod -R u+w '" + dir + "'")
                            .c_str()),
            0);
  // A T5 text encoder whose vocabulary is smaller than the ids its tokenizer yields (as a reference
  // tokenizer that ignored its spiece.model once produced): refused, naming tokenizer_2.
  ASSERT_TRUE(SetConfigNumber(dir + "/text_encoder_2/config.json", "vocab_size", 4).ok());
  auto broken = LoadFluxPipeline(dir, options, true);
  EXPECT_EQ(broken.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(broken.status().message()).find("tokenizer_2: token id"), std::string::npos)
      << broken.status();
  ASSERT_TRUE(SetConfigNumber(dir + "/text_encoder_2/config.json", "vocab_size", 48).ok());
  ASSERT_TRUE(SetConfigNumber(dir + "/transformer/config.json", "joint_attention_dim", 48).ok());
  auto mismatched = LoadFluxPipeline(dir, options, true);
  EXPECT_EQ(mismatched.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(mismatched.status().message()).find("joint_attention_dim"), std::string::npos)
      << mismatched.status();
  EXPECT_NE(std::string(mismatched.status().message()).find("transformer/config.json"), std::string::npos)
      << mismatched.status();
}

}  // namespace
}  // namespace stowage
