#include "base/out_of_memory.h"

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"

namespace stowage {

absl::Status MakeDeviceOomStatus(absl::string_view message) {
  absl::Status status = absl::ResourceExhaustedError(message);
  status.SetPayload(kDeviceOomPayload, absl::Cord("1"));
  return status;
}

absl::Status MakeCannotFitStatus(absl::string_view message) {
  absl::Status status = absl::OutOfRangeError(
      absl::StrCat(message, "; this request cannot fit on this device (retrying will not help: ask for a smaller "
                            "image or batch, or serve it from a device with more memory)"));
  status.SetPayload(kCannotFitPayload, absl::Cord("1"));
  return status;
}

bool IsCannotFit(const absl::Status& status) {
  return status.code() == absl::StatusCode::kOutOfRange && status.GetPayload(kCannotFitPayload).has_value();
}

bool IsDeviceOom(const absl::Status& status) {
  return status.code() == absl::StatusCode::kResourceExhausted &&
         status.GetPayload(kDeviceOomPayload).has_value();
}

DeviceOutOfMemory::DeviceOutOfMemory(std::string device, int64_t requested_bytes,
                                     int64_t in_use_bytes, int64_t budget_bytes)
    : std::runtime_error(absl::StrCat(device, " out of memory: tried to allocate ", requested_bytes,
                                      " bytes with ", in_use_bytes, " of ", budget_bytes,
                                      " bytes in use")),
      requested_bytes_(requested_bytes) {}

}  // namespace stowage
