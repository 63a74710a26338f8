#include "offload/memcpy_pool.h"

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

namespace stowage {
namespace {

std::vector<uint8_t> Pattern(int64_t n, uint32_t seed) {
  std::vector<uint8_t> v(static_cast<size_t>(n));
  uint32_t x = seed;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

TEST(MemcpyPoolTest, CopiesEveryByteWithAnyThreadCountAndSize) {
  for (int threads : {0, 1, 3, 7}) {
    MemcpyPool pool(threads);
    // Below one slice, exactly several slices, and a ragged tail; repeated to reuse the threads.
    for (int64_t n : {int64_t{0}, int64_t{1000}, int64_t{4} << 20, (int64_t{5} << 20) + 12345}) {
      for (int round = 0; round < 3; ++round) {
        const std::vector<uint8_t> src = Pattern(n, static_cast<uint32_t>(n + round));
        std::vector<uint8_t> dst(static_cast<size_t>(n) + 1, 0xAB);
        pool.Copy(dst.data(), src.data(), n);
        EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin())) << threads << " threads, " << n << " bytes";
        EXPECT_EQ(dst.back(), 0xAB) << "wrote past the end";
      }
    }
  }
}

}  // namespace
}  // namespace stowage
