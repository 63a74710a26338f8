#include "base/parallel_ranges.h"

#include <atomic>
#include <stdexcept>
#include <vector>

#include <gtest/gtest.h>

namespace stowage {
namespace {

// Every unit runs exactly once, in contiguous ranges, however n and the minimum compare with the CPUs.
TEST(ParallelRangesTest, EveryUnitRunsOnce) {
  EXPECT_GE(AllowedCpus(), 1);
  for (const int64_t n : {0, 1, 7, 1000}) {
    for (const int64_t min_per_thread : {1, 3, 5000}) {
      std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
      std::atomic<int> ranges{0};
      ParallelRanges(n, min_per_thread, [&](int64_t begin, int64_t end) {
        ASSERT_LT(begin, end);
        ++ranges;
        for (int64_t i = begin; i < end; ++i) ++seen[static_cast<size_t>(i)];
      });
      for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[static_cast<size_t>(i)].load(), 1) << n << " " << i;
      EXPECT_LE(ranges.load(), n == 0 ? 0 : std::max<int64_t>(1, n / min_per_thread)) << n;
    }
  }
}

// An error in a range reaches the caller once every range has stopped; the other ranges still ran.
TEST(ParallelRangesTest, AnErrorIsRethrownAfterEveryRangeStopped) {
  std::atomic<int64_t> done{0}, failed{0};
  EXPECT_THROW(ParallelRanges(64, 1,
                              [&](int64_t begin, int64_t end) {
                                if (end == 64) {
                                  failed = end - begin;
                                  throw std::runtime_error("last range");
                                }
                                done += end - begin;
                              }),
               std::runtime_error);
  EXPECT_GT(failed.load(), 0);
  EXPECT_EQ(done.load() + failed.load(), 64);  // Every other range ran to its end.
}

}  // namespace
}  // namespace stowage
