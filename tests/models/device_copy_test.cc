// models/core/device_copy.h: small host values reach a device with the same bits, whether filled
// there (all values the same bits) or copied (mixed); -0.0 and +0.0 are different bits. On a GPU
// neither waits for the device's queued work.
#include "models/core/device_copy.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#ifdef STOWAGE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/Sleep.h>
#endif

namespace stowage {
namespace {

std::vector<uint32_t> Bits(const at::Tensor& t) {
  const at::Tensor host = t.cpu().contiguous();
  std::vector<uint32_t> bits(static_cast<size_t>(host.numel()));
  std::memcpy(bits.data(), host.data_ptr<float>(), bits.size() * sizeof(float));
  return bits;
}

std::vector<uint32_t> Bits(const std::vector<float>& values) {
  std::vector<uint32_t> bits(values.size());
  std::memcpy(bits.data(), values.data(), values.size() * sizeof(float));
  return bits;
}

std::vector<c10::Device> Devices() {
  std::vector<c10::Device> devices = {c10::Device(c10::kCPU)};
  if (at::hasCUDA()) devices.emplace_back(c10::kCUDA, 0);
  return devices;
}

TEST(DeviceCopyTest, FloatsKeepTheirBitsFilledOrCopied) {
  for (const c10::Device& device : Devices()) {
    for (const std::vector<float>& values : std::vector<std::vector<float>>{
             {3.5f}, {3.5f, 3.5f, 3.5f}, {3.5f, 1.0f}, {0.0f, -0.0f}, {-0.0f, -0.0f}, {1e-40f, 7.25f, 1e30f}}) {
      const at::Tensor t = FloatsOnDevice(values, device);
      EXPECT_EQ(t.device(), device);
      EXPECT_EQ(t.scalar_type(), at::kFloat);
      EXPECT_EQ(Bits(t), Bits(values)) << device << " " << values.size() << " values";
    }
  }
}

TEST(DeviceCopyTest, AnyTensorArrivesWhole) {
  for (const c10::Device& device : Devices()) {
    const at::Tensor rows = at::tensor(std::vector<int64_t>{2, 0, 1});
    const at::Tensor there = ToDeviceWithoutWaiting(rows, device);
    EXPECT_EQ(there.device(), device);
    EXPECT_TRUE(at::equal(there.cpu(), rows));
    // Already on the device: returned as it is.
    EXPECT_TRUE(at::equal(ToDeviceWithoutWaiting(there, device).cpu(), rows));
  }
}

// On a GPU neither path waits for the work queued before it: a second of a kernel spinning on the
// clock is still running when the values are there (queued behind it, they arrive once it ends).
TEST(DeviceCopyTest, OnAGpuNothingWaitsForTheQueuedWork) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  const char* launch_blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
  if (launch_blocking != nullptr && std::string(launch_blocking) == "1") GTEST_SKIP() << "every launch waits";
#ifdef STOWAGE_WITH_CUDA
  const c10::Device cuda(c10::kCUDA, 0);
  (void)FloatsOnDevice({1.0f, 2.0f}, cuda);  // The first pinned allocation and copy, before the timing.
  at::cuda::sleep(int64_t{2} << 30);
  at::cuda::CUDAEvent queued;
  queued.record();
  const at::Tensor filled = FloatsOnDevice({3.5f, 3.5f}, cuda);
  const at::Tensor copied = FloatsOnDevice({3.5f, 1.0f}, cuda);
  const at::Tensor rows = ToDeviceWithoutWaiting(at::tensor(std::vector<int64_t>{2, 0, 1}), cuda);
  EXPECT_FALSE(queued.query()) << "a copy waited for the device's queued work";
  EXPECT_EQ(Bits(filled), Bits(std::vector<float>{3.5f, 3.5f}));
  EXPECT_EQ(Bits(copied), Bits(std::vector<float>{3.5f, 1.0f}));
  EXPECT_TRUE(at::equal(rows.cpu(), at::tensor(std::vector<int64_t>{2, 0, 1})));
#else
  GTEST_SKIP() << "built without CUDA";
#endif
}

}  // namespace
}  // namespace stowage
