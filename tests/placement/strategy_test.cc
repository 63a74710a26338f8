#include "placement/strategy.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace stowage {
namespace {

using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

Candidate C(const std::string& id, int64_t bytes, int64_t age_s) {
  const std::string name = id.substr(id.find('/') + 1);
  return Candidate{id, name, bytes, absl::UnixEpoch() + absl::Seconds(1000 - age_s)};
}

StrategyInput Input(int64_t needed, int64_t free, std::vector<Candidate> resident,
                    const std::string& target = "p/transformer") {
  StrategyInput in;
  in.target = C(target, needed, 0);
  in.needed_bytes = needed;
  in.free_bytes = free;
  in.resident = std::move(resident);
  return in;
}

TEST(FootprintStrategyTest, NothingMovesWhenItFits) {
  auto s = MakeFootprintStrategy(0);
  EXPECT_THAT(s->BeforeRun(Input(100, 100, {C("p/a", 50, 1)})), IsEmpty());
  EXPECT_THAT(s->BeforeRun(Input(100, INT64_MAX, {C("p/a", 50, 1)})), IsEmpty());
  EXPECT_TRUE(s->footprint_based());
}

TEST(FootprintStrategyTest, SmallestSingleComponentThatCoversTheDeficit) {
  auto s = MakeFootprintStrategy(0);
  // Deficit 30: b (40) is the smallest that covers it alone; c (100) would also.
  EXPECT_THAT(s->BeforeRun(Input(100, 70, {C("p/a", 20, 9), C("p/b", 40, 1), C("p/c", 100, 5)})),
              ElementsAre("p/b"));
  // Equal sizes: the least recently used goes.
  EXPECT_THAT(s->BeforeRun(Input(100, 70, {C("p/a", 40, 1), C("p/b", 40, 7), C("p/c", 40, 3)})),
              ElementsAre("p/b"));
}

TEST(FootprintStrategyTest, SeveralComponentsLargestFirstThenPruned) {
  auto s = MakeFootprintStrategy(0);
  // Deficit 90, no single one covers it: 60 + 30 = 90 (the 20 is not needed).
  EXPECT_THAT(s->BeforeRun(Input(100, 10, {C("p/a", 20, 1), C("p/b", 60, 1), C("p/c", 30, 1)})),
              UnorderedElementsAre("p/b", "p/c"));
  // Reserve counts against free memory: deficit 100 - (70 - 20) = 50 → b alone.
  auto reserved = MakeFootprintStrategy(20);
  EXPECT_THAT(reserved->BeforeRun(Input(100, 70, {C("p/a", 20, 1), C("p/b", 60, 1)})),
              ElementsAre("p/b"));
}

// keep_resident: a kept component (by name: every pipeline's; or by id) is never chosen, even when it
// is the cheapest cover (the hot pipeline's text encoder beside two transformers that swap).
TEST(FootprintStrategyTest, KeptComponentsAreNeverChosen) {
  const std::vector<Candidate> resident = {C("zimage/text_encoder", 80, 1), C("zimage/transformer", 120, 5),
                                           C("flux/text_encoder", 30, 9)};
  // Deficit 70: without keep, the text encoder (80) is the smallest single cover.
  EXPECT_THAT(MakeFootprintStrategy(0)->BeforeRun(Input(120, 50, resident, "ft/transformer")),
              ElementsAre("zimage/text_encoder"));
  EXPECT_THAT(MakeFootprintStrategy(0, {"zimage/text_encoder"})->BeforeRun(Input(120, 50, resident, "ft/transformer")),
              ElementsAre("zimage/transformer"));
  // By name: every pipeline's text encoder stays; by id of another pipeline: only that one.
  EXPECT_THAT(MakeFootprintStrategy(0, {"text_encoder"})->BeforeRun(Input(120, 50, resident, "ft/transformer")),
              ElementsAre("zimage/transformer"));
  EXPECT_THAT(MakeFootprintStrategy(0, {"flux/text_encoder"})->BeforeRun(Input(120, 50, resident, "ft/transformer")),
              ElementsAre("zimage/text_encoder"));
  // Everything kept: nothing is offered (the manager's out-of-memory recovery is the last resort,
  // and it moves kept components too); a movable one too small to cover the deficit alone is offered.
  EXPECT_THAT(MakeFootprintStrategy(0, {"text_encoder", "transformer"})->BeforeRun(Input(120, 50, resident)),
              IsEmpty());
  std::vector<Candidate> with_vae = resident;
  with_vae.push_back(C("zimage/vae", 10, 3));
  EXPECT_THAT(MakeFootprintStrategy(0, {"text_encoder", "transformer"})->BeforeRun(Input(120, 50, with_vae)),
              ElementsAre("zimage/vae"));
}

TEST(FootprintStrategyTest, ThousandComponentsDecideWithoutEnumeratingSubsets) {
  auto s = MakeFootprintStrategy(0);
  std::vector<Candidate> many;
  for (int i = 0; i < 1000; ++i) many.push_back(C("p/c" + std::to_string(i), 10 + i % 7, i));
  const auto ids = s->BeforeRun(Input(1000, 0, many));
  int64_t freed = 0;
  for (const auto& id : ids) {
    for (const auto& c : many) {
      if (c.id == id) freed += c.bytes;
    }
  }
  EXPECT_GE(freed, 1000);
  EXPECT_LT(freed, 1000 + 16);  // Pruned: no chosen component is superfluous.
}

TEST(CustomStrategyTest, LruEvictsOldestFirstUntilItFits) {
  auto s = MakeCustomStrategy("lru");
  ASSERT_TRUE(s.ok());
  EXPECT_THAT((*s)->BeforeRun(Input(100, 40, {C("p/a", 30, 1), C("p/b", 20, 9), C("p/c", 50, 5)})),
              ElementsAre("p/b", "p/c"));
  EXPECT_THAT((*s)->BeforeRun(Input(10, 40, {C("p/a", 30, 1)})), IsEmpty());
}

TEST(CustomStrategyTest, TextEncodersOnlyMovesTextEncodersBeforeAnythingElseRuns) {
  auto s = MakeCustomStrategy("text-encoders-only");
  ASSERT_TRUE(s.ok());
  const std::vector<Candidate> resident = {C("p/text_encoder", 10, 1), C("p/text_encoder_2", 5, 1),
                                           C("p/vae", 3, 1)};
  EXPECT_THAT((*s)->BeforeRun(Input(1, INT64_MAX, resident, "p/transformer")),
              ElementsAre("p/text_encoder", "p/text_encoder_2"));
  EXPECT_THAT((*s)->BeforeRun(Input(1, INT64_MAX, resident, "p/text_encoder")), IsEmpty());
  EXPECT_FALSE((*s)->footprint_based());
}

TEST(CustomStrategyTest, RegistryNamesAndErrors) {
  RegisterCustomStrategy("never", [] { return MakeFootprintStrategy(0); });
  EXPECT_TRUE(MakeCustomStrategy("never").ok());
  const auto missing = MakeCustomStrategy("magic");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(std::string(missing.status().message()).find("text-encoders-only"), std::string::npos);
}

TEST(WorkflowStrategyTest, AfterBeforeAndKeepResident) {
  const std::vector<std::string> known = {"text_encoder", "transformer", "vae"};
  auto s = MakeWorkflowStrategy(
      {{WorkflowRule::Kind::kAfter, "text_encoder", {"text_encoder"}},
       {WorkflowRule::Kind::kBefore, "vae", {"transformer"}},
       {WorkflowRule::Kind::kKeepResident, "vae", {}}},
      known);
  ASSERT_TRUE(s.ok()) << s.status();
  // after text_encoder: the target itself goes.
  EXPECT_THAT((*s)->AfterRun(Input(0, 0, {C("p/vae", 1, 1)}, "p/text_encoder")), ElementsAre("p/text_encoder"));
  EXPECT_THAT((*s)->BeforeRun(Input(0, 0, {C("p/transformer", 1, 1)}, "p/text_encoder")), IsEmpty());
  // before vae: the transformer goes.
  EXPECT_THAT((*s)->BeforeRun(Input(0, 0, {C("p/transformer", 1, 1), C("p/text_encoder", 1, 1)}, "p/vae")),
              ElementsAre("p/transformer"));
}

TEST(WorkflowStrategyTest, RejectsUnknownNamesAndContradictions) {
  const std::vector<std::string> known = {"text_encoder", "transformer", "vae"};
  auto unknown = MakeWorkflowStrategy({{WorkflowRule::Kind::kAfter, "unet", {"unet"}}}, known);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(unknown.status().message()).find("rules[0]: unknown component 'unet'"), std::string::npos);
  auto kept = MakeWorkflowStrategy({{WorkflowRule::Kind::kKeepResident, "vae", {}},
                                    {WorkflowRule::Kind::kBefore, "transformer", {"vae"}}},
                                   known);
  EXPECT_NE(std::string(kept.status().message()).find("rules[1]: offloads 'vae'"), std::string::npos);
  auto self = MakeWorkflowStrategy({{WorkflowRule::Kind::kBefore, "vae", {"vae"}}}, known);
  EXPECT_EQ(self.status().code(), absl::StatusCode::kInvalidArgument);
  auto empty = MakeWorkflowStrategy({{WorkflowRule::Kind::kAfter, "vae", {}}}, known);
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stowage
