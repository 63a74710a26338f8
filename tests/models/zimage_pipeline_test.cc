#include "models/zimage_pipeline.h"

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
