// The worker's thread renewal after allocator out-of-memory errors (runtime/thread_renewal.h): when
// it happens, when it waits for room, and how it backs off where memory stays short.
#include "runtime/thread_renewal.h"

#include <cstdint>
#include <limits>
#include <string>

#include <gtest/gtest.h>

namespace stowage {
namespace {

constexpr int64_t kRoom = int64_t{1} << 30;
constexpr int64_t kNoBudget = std::numeric_limits<int64_t>::max();

TEST(ThreadRenewalPolicyTest, NoErrorsNoRenewal) {
  ThreadRenewalPolicy policy;
  for (int i = 0; i < 10; ++i) EXPECT_EQ(policy.Next(3, 0, kRoom), "") << i;  // A count from before: not new.
  EXPECT_FALSE(policy.pending());
}

TEST(ThreadRenewalPolicyTest, NewErrorsRenewOnceWithTheirCountAndLargestRefusal) {
  ThreadRenewalPolicy policy;
  EXPECT_EQ(policy.Next(0, 0, kRoom), "");
  const std::string reason = policy.Next(2, 256 << 20, kRoom);
  EXPECT_NE(reason, "");
  EXPECT_NE(reason.find("2 allocator out-of-memory errors"), std::string::npos) << reason;
  EXPECT_NE(reason.find(std::to_string(256 << 20)), std::string::npos) << reason;
  EXPECT_FALSE(policy.pending());
  EXPECT_EQ(policy.Next(2, 0, kRoom), "");  // The fresh thread's first item ran clean.
  EXPECT_EQ(policy.gap(), 1);
  EXPECT_EQ(policy.Next(2, 0, kRoom), "");
}

TEST(ThreadRenewalPolicyTest, WaitsUntilTheRefusalFitsTheFreeRoom) {
  ThreadRenewalPolicy policy;
  EXPECT_EQ(policy.Next(0, 0, kRoom), "");
  EXPECT_EQ(policy.Next(1, kRoom, kRoom / 2), "");  // Still short: a fresh thread would choose short again.
  EXPECT_TRUE(policy.pending());
  EXPECT_EQ(policy.Next(1, 0, kRoom / 2), "");  // The refusal is remembered past the request's window.
  const std::string reason = policy.Next(1, 0, kRoom);  // The room is back.
  EXPECT_NE(reason.find("the largest refusal " + std::to_string(kRoom) + " bytes, now within the free room"),
            std::string::npos)
      << reason;
  EXPECT_FALSE(policy.pending());
}

// Errors whose refused size was not kept (a later run's window reset it: 0) say so, and renew.
TEST(ThreadRenewalPolicyTest, ErrorsWithoutARefusedSizeRenewAndSaySo) {
  ThreadRenewalPolicy policy;
  EXPECT_EQ(policy.Next(0, 0, kRoom), "");
  const std::string reason = policy.Next(35, 0, kRoom);
  EXPECT_EQ(reason, "35 allocator out-of-memory errors (the refused size not kept past their run)");
}

// A refusal larger than any room (a request no budget holds) is replaced by a later request's: it
// does not hold back the renewal a passing shortfall calls for.
TEST(ThreadRenewalPolicyTest, ALaterShortfallReplacesOneNoRoomHolds) {
  ThreadRenewalPolicy policy;
  EXPECT_EQ(policy.Next(0, 0, kRoom), "");
  EXPECT_EQ(policy.Next(1, 4 * kRoom, kRoom), "");
  EXPECT_EQ(policy.Next(1, 0, kRoom), "");
  EXPECT_NE(policy.Next(2, kRoom / 4, kRoom), "");
}

TEST(ThreadRenewalPolicyTest, WithoutABudgetEveryRefusalFits) {
  ThreadRenewalPolicy policy;
  EXPECT_EQ(policy.Next(5, 0, kNoBudget), "");
  EXPECT_NE(policy.Next(6, int64_t{1} << 50, kNoBudget), "");
}

// A renewal whose first item runs short again doubles the wait before the next (1, 2, 4, … up to
// kMaxGap looks); a clean first item brings it back to one.
TEST(ThreadRenewalPolicyTest, BacksOffWhileMemoryStaysShortAndRecovers) {
  ThreadRenewalPolicy policy;
  int64_t ooms = 0;
  EXPECT_EQ(policy.Next(ooms, 0, kRoom), "");
  EXPECT_NE(policy.Next(++ooms, 1, kRoom), "");  // The first renewal.
  int renewals = 1;
  int looks = 0;
  // Every item runs short from here on.
  for (int i = 0; i < 400; ++i) {
    ++looks;
    if (!policy.Next(++ooms, 1, kRoom).empty()) ++renewals;
  }
  // Gaps 2, 4, 8, 16, 32, then 64 each: 2+4+8+16+32 = 62 looks for five renewals, then one per 64.
  EXPECT_EQ(policy.gap(), ThreadRenewalPolicy::kMaxGap);
  EXPECT_EQ(renewals, 1 + 5 + (looks - 62) / 64);
  // The next first item runs clean: the wait is one look again.
  while (policy.Next(++ooms, 1, kRoom).empty()) {
  }
  EXPECT_EQ(policy.Next(ooms, 0, kRoom), "");
  EXPECT_EQ(policy.gap(), 1);
  EXPECT_NE(policy.Next(++ooms, 1, kRoom), "");
}

// Whether a look found the fresh thread's first item short again (the caller then makes more room):
// only the first look after a renewal can, and only with new errors.
TEST(ThreadRenewalPolicyTest, SaysWhenTheFreshThreadsFirstItemRanShortAgain) {
  ThreadRenewalPolicy policy;
  EXPECT_EQ(policy.Next(0, 0, kRoom), "");
  EXPECT_FALSE(policy.fresh_thread_ran_short());
  EXPECT_NE(policy.Next(1, 1, kRoom), "");  // Errors before any renewal: a renewal, not "again".
  EXPECT_FALSE(policy.fresh_thread_ran_short());
  EXPECT_EQ(policy.Next(1, 0, kRoom), "");  // Its first item ran clean.
  EXPECT_FALSE(policy.fresh_thread_ran_short());
  EXPECT_NE(policy.Next(2, 1, kRoom), "");  // A later item's errors: a renewal again.
  EXPECT_FALSE(policy.fresh_thread_ran_short());
  EXPECT_EQ(policy.Next(3, 1, kRoom), "");  // Its first item ran short: the gap doubles.
  EXPECT_TRUE(policy.fresh_thread_ran_short());
  EXPECT_EQ(policy.gap(), 2);
  EXPECT_NE(policy.Next(4, 1, kRoom), "");  // The second item: not the first any more.
  EXPECT_FALSE(policy.fresh_thread_ran_short());
}

}  // namespace
}  // namespace stowage
