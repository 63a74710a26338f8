#include "base/status_macros.h"

#include <new>
#include <string>

#include "base/out_of_memory.h"

namespace stowage {

absl::Status StatusFromException(const std::exception& e, absl::string_view what) {
  if (const auto* oom = dynamic_cast<const DeviceOutOfMemory*>(&e)) {
    return oom->ToStatus();
  }
  if (dynamic_cast<const std::bad_alloc*>(&e) != nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat(what, ": host out of memory"));
  }
  std::string message = e.what();
  // LibTorch's CUDA allocator reports "CUDA out of memory" in a c10::Error (OutOfMemoryError from
  // 1.13 on); match the text so this file needs no CUDA headers.
  if (message.find("out of memory") != std::string::npos) {
    return MakeDeviceOomStatus(absl::StrCat(what, ": ", message.substr(0, 500)));
  }
  // c10::Error appends a long backtrace after the first line; keep the first line only.
  const size_t newline = message.find('\n');
  if (newline != std::string::npos) message.resize(newline);
  return absl::InternalError(absl::StrCat(what, ": ", message));
}

}  // namespace stowage
