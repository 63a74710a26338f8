#include "models/pipelines/tiny_pipeline.h"

#include <algorithm>
#include <cstdlib>
#include <cmath>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include "absl/time/clock.h"
#include <gtest/gtest.h>

#include "tests/offload/spill_dir.h"
#include "tests/models/host_runner.h"

#include "models/tokenizers/byte_tokenizer.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/core/image.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

GenerationParams Params(uint64_t seed, float guidance = 1.0f) {
  GenerationParams p;
  p.prompt = "a lighthouse at dusk";
  p.negative_prompt = "blurry";
  p.width = 64;
  p.height = 48;
  p.steps = 3;
  p.guidance_scale = guidance;
  p.seed = seed;
  return p;
}

absl::StatusOr<Image> RunOnce(Pipeline& pipeline, const GenerationParams& params,
                              HostRunner& runner, std::function<absl::Status()> interrupt = nullptr) {
  RunContext context(std::move(interrupt), nullptr);
  return pipeline.Run(params, runner, context);
}

TEST(TinyPipelineTest, SameSeedSameImageOtherSeedOtherImage) {
  auto pipeline = CreateTinyPipeline({});
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  HostRunner runner;
  auto a = RunOnce(**pipeline, Params(7), runner);
  auto b = RunOnce(**pipeline, Params(7), runner);
  auto c = RunOnce(**pipeline, Params(8), runner);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  EXPECT_EQ(a->width, 64);
  EXPECT_EQ(a->height, 48);
  EXPECT_EQ(a->rgb, b->rgb);
  EXPECT_NE(a->rgb, c->rgb);
  // Text encoder once, transformer once per step, VAE once.
  EXPECT_EQ(runner.calls, (std::vector<std::string>{"text_encoder", "transformer", "transformer",
                                                    "transformer", "vae", "text_encoder",
                                                    "transformer", "transformer", "transformer",
                                                    "vae", "text_encoder", "transformer",
                                                    "transformer", "transformer", "vae"}));
}

// PipelineConfig.host_spill_dir: the same images from weights moved into a removed, mapped file;
// a directory that is a file is refused by name.
TEST(TinyPipelineTest, SpilledHostCopiesGiveTheSameImage) {
  auto plain = CreateTinyPipeline({});
  ASSERT_TRUE(plain.ok()) << plain.status();
  const std::string dir = MakeSpillTestDir();
  ASSERT_FALSE(dir.empty());
  TinyPipelineOptions options;
  options.host_spill_dir = dir;
  auto spilled = CreateTinyPipeline(options);
  ASSERT_TRUE(spilled.ok()) << spilled.status();
  EXPECT_GE(CountSpillMappings(dir), 3) << "every component's weights view a removed spill file";
  HostRunner runner;
  auto a = RunOnce(**plain, Params(7), runner);
  auto b = RunOnce(**spilled, Params(7), runner);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a->rgb, b->rgb);
  options.host_spill_dir = "/proc/version";
  auto refused = CreateTinyPipeline(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(std::string(refused.status().message()).find("pipeline.host_spill_dir: component 'text_encoder'"),
            std::string::npos)
      << refused.status();
}

TEST(PreviewStepsTest, EvenlySpacedBeforeTheLastStepAndFewerWhenStepsAreFew) {
  EXPECT_EQ(PreviewSteps(0, 8), std::vector<int>{});
  EXPECT_EQ(PreviewSteps(1, 8), (std::vector<int>{4}));
  EXPECT_EQ(PreviewSteps(3, 8), (std::vector<int>{2, 4, 6}));
  EXPECT_EQ(PreviewSteps(3, 4), (std::vector<int>{1, 2, 3}));
  EXPECT_EQ(PreviewSteps(3, 2), (std::vector<int>{1}));
  EXPECT_EQ(PreviewSteps(2, 1), std::vector<int>{});
}

// A stage's time is what the device took for it: each boundary waits for the device (here a wait
// of 15 ms standing for the work a GPU still has queued) before the clock is read, so the wait at a
// stage's end counts in that stage, and the one before a stage starts counts in none.
TEST(TinyPipelineTest, StageTimesWaitForTheDeviceAtEachBoundary) {
  auto pipeline = CreateTinyPipeline({});
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  HostRunner runner;
  RunContext context(nullptr, nullptr);
  int waits = 0;
  context.set_synchronize([&] {
    ++waits;
    absl::SleepFor(absl::Milliseconds(15));
  });
  const absl::Time start = absl::Now();
  auto image = (*pipeline)->Run(Params(3), runner, context);
  const absl::Duration run = absl::Now() - start;
  ASSERT_TRUE(image.ok()) << image.status();
  std::vector<std::string> stages;
  absl::Duration total;
  for (const auto& stage : context.stage_times()) {
    stages.push_back(stage.stage);
    EXPECT_GE(stage.duration, absl::Milliseconds(15)) << stage.stage;
    total += stage.duration;
  }
  EXPECT_EQ(stages, (std::vector<std::string>{"tokenize", "encode_prompt", "denoise", "decode"}));
  EXPECT_EQ(waits, 2 * static_cast<int>(stages.size()));  // At each stage's start and end.
  // The waits before the stages started are in no stage's time.
  EXPECT_LE(total, run - static_cast<int64_t>(stages.size()) * absl::Milliseconds(15));
}

TEST(TinyPipelineTest, PreviewsComeAtTheirStepsAndLeaveTheImageAsItWas) {
  auto pipeline = CreateTinyPipeline({});
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  HostRunner runner;
  GenerationParams params = Params(7);
  params.steps = 6;
  RunContext plain_context(nullptr, nullptr);
  auto plain = (*pipeline)->Run(params, runner, plain_context);
  ASSERT_TRUE(plain.ok());
  RunContext context(nullptr, nullptr);
  std::vector<std::pair<int, int>> seen;  // (index, step)
  std::vector<Image> previews;
  context.set_previews(PreviewSteps(2, params.steps), [&](int index, int step, const Image& image) {
    seen.emplace_back(index, step);
    previews.push_back(image);
  });
  runner.calls.clear();
  auto image = (*pipeline)->Run(params, runner, context);
  ASSERT_TRUE(image.ok());
  EXPECT_EQ(image->rgb, plain->rgb) << "previews changed the image";
  EXPECT_EQ(seen, (std::vector<std::pair<int, int>>{{0, 2}, {1, 4}}));
  ASSERT_EQ(previews.size(), 2u);
  EXPECT_EQ(previews[0].width, 64);
  EXPECT_EQ(previews[0].height, 48);
  // A preview is the run's estimate so far: it differs from the final image, the later one less.
  auto distance = [&](const Image& a) {
    double sum = 0;
    for (size_t i = 0; i < a.rgb.size(); ++i) sum += std::abs(int{a.rgb[i]} - int{image->rgb[i]});
    return sum;
  };
  EXPECT_GT(distance(previews[0]), 0);
  EXPECT_LT(distance(previews[1]), distance(previews[0]));
  // Each preview decodes once, inside the VAE's run.
  EXPECT_EQ(std::count(runner.calls.begin(), runner.calls.end(), "vae"), 3);
}

TEST(TinyPipelineTest, GuidanceChangesTheImageAndWeightSeedChangesWeights) {
  auto pipeline = CreateTinyPipeline({});
  TinyPipelineOptions other_options;
  other_options.weight_seed = 1;
  auto other = CreateTinyPipeline(other_options);
  ASSERT_TRUE(pipeline.ok() && other.ok());
  HostRunner runner;
  auto plain = RunOnce(**pipeline, Params(3, 1.0f), runner);
  auto guided = RunOnce(**pipeline, Params(3, 4.0f), runner);
  auto reseeded = RunOnce(**other, Params(3, 1.0f), runner);
  ASSERT_TRUE(plain.ok() && guided.ok() && reseeded.ok());
  EXPECT_NE(plain->rgb, guided->rgb);
  EXPECT_NE(plain->rgb, reseeded->rgb);
}

TEST(TinyPipelineTest, InterruptStopsBetweenSteps) {
  auto pipeline = CreateTinyPipeline({});
  ASSERT_TRUE(pipeline.ok());
  HostRunner runner;
  int checks = 0;
  auto result = RunOnce(**pipeline, Params(1), runner, [&]() -> absl::Status {
    return ++checks >= 3 ? absl::CancelledError("stop") : absl::OkStatus();
  });
  EXPECT_EQ(result.status().code(), absl::StatusCode::kCancelled);
  // Stopped after the second denoising step: the VAE never ran.
  EXPECT_EQ(runner.calls, (std::vector<std::string>{"text_encoder", "transformer", "transformer"}));
}

TEST(TinyPipelineTest, Bfloat16PipelineRunsAndIsCloseToFloat32) {
  TinyPipelineOptions bf16;
  bf16.dtype = at::kBFloat16;
  auto p32 = CreateTinyPipeline({});
  auto p16 = CreateTinyPipeline(bf16);
  ASSERT_TRUE(p32.ok() && p16.ok());
  EXPECT_EQ((*p16)->components()[1]->weight_bytes() * 2, (*p32)->components()[1]->weight_bytes());
  HostRunner runner;
  auto a = RunOnce(**p32, Params(5), runner);
  auto b = RunOnce(**p16, Params(5), runner);
  ASSERT_TRUE(a.ok() && b.ok()) << b.status();
  double diff = 0;
  for (size_t i = 0; i < a->rgb.size(); ++i) diff += std::abs(int(a->rgb[i]) - int(b->rgb[i]));
  EXPECT_LT(diff / a->rgb.size(), 40.0);  // Same picture up to bf16 rounding through 3 steps.
}

TEST(TinyPipelineTest, ForwardWithOffloadedWeightsFailsLoudly) {
  auto pipeline = CreateTinyPipeline({});
  ASSERT_TRUE(pipeline.ok());
  class OffloadedRunner : public ComponentRunner {
   public:
    absl::Status Run(Component& component, const std::function<void()>& fn) override {
      component.host_weights().OffloadAll();
      return CatchAsStatus(component.name(), fn);
    }
  } runner;
  RunContext context(nullptr, nullptr);
  auto result = (*pipeline)->Run(Params(1), runner, context);
  ASSERT_FALSE(result.ok());
  EXPECT_NE(std::string(result.status().message()).find("is offloaded"), std::string::npos)
      << result.status();
}

TEST(ByteTokenizerTest, FramesPadsAndLimits) {
  ByteTokenizer tokenizer(8);
  auto batch = tokenizer.Encode({"ab", "\xe4\xb8\xad"});  // "中" is 3 UTF-8 bytes.
  ASSERT_TRUE(batch.ok());
  EXPECT_EQ(batch->length, 5);
  EXPECT_EQ(batch->ids[0], (std::vector<int64_t>{1, 'a' + 3, 'b' + 3, 2, 0}));
  EXPECT_EQ(batch->ids[1], (std::vector<int64_t>{1, 0xe4 + 3, 0xb8 + 3, 0xad + 3, 2}));
  EXPECT_EQ(batch->mask[0], (std::vector<bool>{true, true, true, true, false}));
  EXPECT_FALSE(tokenizer.Encode({"1234567"}).ok());  // 7 bytes > 8 - 2.
  EXPECT_TRUE(tokenizer.Encode({"123456"}).ok());
}

TEST(FlowMatchSchedulerTest, MatchesTheShiftedLinearSchedule) {
  FlowMatchEulerScheduler scheduler({1000, 3.0});
  scheduler.SetTimesteps(4);
  auto shift = [](double s) { return 3.0 * s / (1.0 + 2.0 * s); };
  const double t_max = 1000.0;
  const double t_min = shift(0.001) * 1000.0;
  ASSERT_EQ(scheduler.sigmas().size(), 5u);
  for (int i = 0; i < 4; ++i) {
    const double t = t_max + (t_min - t_max) * i / 3.0;
    EXPECT_NEAR(scheduler.sigmas()[i], shift(t / 1000.0), 1e-12);
    EXPECT_NEAR(scheduler.timesteps()[i], shift(t / 1000.0) * 1000.0, 1e-9);
  }
  EXPECT_EQ(scheduler.sigmas()[4], 0.0);
  EXPECT_DOUBLE_EQ(scheduler.sigmas()[0], 1.0);
  const at::Tensor x = at::ones({2});
  const at::Tensor v = at::full({2}, 2.0);
  const at::Tensor next = scheduler.Step(v, 3, x);  // sigma 3 → 0.
  EXPECT_NEAR(next[0].item<double>(), 1.0 - 2.0 * scheduler.sigmas()[3], 1e-6);
}

TEST(ImageTest, PngRoundTripsPixels) {
  const at::Tensor pixels = at::rand({3, 5, 7}) * 2 - 1;
  auto image = ImageFromTensor(pixels);
  ASSERT_TRUE(image.ok());
  auto png = EncodePng(*image);
  ASSERT_TRUE(png.ok());
  EXPECT_EQ(png->substr(1, 3), "PNG");
  auto decoded = DecodePng(*png);
  ASSERT_TRUE(decoded.ok());
  EXPECT_EQ(decoded->width, 7);
  EXPECT_EQ(decoded->height, 5);
  EXPECT_EQ(decoded->rgb, image->rgb);
  EXPECT_FALSE(ImageFromTensor(at::zeros({4, 2, 2})).ok());
}

}  // namespace
}  // namespace stowage
