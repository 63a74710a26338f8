#include "models/core/device_copy.h"

#include <algorithm>
#include <cstdint>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "absl/base/casts.h"

namespace stowage {

at::Tensor ToDeviceWithoutWaiting(const at::Tensor& host, const c10::Device& device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  at::Tensor pinned;
  try {
    pinned = host.pin_memory();
  } catch (const c10::Error&) {
    return host.to(device);  // The host would not pin a few bytes more: the copy waits, as before.
  }
  return pinned.to(device, /*non_blocking=*/true);
}

at::Tensor FloatsOnDevice(const std::vector<float>& values, const c10::Device& device) {
  const auto n = static_cast<int64_t>(values.size());
  const auto same = [&](float v) { return absl::bit_cast<uint32_t>(v) == absl::bit_cast<uint32_t>(values.front()); };
  if (n > 0 && std::all_of(values.begin(), values.end(), same)) {
    return at::full({n}, values.front(), at::TensorOptions().dtype(at::kFloat).device(device));
  }
  return ToDeviceWithoutWaiting(at::tensor(values), device);
}

}  // namespace stowage
