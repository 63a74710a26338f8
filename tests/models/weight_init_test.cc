#include "models/core/weight_init.h"

#include <cmath>
#include <memory>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/core/layers.h"

namespace stowage {
namespace {

class Holder : public Module {
 public:
  Holder(int64_t in, int64_t out, at::ScalarType dtype) : Module("Holder") {
    LayerOptions options;
    options.dtype = dtype;
    linear = AddChild("proj", std::make_unique<Linear>(in, out, /*bias=*/true, options));
  }
  Linear* linear;
};

// A weight larger than the drawn block (2^20 values) tiles it, in bfloat16 and float32: the same
// seed gives the same weight, another seed another, and the scale is 1 / sqrt(fan_in).
TEST(WeightInitTest, LargeWeightsTileTheDrawnValues) {
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const int64_t in = 1536, out = 1000;  // 1.536 M values: one whole tile and part of a second.
    Holder a(in, out, dtype), b(in, out, dtype), c(in, out, dtype);
    InitializeRandomWeights(a, 7);
    InitializeRandomWeights(b, 7);
    InitializeRandomWeights(c, 8);
    const at::Tensor w = a.linear->slots()[0].value;
    ASSERT_EQ(w.sizes(), (at::IntArrayRef{out, in}));
    EXPECT_TRUE(at::equal(w, b.linear->slots()[0].value));
    EXPECT_FALSE(at::equal(w, c.linear->slots()[0].value));
    // The tiles repeat the first one (the last only in part); the seed decides them.
    const int64_t drawn = int64_t{1} << 20;
    const at::Tensor flat = w.reshape({-1});
    EXPECT_TRUE(at::equal(flat.slice(0, drawn, w.numel()), flat.slice(0, 0, w.numel() - drawn)));
    EXPECT_NE(flat[0].item<float>(), flat[1].item<float>());
    // Rounding comes last: the bfloat16 weight is the float32 one rounded (scaled first, then rounded).
    if (dtype == at::kBFloat16) {
      Holder f(in, out, at::kFloat);
      InitializeRandomWeights(f, 7);
      EXPECT_TRUE(at::equal(w, f.linear->slots()[0].value.to(at::kBFloat16)));
    }
    // Scale: 1 / sqrt(fan_in).
    const double std = w.to(at::kFloat).std().item<double>();
    EXPECT_NEAR(std * std::sqrt(static_cast<double>(in)), 1.0, 0.05) << dtype;
  }
}

}  // namespace
}  // namespace stowage
