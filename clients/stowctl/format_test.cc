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
  // With the spare-room caches on, the device line says the margin they leave.
  r.set_cache_margin_bytes(int64_t{768} << 20);
  EXPECT_NE(FormatPlacement(r).find("; OOM recoveries 0; cache margin 768.00 MiB\n"), std::string::npos)
      << FormatPlacement(r);
  // Once the allocator ran short, the device line says how often.
  EXPECT_EQ(FormatPlacement(r).find("allocator ran short"), std::string::npos);
  r.set_allocator_retries(5);
  r.set_allocator_ooms(2);
  EXPECT_NE(FormatPlacement(r).find("; cache margin 768.00 MiB; allocator ran short 5 retries, 2 OOMs\n"),
            std::string::npos)
      << FormatPlacement(r);
}

// A group-offloaded component's line names its spare-room cache once it holds or served anything.
TEST(FormatTest, PlacementNamesTheSpareRoomCacheWhenItWasUsed) {
  v1::GetPlacementResponse r;
  r.set_device("sim:0");
  v1::ComponentPlacement* c = r.add_components();
  c->set_id("flux/transformer");
  c->set_state(v1::ComponentPlacement::GROUP_OFFLOADED);
  v1::GroupOffloadStatus* g = c->mutable_group_offload();
  g->set_streamed_groups(4);
  g->set_forwards(3);
  EXPECT_EQ(FormatPlacement(r).find("spare-room cache"), std::string::npos);
  g->set_cached_groups(2);
  g->set_cache_bytes(int64_t{4} << 20);
  g->set_cache_hits(4);
  g->set_cache_hit_bytes(int64_t{8} << 20);
  const std::string text = FormatPlacement(r);
  EXPECT_NE(text.find("; 3 forwards; spare-room cache 2 groups (4.00 MiB), 4 onloads served (8.00 MiB not copied)\n"),
            std::string::npos)
      << text;
}

TEST(FormatTest, PlacementCountsTheWeightsMadeInOnePassWhenThereAreAny) {
  v1::GetPlacementResponse r;
  r.set_device("cuda:0");
  v1::ComponentPlacement* c = r.add_components();
  c->set_id("zimage/transformer");
  c->set_state(v1::ComponentPlacement::GROUP_OFFLOADED);
  v1::GroupOffloadStatus* g = c->mutable_group_offload();
  g->set_compress("int4");
  g->set_compressed_host_bytes(int64_t{3} << 30);
  EXPECT_EQ(FormatPlacement(r).find("one pass"), std::string::npos);
  g->set_one_pass_fp8_weights(238);
  const std::string text = FormatPlacement(r);
  EXPECT_NE(text.find("int4 (3.00 GiB on the host), 238 FP8 weights made with their int4 copy in one pass;"),
            std::string::npos)
      << text;
}

}  // namespace
}  // namespace stowage
