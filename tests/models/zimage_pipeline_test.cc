#include "models/pipeline_registry.h"
#include "models/pipelines/zimage_pipeline.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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
