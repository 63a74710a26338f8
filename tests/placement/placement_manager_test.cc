#include "placement/placement_manager.h"

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "models/tiny_pipeline.h"

namespace stowage {
namespace {

struct Harness {
  Harness() : backend(CreateSimulatedBackend({})), placement(backend.get()) {
    pipeline = *CreateTinyPipeline({});
    for (Component* c : pipeline->components()) EXPECT_TRUE(placement.Register("tiny", c).ok());
  }
  absl::StatusOr<Image> Generate() {
    GenerationParams params;
    params.prompt = "a harbour";
    params.width = 64;
    params.height = 64;
    params.steps = 2;
    params.seed = 3;
    RunContext context(nullptr, nullptr);
    return pipeline->Run(params, placement, context);
  }
  const ComponentView& View(const std::string& name) {
    views = placement.Snapshot();
    for (const ComponentView& v : views) {
      if (v.name == name) return v;
    }
    static ComponentView none;
    return none;
  }
  // Placement goes before the pipeline whose modules its offloaders hook.
  std::unique_ptr<DeviceBackend> backend;
  std::unique_ptr<Pipeline> pipeline;
  PlacementManager placement;
  std::vector<ComponentView> views;
};

TEST(PlacementManagerTest, ComponentsStartOffloadedAndBecomeResidentWhenRun) {
  Harness s;
  EXPECT_EQ(s.View("transformer").state, ComponentState::kOffloaded);
  EXPECT_EQ(s.backend->GetMemoryStats().allocated_bytes, 0);
  ASSERT_TRUE(s.Generate().ok());
  int64_t total = 0;
  for (const ComponentView& v : s.placement.Snapshot()) {
    EXPECT_EQ(v.state, ComponentState::kResident) << v.id;
    EXPECT_EQ(v.device_bytes, v.weight_bytes);
    total += v.weight_bytes;
  }
  EXPECT_EQ(s.backend->GetMemoryStats().allocated_bytes, total);
}

TEST(PlacementManagerTest, GroupOffloadedComponentPlacesItselfAndKeepsTheImageExact) {
  Harness plain;
  auto expected = plain.Generate();
  ASSERT_TRUE(expected.ok());

  Harness s;
  ASSERT_TRUE(s.Generate().ok());  // Everything resident first: enabling must take it off.
  GroupOffloadOptions options;
  options.use_stream = true;
  ASSERT_TRUE(s.placement.EnableGroupOffload("tiny/transformer", options).ok());
  const ComponentView& view = s.View("transformer");
  EXPECT_EQ(view.state, ComponentState::kGroupOffloaded);
  auto stats = s.placement.GroupOffloadStatsOf("tiny/transformer");
  ASSERT_TRUE(stats.ok());
  EXPECT_EQ(view.device_bytes, stats->working_set_bytes);
  EXPECT_LT(view.device_bytes, view.weight_bytes);
  auto image = s.Generate();
  ASSERT_TRUE(image.ok()) << image.status();
  EXPECT_EQ(image->rgb, expected->rgb);
  EXPECT_EQ(s.View("transformer").state, ComponentState::kGroupOffloaded);  // Never moved.
  EXPECT_GT(s.placement.GroupOffloadStatsOf("tiny/transformer")->forwards, 0);

  EXPECT_EQ(s.placement.EnableGroupOffload("tiny/transformer", options).code(),
            absl::StatusCode::kFailedPrecondition);
  ASSERT_TRUE(s.placement.DisableGroupOffload("tiny/transformer").ok());
  EXPECT_EQ(s.View("transformer").state, ComponentState::kOffloaded);
  auto again = s.Generate();
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rgb, expected->rgb);
  EXPECT_EQ(s.View("transformer").state, ComponentState::kResident);
  EXPECT_EQ(s.placement.DisableGroupOffload("tiny/transformer").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.placement.EnableGroupOffload("tiny/nope", options).code(), absl::StatusCode::kNotFound);
}

TEST(PlacementManagerTest, PipelineLevelWithExclusionsOverridesAndAllOrNothing) {
  Harness s;
  PipelineGroupOffloadOptions options;
  options.defaults.use_stream = true;
  options.exclude = {"vae"};
  GroupOffloadOptions leaf;
  leaf.type = OffloadType::kLeafLevel;
  options.overrides["text_encoder"] = leaf;
  ASSERT_TRUE(s.placement.EnablePipelineGroupOffload("tiny", options).ok());
  EXPECT_EQ(s.View("text_encoder").state, ComponentState::kGroupOffloaded);
  EXPECT_EQ(s.View("transformer").state, ComponentState::kGroupOffloaded);
  EXPECT_EQ(s.View("vae").state, ComponentState::kOffloaded);
  EXPECT_EQ(s.placement.GroupOffloadStatsOf("tiny/text_encoder")->streamed_groups,
            // Leaf level: every leaf with weights (2 layers × 8 leaves: norm1, to_q/k/v/out, norm2,
            // fc1, fc2; the embedding; the final norm). The root's position is always-on.
            2 * 8 + 2);
  ASSERT_TRUE(s.Generate().ok());

  Harness t;
  PipelineGroupOffloadOptions bad;
  bad.exclude = {"unet"};
  EXPECT_EQ(t.placement.EnablePipelineGroupOffload("tiny", bad).code(), absl::StatusCode::kInvalidArgument);
  PipelineGroupOffloadOptions partly_bad;
  GroupOffloadOptions impossible;
  impossible.budget_bytes = 1;  // Refused for the VAE, after the others were enabled.
  partly_bad.overrides["vae"] = impossible;
  const absl::Status status = t.placement.EnablePipelineGroupOffload("tiny", partly_bad);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(status.message()).find("tiny_vae"), std::string::npos) << status;
  for (const ComponentView& v : t.placement.Snapshot()) {
    EXPECT_EQ(v.state, ComponentState::kOffloaded) << v.id;  // Rolled back.
  }
  EXPECT_EQ(t.placement.EnablePipelineGroupOffload("sdxl", {}).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace stowage
