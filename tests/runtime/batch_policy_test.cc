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
  policy.Ran("p|64x64", 1, /*more_queued=*/false);
  EXPECT_EQ(policy.HoldUntil("p|64x64", kNow, kDelay), absl::InfinitePast());
}

TEST(BatchPolicyTest, ConcurrentDemandHoldsTheNextBatchUntilTheDelay) {
  BatchPolicy policy;
  policy.Ran("a", 3, false);  // Several members.
  policy.Ran("b", 1, true);   // One member, more of its kind queued when it ended.
  EXPECT_EQ(policy.HoldUntil("a", kNow, kDelay), kNow + kDelay);
  EXPECT_EQ(policy.HoldUntil("b", kNow, kDelay), kNow + kDelay);
  EXPECT_EQ(policy.HoldUntil("c", kNow, kDelay), absl::InfinitePast()) << "keys are separate";
  // Demand gone (a lone batch, nothing queued): the key starts at once again.
  policy.Ran("a", 1, false);
  EXPECT_FALSE(policy.ShowsDemand("a"));
  EXPECT_TRUE(policy.ShowsDemand("b"));
}

TEST(BatchPolicyTest, RemembersABoundedNumberOfKeys) {
  BatchPolicy policy;
  for (size_t i = 0; i < BatchPolicy::kMaxKeys; ++i) policy.Ran(absl::StrCat("k", i), 2, false);
  EXPECT_EQ(policy.remembered(), BatchPolicy::kMaxKeys);
  policy.Ran("k0", 2, false);  // Known: nothing forgotten.
  EXPECT_EQ(policy.remembered(), BatchPolicy::kMaxKeys);
  policy.Ran("new", 2, false);  // One more: the old ones go, the new one stays.
  EXPECT_EQ(policy.remembered(), 1u);
  EXPECT_TRUE(policy.ShowsDemand("new"));
}

}  // namespace
}  // namespace stowage
