// stowctl's renderings of admin replies.
#include "clients/stowctl/format.h"

#include <string>

#include <gtest/gtest.h>

namespace stowage {
namespace {

TEST(FormatTest, HumanBytes) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(512), "512 B");
  EXPECT_EQ(HumanBytes(int64_t{6} << 20), "6.00 MiB");
}

// The placement summary names the cross-pipeline prefetches once there are any.
TEST(FormatTest, PlacementCountsTheNextPipelinesPrefetchesWhenThereAreAny) {
  v1::GetPlacementResponse r;
  r.set_device("sim:0");
  r.set_allocated_bytes(int64_t{3} << 20);
  r.set_budget_bytes(int64_t{8} << 20);
  r.set_strategy("footprint");
  EXPECT_EQ(FormatPlacement(r).find("pipeline prefetches"), std::string::npos);
  r.set_pipeline_prefetches(3);
  r.set_pipeline_prefetch_bytes(int64_t{6} << 20);
  r.set_pipeline_prefetches_used(2);
  r.set_pipeline_prefetches_unused(1);
  const std::string text = FormatPlacement(r);
  EXPECT_NE(text.find("device sim:0: 3.00 MiB allocated of 8.00 MiB; strategy footprint; OOM recoveries 0\n"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("pipeline prefetches: 3 (6.00 MiB), 2 used, 1 moved off unused\n"), std::string::npos) << text;
}

}  // namespace
}  // namespace stowage
