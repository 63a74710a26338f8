#include "models/pipeline_registry.h"
#include "models/pipelines/zimage_pipeline.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/core/layers.h"
#include "tests/offload/spill_dir.h"
#include "tests/models/host_runner.h"

#include "base/status_macros.h"

namespace stowage {
namespace {

absl::StatusOr<Image> Draw(Pipeline& pipeline, float guidance, uint64_t seed, HostRunner* runner = nullptr) {
  GenerationParams p;
  p.prompt = "a red lantern";
  p.negative_prompt = "blur";
  p.width = 64;
  p.height = 48;
  p.steps = 2;
  p.guidance_scale = guidance;
  p.seed = seed;
  HostRunner local;
  RunContext context(nullptr, nullptr);
  return pipeline.Run(p, runner != nullptr ? *runner : local, context);
}

TEST(ZImagePipelineTest, TinyBuiltInRunsDeterministicallyWithDiffusersGuidanceSemantics) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  EXPECT_EQ((*pipeline)->limits().size_multiple, 16);
  EXPECT_EQ((*pipeline)->limits().default_width, 256);
  EXPECT_EQ((*pipeline)->limits().default_guidance_scale, 0.0f);
  HostRunner runner;
  auto a = Draw(**pipeline, 0.0f, 1, &runner);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->width, 64);
  EXPECT_EQ(a->height, 48);
  // g = 0: no guidance, one transformer pass per step.
  EXPECT_EQ(runner.calls, (std::vector<std::string>{"text_encoder", "transformer", "transformer", "vae"}));
  auto b = Draw(**pipeline, 0.0f, 1);
  auto c = Draw(**pipeline, 0.0f, 2);
  auto guided = Draw(**pipeline, 1.5f, 1);
  ASSERT_TRUE(b.ok() && c.ok() && guided.ok());
  EXPECT_EQ(a->rgb, b->rgb);
  EXPECT_NE(a->rgb, c->rgb);
  EXPECT_NE(a->rgb, guided->rgb);  // Any g > 0 guides (pos + g·(pos − neg)).
}

// PipelineConfig.host_spill_dir: the random weights move into a mapped file that is removed at
// once; the images are the same bytes.
TEST(ZImagePipelineTest, HostCopiesSpilledToAFileGiveTheSameImages) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto plain = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(plain.ok()) << plain.status();
  const std::string dir = MakeSpillTestDir();
  ASSERT_FALSE(dir.empty());
  options.host_spill_dir = dir;
  auto spilled = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(spilled.ok()) << spilled.status();
  EXPECT_EQ(std::system(("test -z \"$(ls -A '" + dir + "')\"").c_str()), 0) << "the spill files are removed";
  EXPECT_GE(CountSpillMappings(dir), 3) << "every component's weights view a removed spill file";
  auto a = Draw(**plain, 1.5f, 3);
  auto b = Draw(**spilled, 1.5f, 3);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->rgb, b->rgb);

  options.host_spill_dir = dir + "/missing";
  auto refused = CreateTinyZImagePipeline(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(refused.status().message()).find("pipeline.host_spill_dir"), std::string::npos)
      << refused.status();
}

GenerationParams Params(const std::string& prompt, float guidance, uint64_t seed) {
  GenerationParams p;
  p.prompt = prompt;
  p.negative_prompt = "blur";
  p.width = 64;
  p.height = 48;
  p.steps = 3;
  p.guidance_scale = guidance;
  p.seed = seed;
  return p;
}

// A batch shares each forward between its members; every member's image is the one it gets alone
// (fp32: identical 8-bit pixels), whatever its prompt length, seed or guidance.
TEST(ZImagePipelineTest, BatchMembersGetTheImageTheyGetAlone) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  ASSERT_TRUE((*pipeline)->batched());
  const std::vector<GenerationParams> params = {
      Params("a red lantern", 0.0f, 1),
      Params("a much longer prompt about a small blue boat drifting on a calm lake at dawn, with mist", 0.0f, 2),
      Params("a red lantern", 2.5f, 3),
      Params("a red lantern", 0.0f, 1)};
  std::vector<RunContext> contexts;
  for (size_t i = 0; i < params.size(); ++i) contexts.emplace_back(nullptr, nullptr);
  std::vector<BatchMember> members;
  for (size_t i = 0; i < params.size(); ++i) members.push_back(BatchMember{&params[i], &contexts[i]});
  HostRunner runner;
  std::vector<absl::StatusOr<Image>> batch = (*pipeline)->RunBatch(members, runner);
  ASSERT_EQ(batch.size(), params.size());
  // One text-encoder placement, one transformer forward per step, one decode: for all members.
  EXPECT_EQ(runner.calls,
            (std::vector<std::string>{"text_encoder", "transformer", "transformer", "transformer", "vae"}));
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(batch[i].ok()) << i << ": " << batch[i].status();
    HostRunner alone_runner;
    RunContext alone_context(nullptr, nullptr);
    absl::StatusOr<Image> alone = (*pipeline)->Run(params[i], alone_runner, alone_context);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(batch[i]->rgb, alone->rgb) << "member " << i;
  }
  EXPECT_EQ(batch[0]->rgb, batch[3]->rgb);
  EXPECT_NE(batch[0]->rgb, batch[1]->rgb);
  // Every member saw its own stage progress.
  for (const RunContext& context : contexts) {
    std::vector<std::string> stages;
    for (const auto& stage : context.stage_times()) stages.push_back(stage.stage);
    EXPECT_EQ(stages, (std::vector<std::string>{"tokenize", "encode_prompt", "denoise", "decode"}));
  }
}

// Members with different LoRA adapters on every Linear of the text encoder and the transformer (the
// timestep embedder too, whose input is computed once for the whole batch and so becomes one row per
// member; the caption and patch embedders, which run per sample) in one batch, one member guided
// (two rows), one without adapters: each image is the member's image alone with its adapters
// (float32 on the CPU: identical pixels with Debian's LibTorch; kMixedPixelBound levels otherwise,
// as in flux_pipeline_test).
TEST(ZImagePipelineTest, MembersWithDifferentAdaptersGetTheImageTheyGetAlone) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  ASSERT_TRUE((*pipeline)->limits().mixes_adapters);
  uint64_t seed = 200;
  int adapted = 0;
  for (Component* c : (*pipeline)->components()) {
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
      ++adapted;
    });
  }
  ASSERT_GT(adapted, 0);
  std::vector<GenerationParams> params = {Params("a red lantern", 0.0f, 1), Params("a blue boat", 2.5f, 2),
                                          Params("a red lantern", 0.0f, 1), Params("a green hill", 0.0f, 4)};
  params[0].loras = {{"ink", 1.0f}};
  params[1].loras = {{"gold", 0.8f}, {"ink", -0.5f}};
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
    batch = (*pipeline)->RunBatch(members, runner);
  }
  ASSERT_EQ(batch.size(), params.size());
  constexpr int kMixedPixelBound = 2;
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(batch[i].ok()) << i << ": " << batch[i].status();
    const ScopedLoras scoped(&params[i].loras);
    HostRunner alone_runner;
    RunContext alone_context(nullptr, nullptr);
    absl::StatusOr<Image> alone = (*pipeline)->Run(params[i], alone_runner, alone_context);
    ASSERT_TRUE(alone.ok());
    ASSERT_EQ(batch[i]->rgb.size(), alone->rgb.size());
    int worst = 0;
    for (size_t p = 0; p < alone->rgb.size(); ++p) {
      worst = std::max(worst, std::abs(static_cast<int>(batch[i]->rgb[p]) - static_cast<int>(alone->rgb[p])));
    }
    EXPECT_LE(worst, kMixedPixelBound) << "member " << i;
  }
  EXPECT_NE(batch[0]->rgb, batch[2]->rgb) << "the adapter changed nothing";
}

// A member whose caller goes away leaves at the next step boundary with its status; the others
// finish with the images they get alone.
TEST(ZImagePipelineTest, InterruptedMemberLeavesTheBatchWithoutDisturbingOthers) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(pipeline.ok());
  const std::vector<GenerationParams> params = {Params("one", 0.0f, 7), Params("two two", 1.5f, 8),
                                                Params("three", 0.0f, 9)};
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
  std::vector<absl::StatusOr<Image>> batch = (*pipeline)->RunBatch(members, runner);
  ASSERT_EQ(batch.size(), 3u);
  EXPECT_EQ(batch[1].status().code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(steps_seen, 1);  // Left after the first step.
  for (size_t i : {0u, 2u}) {
    ASSERT_TRUE(batch[i].ok()) << batch[i].status();
    HostRunner alone_runner;
    RunContext alone_context(nullptr, nullptr);
    EXPECT_EQ(batch[i]->rgb, (*pipeline)->Run(params[i], alone_runner, alone_context)->rgb) << i;
  }
  // Members of different sizes are refused as a whole.
  GenerationParams other = params[0];
  other.width = 80;
  RunContext c1(nullptr, nullptr), c2(nullptr, nullptr);
  for (const auto& r : (*pipeline)->RunBatch({BatchMember{&params[0], &c1}, BatchMember{&other, &c2}}, runner)) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(ZImagePipelineTest, Bfloat16RunsAndStaysCloseToFloat32) {
  ZImagePipelineOptions f32;
  f32.dtype = at::kFloat;
  ZImagePipelineOptions bf16;
  bf16.dtype = at::kBFloat16;
  auto a = CreateTinyZImagePipeline(f32);
  auto b = CreateTinyZImagePipeline(bf16);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ((*b)->components()[1]->weight_bytes() * 2, (*a)->components()[1]->weight_bytes());
  auto x = Draw(**a, 0.0f, 4);
  auto y = Draw(**b, 0.0f, 4);
  ASSERT_TRUE(x.ok() && y.ok()) << y.status();
  double diff = 0;
  for (size_t i = 0; i < x->rgb.size(); ++i) diff += std::abs(int(x->rgb[i]) - int(y->rgb[i]));
  EXPECT_LT(diff / x->rgb.size(), 20.0);  // The same picture up to bf16 rounding.
}

TEST(ZImagePipelineTest, DefaultSizeIsTheArchitecturesUnlessSetAndMustBeARequestableSize) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto tiny = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ((*tiny)->limits().default_width, 256);
  EXPECT_EQ((*tiny)->limits().size_multiple, 16);
  options.default_size = 128;
  auto set = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(set.ok()) << set.status();
  EXPECT_EQ((*set)->limits().default_width, 128);
  EXPECT_EQ((*set)->limits().default_height, 128);
  options.default_size = 120;  // Not a multiple of 16 (the VAE's 8 times the patch size 2).
  auto odd = CreateTinyZImagePipeline(options);
  EXPECT_EQ(odd.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(odd.status().message()).find("default_size 120 is not a multiple of 16"), std::string::npos)
      << odd.status();
  options.default_size = 4096;  // Beyond Z-Image's 2048.
  auto big = CreateTinyZImagePipeline(options);
  EXPECT_EQ(big.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(big.status().message()).find("default_size"), std::string::npos) << big.status();
  // Through the registry: Z-Image takes it; the tiny architecture's size is its config's.
  PipelineLoadOptions load;
  load.default_size = 128;
  auto registered = DefaultPipelineRegistry().CreateBuiltin("zimage-tiny", load);
  ASSERT_TRUE(registered.ok()) << registered.status();
  EXPECT_EQ((*registered)->limits().default_width, 128);
  auto refused = DefaultPipelineRegistry().CreateBuiltin("tiny", load);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(refused.status().message()).find("leave default_size at 0"), std::string::npos)
      << refused.status();
}

TEST(ZImagePipelineTest, LoadingRefusesDirectoriesThatAreNotZImage) {
  const std::string dir = std::string(::testing::TempDir()) + "/not_zimage";
  std::system(("mkdir -p '" + dir + "'").c_str());
  EXPECT_EQ(LoadZImagePipeline(dir, {}, true).status().code(), absl::StatusCode::kNotFound);
  std::ofstream(dir + "/model_index.json") << R"({"transformer": ["diffusers", "FluxTransformer2DModel"]})";
  auto wrong = LoadZImagePipeline(dir, {}, true);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(wrong.status().message()).find("not a ZImageTransformer2DModel"), std::string::npos);
}

}  // namespace
}  // namespace stowage

namespace stowage {
namespace {

// A smooth pattern with some noise, `width` x `height`, different per `seed`.
std::shared_ptr<ImageInput> InputImage(int width, int height, int seed, uint8_t mask_value, bool with_mask) {
  auto input = std::make_shared<ImageInput>();
  input->image.width = width;
  input->image.height = height;
  input->image.rgb.resize(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      for (int c = 0; c < 3; ++c) {
        input->image.rgb[(static_cast<size_t>(y) * width + x) * 3 + c] =
            static_cast<uint8_t>((x * 3 + y * 2 + c * 40 + seed * 57 + ((x * y + seed) % 7) * 5) % 256);
      }
    }
  }
  if (with_mask) input->mask.assign(static_cast<size_t>(width) * height, mask_value);
  return input;
}

GenerationParams EditParams(const std::string& prompt, uint64_t seed, std::shared_ptr<ImageInput> input,
                            double strength) {
  GenerationParams p = Params(prompt, 0.0f, seed);
  p.steps = 4;
  p.input = std::move(input);
  p.strength = strength;
  return p;
}

// Image to image runs the last steps of the schedule from the input's latents: StartStep is
// diffusers' rule, the VAE's encoder runs once for the batch, members with the same start share
// each forward and get the image they get alone, and progress counts the steps that run.
TEST(ZImageEditTest, ImageToImageStartsPartWayAndBatchesLikeTextToImage) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  EXPECT_TRUE((*pipeline)->limits().accepts_images);
  const std::vector<GenerationParams> params = {EditParams("a red lantern", 1, InputImage(64, 48, 1, 0, false), 0.5),
                                                EditParams("a blue boat", 2, InputImage(64, 48, 2, 0, false), 0.5)};
  EXPECT_EQ(StartStep(params[0]), 2);
  EXPECT_EQ(BatchKey(params[0]), BatchKey(params[1]));
  EXPECT_NE(BatchKey(params[0]), BatchKey(Params("a red lantern", 0.0f, 1)));  // Other start step.
  std::vector<RunContext> contexts;
  std::vector<std::pair<int, int>> reported;
  contexts.emplace_back(nullptr, [&](const std::string& stage, int step, int total) {
    if (stage == "denoise" && step > 0) reported.emplace_back(step, total);
  });
  contexts.emplace_back(nullptr, nullptr);
  std::vector<BatchMember> members;
  for (size_t i = 0; i < params.size(); ++i) members.push_back(BatchMember{&params[i], &contexts[i]});
  HostRunner runner;
  std::vector<absl::StatusOr<Image>> batch = (*pipeline)->RunBatch(members, runner);
  EXPECT_EQ(runner.calls,
            (std::vector<std::string>{"text_encoder", "vae_encoder", "transformer", "transformer", "vae"}));
  EXPECT_EQ(reported, (std::vector<std::pair<int, int>>{{1, 2}, {2, 2}}));
  std::vector<std::string> stages;
  for (const auto& stage : contexts[0].stage_times()) stages.push_back(stage.stage);
  EXPECT_EQ(stages, (std::vector<std::string>{"tokenize", "encode_prompt", "encode_input", "denoise", "decode"}));
  for (size_t i = 0; i < params.size(); ++i) {
    ASSERT_TRUE(batch[i].ok()) << batch[i].status();
    HostRunner alone_runner;
    RunContext alone_context(nullptr, nullptr);
    absl::StatusOr<Image> alone = (*pipeline)->Run(params[i], alone_runner, alone_context);
    ASSERT_TRUE(alone.ok());
    EXPECT_EQ(batch[i]->rgb, alone->rgb) << i;
  }
  // The input matters, and so does the strength.
  HostRunner r;
  RunContext c(nullptr, nullptr);
  GenerationParams other_image = params[0];
  other_image.input = InputImage(64, 48, 3, 0, false);
  EXPECT_NE((*pipeline)->Run(other_image, r, c)->rgb, batch[0]->rgb);
  GenerationParams stronger = params[0];
  stronger.strength = 0.9;
  EXPECT_EQ(StartStep(stronger), 0);  // int(4 - 3.6)
  EXPECT_NE((*pipeline)->Run(stronger, r, c)->rgb, batch[0]->rgb);
}

// Inpainting keeps what the mask keeps: with nothing to repaint the image is the input's VAE round
// trip whatever the prompt; with everything to repaint the prompt decides. A strength of 1 starts
// at step 0, so an inpainting request batches with text-to-image ones.
TEST(ZImageEditTest, InpaintingKeepsWhatTheMaskKeeps) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  auto pipeline = CreateTinyZImagePipeline(options);
  ASSERT_TRUE(pipeline.ok());
  auto run = [&](const GenerationParams& p) {
    HostRunner runner;
    RunContext context(nullptr, nullptr);
    absl::StatusOr<Image> image = (*pipeline)->Run(p, runner, context);
    EXPECT_TRUE(image.ok()) << image.status();
    return image.ok() ? image->rgb : std::vector<uint8_t>();
  };
  const auto keep_all = InputImage(64, 48, 4, 0, true);
  EXPECT_EQ(run(EditParams("a red lantern", 5, keep_all, 1.0)), run(EditParams("a blue boat", 5, keep_all, 1.0)));
  const auto repaint_all = InputImage(64, 48, 4, 255, true);
  EXPECT_NE(run(EditParams("a red lantern", 5, repaint_all, 1.0)), run(EditParams("a blue boat", 5, repaint_all, 1.0)));
  const GenerationParams inpaint = EditParams("a red lantern", 5, repaint_all, 1.0);
  GenerationParams text = Params("a red lantern", 0.0f, 5);
  text.steps = 4;
  EXPECT_EQ(StartStep(inpaint), 0);
  EXPECT_EQ(BatchKey(inpaint), BatchKey(text));
  // Mixed in one batch, each gets its image alone.
  const std::vector<GenerationParams> params = {inpaint, text};
  std::vector<RunContext> contexts;
  contexts.emplace_back(nullptr, nullptr);
  contexts.emplace_back(nullptr, nullptr);
  HostRunner runner;
  auto batch = (*pipeline)->RunBatch({BatchMember{&params[0], &contexts[0]}, BatchMember{&params[1], &contexts[1]}}, runner);
  ASSERT_TRUE(batch[0].ok() && batch[1].ok());
  EXPECT_EQ(batch[0]->rgb, run(params[0]));
  EXPECT_EQ(batch[1]->rgb, run(params[1]));
}

}  // namespace
}  // namespace stowage
