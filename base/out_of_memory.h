// The one out-of-memory error type of every device backend.
#ifndef STOWAGE_BASE_OUT_OF_MEMORY_H_
#define STOWAGE_BASE_OUT_OF_MEMORY_H_

#include <cstdint>
#include <stdexcept>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace stowage {

// Payload URL that marks an absl::Status as a device out-of-memory error (as opposed to any other
// RESOURCE_EXHAUSTED, such as a full queue). Placement's OOM recovery looks for it.
inline constexpr absl::string_view kDeviceOomPayload = "type.stowage.dev/DeviceOutOfMemory";

absl::Status MakeDeviceOomStatus(absl::string_view message);
bool IsDeviceOom(const absl::Status& status);

// A request that cannot fit on its device whatever else moves off it (every other component
// evicted, its own weights streamed): OUT_OF_RANGE, which clients do not retry (HTTP 400
// "insufficient_device_memory"), unlike a full queue (RESOURCE_EXHAUSTED, HTTP 429 with Retry-After).
inline constexpr absl::string_view kCannotFitPayload = "type.stowage.dev/CannotFit";
absl::Status MakeCannotFitStatus(absl::string_view message);
bool IsCannotFit(const absl::Status& status);

// Thrown from inside a forward pass (where errors travel as exceptions, like LibTorch's own) when
// the device cannot satisfy an allocation. Converted to a status by StatusFromException.
class DeviceOutOfMemory : public std::runtime_error {
 public:
  DeviceOutOfMemory(std::string device, int64_t requested_bytes, int64_t in_use_bytes,
                    int64_t budget_bytes);
  int64_t requested_bytes() const { return requested_bytes_; }
  absl::Status ToStatus() const { return MakeDeviceOomStatus(what()); }

 private:
  int64_t requested_bytes_;
};

}  // namespace stowage

#endif  // STOWAGE_BASE_OUT_OF_MEMORY_H_
