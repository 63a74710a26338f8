// The batching policy on its own, without a worker or threads: a key holds a batch open only after
// it showed concurrent demand, forgets it after a lone batch, and remembers a bounded number of keys.
#include "runtime/batch_policy.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

namespace stowage {
namespace {

const absl::Time kNow = absl::FromUnixSeconds(1000);
const absl::Duration kDelay = absl::Milliseconds(50);

TEST(BatchPolicyTest, AKeyWithoutHistoryStartsAtOnce) {
  BatchPolicy policy;
  EXPECT_EQ(policy.HoldUntil("p|64x64", kNow, kDelay), absl::InfinitePast());
  // A lone batch with nothing of its kind queued after it: still no demand.
  policy.Ran("p|64x64", 1, /*queued=*/0);
  EXPECT_EQ(policy.HoldUntil("p|64x64", kNow, kDelay), absl::InfinitePast());
}

TEST(BatchPolicyTest, ConcurrentDemandHoldsTheNextBatchUntilTheDelay) {
  BatchPolicy policy;
  policy.Ran("a", 3, 0);  // Several members.
  policy.Ran("b", 1, 1);  // One member, more of its kind queued when it ended.
  EXPECT_EQ(policy.HoldUntil("a", kNow, kDelay), kNow + kDelay);
  EXPECT_EQ(policy.HoldUntil("b", kNow, kDelay), kNow + kDelay);
  EXPECT_EQ(policy.HoldUntil("c", kNow, kDelay), absl::InfinitePast()) << "keys are separate";
  // Demand gone (a lone batch, nothing queued): the key starts at once again.
  policy.Ran("a", 1, 0);
  EXPECT_FALSE(policy.ShowsDemand("a"));
  EXPECT_TRUE(policy.ShowsDemand("b"));
}

// A held batch starts once it has the most members its key had at once (a batch plus those queued
// when it ended) since its demand began; without demand there is no such count.
TEST(BatchPolicyTest, AHeldBatchStartsOnceItGatheredItsLastDemand) {
  BatchPolicy policy;
  EXPECT_EQ(policy.Gathered("a"), 0u);
  policy.Ran("a", 2, 0);
  EXPECT_EQ(policy.Gathered("a"), 2u);
  policy.Ran("a", 3, 2);  // Three ran, two more were waiting: five clients.
  EXPECT_EQ(policy.Gathered("a"), 5u);
  policy.Ran("a", 2, 0);  // A smaller batch (stragglers): the most seen stays.
  EXPECT_EQ(policy.Gathered("a"), 5u);
  policy.Ran("a", 1, 0);  // Alone, nothing queued: demand gone.
  EXPECT_EQ(policy.Gathered("a"), 0u);
  EXPECT_EQ(policy.HoldUntil("a", kNow, kDelay), absl::InfinitePast());
}

TEST(BatchPolicyTest, RemembersABoundedNumberOfKeys) {
  BatchPolicy policy;
  for (size_t i = 0; i < BatchPolicy::kMaxKeys; ++i) policy.Ran(absl::StrCat("k", i), 2, 0);
  EXPECT_EQ(policy.remembered(), BatchPolicy::kMaxKeys);
  policy.Ran("k0", 2, 0);  // Known: nothing forgotten.
  EXPECT_EQ(policy.remembered(), BatchPolicy::kMaxKeys);
  policy.Ran("new", 2, 0);  // One more: the old ones go, the new one stays.
  EXPECT_EQ(policy.remembered(), 1u);
  EXPECT_TRUE(policy.ShowsDemand("new"));
}

}  // namespace
}  // namespace stowage
