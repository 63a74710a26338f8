// A request's image in a batch against its image alone, for the batching tests.
#ifndef STOWAGE_TESTS_E2E_SAME_IMAGE_H_
#define STOWAGE_TESTS_E2E_SAME_IMAGE_H_

#include <algorithm>
#include <cstdlib>
#include <string>

#include <gtest/gtest.h>

#include "stowage/v1/generation.pb.h"

namespace stowage {

// A request's image in a batch against its image alone (raw RGB pixels): byte-identical on the
// simulated device, where float32 CPU kernels do not depend on the batch size; on CUDA cuBLAS picks
// GEMM kernels by shape, so a batch may sum in another order: at most kCudaPixelBound levels of 255
// apart (measured: 1 level, bench/batch_equivalence on the H200).
inline constexpr int kCudaPixelBound = 3;

inline void ExpectSameImage(const v1::GenerateResponse& batched, const v1::GenerateResponse& alone, const std::string& what) {
  ASSERT_EQ(batched.image().size(), alone.image().size()) << what;
  if (batched.stats().device().rfind("sim:", 0) == 0) {
    EXPECT_EQ(batched.image(), alone.image()) << what << " differs from its image alone";
    return;
  }
  int worst = 0;
  for (size_t i = 0; i < alone.image().size(); ++i) {
    worst = std::max(worst, std::abs(static_cast<int>(static_cast<unsigned char>(batched.image()[i])) -
                                     static_cast<int>(static_cast<unsigned char>(alone.image()[i]))));
  }
  EXPECT_LE(worst, kCudaPixelBound) << what << " on " << batched.stats().device();
}

}  // namespace stowage

#endif  // STOWAGE_TESTS_E2E_SAME_IMAGE_H_
