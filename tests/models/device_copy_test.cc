// models/core/device_copy.h: small host values reach a device with the same bits, whether filled
// there (all values the same bits) or copied (mixed); -0.0 and +0.0 are different bits. On a GPU the
// copies do not wait for the device's queued work.
#include "models/core/device_copy.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace stowage
