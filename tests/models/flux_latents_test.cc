#include "models/nets/flux_latents.h"

#include <cmath>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace stowage {
namespace {

TEST(FluxLatentsTest, PackingIsTwoByTwoPatchesChannelMajorAndUnpacksExactly) {
  const at::Tensor latents = at::randn({2, 3, 4, 6});
  const at::Tensor packed = PackLatents(latents);
  EXPECT_EQ(packed.sizes(), (std::vector<int64_t>{2, 6, 12}));
  // Token 4 is patch (row 1, column 1): latent rows 2..3, columns 2..3. Entry c*4 + dy*2 + dx.
  for (int64_t c = 0; c < 3; ++c) {
    for (int64_t dy = 0; dy < 2; ++dy) {
      for (int64_t dx = 0; dx < 2; ++dx) {
        EXPECT_EQ(packed[1][4][c * 4 + dy * 2 + dx].item<float>(), latents[1][c][2 + dy][2 + dx].item<float>());
      }
    }
  }
  EXPECT_TRUE(at::equal(UnpackLatents(packed, 4, 6), latents));
  EXPECT_THROW(PackLatents(at::randn({1, 3, 5, 6})), c10::Error);
  EXPECT_THROW(UnpackLatents(packed, 4, 8), c10::Error);
}

TEST(FluxLatentsTest, ImageIdsAreRowAndColumnOfEachPatch) {
  const at::Tensor ids = LatentImageIds(4, 6);  // 2 x 3 patches.
  ASSERT_EQ(ids.sizes(), (std::vector<int64_t>{6, 3}));
  const std::vector<std::vector<float>> expected = {{0, 0, 0}, {0, 0, 1}, {0, 0, 2}, {0, 1, 0}, {0, 1, 1}, {0, 1, 2}};
  for (int64_t i = 0; i < 6; ++i) {
    for (int64_t a = 0; a < 3; ++a) EXPECT_EQ(ids[i][a].item<float>(), expected[i][a]) << i << "," << a;
  }
}

TEST(FluxLatentsTest, ShiftGrowsWithImageTokensAndBendsTheSchedule) {
  EXPECT_NEAR(FluxShift(256), 0.5, 1e-12);
  EXPECT_NEAR(FluxShift(4096), 1.15, 1e-12);  // 1024x1024: 128x128 latents, 64x64 tokens.
  EXPECT_NEAR(FluxShift(2176), 0.825, 1e-12);
  const std::vector<float> plain = FluxSigmas(4, 0.0);  // mu 0: exp(0)/(exp(0) + 1/s − 1) = s.
  ASSERT_EQ(plain.size(), 5u);
  EXPECT_NEAR(plain[0], 1.0f, 1e-6);
  EXPECT_NEAR(plain[1], 0.75f, 1e-6);
  EXPECT_NEAR(plain[3], 0.25f, 1e-6);
  EXPECT_EQ(plain[4], 0.0f);
  const std::vector<float> shifted = FluxSigmas(4, 1.15);
  const double e = std::exp(1.15);
  EXPECT_NEAR(shifted[2], e / (e + (1 / 0.5 - 1)), 1e-6);
  EXPECT_GT(shifted[2], plain[2]);  // A positive shift keeps more noise at every step.
}

}  // namespace
}  // namespace stowage
