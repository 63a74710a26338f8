// libFuzzer target: a safetensors file image (8-byte length, header JSON, data) through
// ParseSafetensorsBytes, the parser SafetensorsFile::Open runs on its mapping. Any input must give
// OK or INVALID_ARGUMENT quickly, never a crash; an accepted header must satisfy the invariants that
// Get() relies on (spans inside the data, byte size = dtype × shape, no overlap).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "offload/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto header = stowage::ParseSafetensorsBytes(bytes, "fuzz input");
  if (!header.ok()) {
    if (header.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(data[i]) << (8 * i);
  const int64_t data_bytes = static_cast<int64_t>(size - 8 - header_len);  // Accepted: header_len <= size - 8.
  std::vector<std::pair<int64_t, int64_t>> spans;
  for (const auto& [name, info] : header->tensors) {
    if (info.begin < 0 || info.end < info.begin || info.end > data_bytes) std::abort();
    const bool empty = std::find(info.shape.begin(), info.shape.end(), 0) != info.shape.end();
    int64_t needed = empty ? 0 : static_cast<int64_t>(c10::elementSize(info.dtype));
    for (int64_t d : info.shape) {
      if (d < 0) std::abort();
      if (!empty) needed *= d;  // The parser checked this product for overflow.
    }
    if (info.end - info.begin != needed) std::abort();
    if (info.end > info.begin) spans.emplace_back(info.begin, info.end);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i].first < spans[i - 1].second) std::abort();
  }
  return 0;
}
