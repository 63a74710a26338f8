// Safetensors files: writing, and zero-copy reading through a read-only mmap.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the tensor data. The JSON is parsed and written by protobuf's JSON support.
//
// A tensor returned by SafetensorsFile::Get points into the mapping (no copy) and keeps it alive;
// the memory is read-only: writing through such a tensor faults.
//
// Untrusted input: the header is checked completely before anything is trusted, in time linear in
// its size. Limits (kSafetensorsHeaderLimits in base/json_limits.h and below): header at most
// 100,000,000 bytes (the reference implementation's cap), JSON nesting at most 8 deep (real headers
// nest 3), at most kMaxSafetensorsTensors tensors of rank at most kMaxSafetensorsRank. Every shape
// dimension and offset must be a JSON number that is an integer in [0, 2^53]; dtype size × shape
// must equal the tensor's byte span (computed with overflow checks); spans lie inside the data
// section and do not overlap. Every violation is INVALID_ARGUMENT naming the file and the tensor
// (cut to a short prefix by Truncated(), base/text.h), never quoting the header's JSON.
#ifndef STOWAGE_OFFLOAD_SAFETENSORS_H_
#define STOWAGE_OFFLOAD_SAFETENSORS_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace stowage {

inline constexpr int64_t kMaxSafetensorsTensors = int64_t{1} << 20;
inline constexpr int64_t kMaxSafetensorsRank = 16;

struct SafetensorsTensorInfo {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t begin = 0;  // Byte offsets within the data section.
  int64_t end = 0;
};

// A parsed and validated header.
struct SafetensorsHeader {
  std::map<std::string, SafetensorsTensorInfo> tensors;
  std::map<std::string, std::string> metadata;
};

// Parses and validates the header JSON `json` of a file whose data section holds `data_bytes` bytes.
// `what` names the source in errors (e.g. "safetensors file '<path>'").
absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json, int64_t data_bytes,
                                                         absl::string_view what);
// The same for a whole file image in memory (8-byte length, header, data): the entry point of the
// fuzz target, and what Open runs on its mapping.
absl::StatusOr<SafetensorsHeader> ParseSafetensorsBytes(absl::string_view bytes, absl::string_view what);

// Writes `tensors` (CPU, any layout; written contiguous) to `path` atomically (temp file + rename).
absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata = {});

class SafetensorsFile {
 public:
  using TensorInfo = SafetensorsTensorInfo;

  // Maps and validates the file (ParseSafetensorsBytes): header size, JSON, dtypes, shapes against
  // byte ranges, ranges inside the file. Errors name the file and the tensor.
  static absl::StatusOr<std::shared_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::map<std::string, TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Zero-copy view of a tensor; NOT_FOUND for an unknown name.
  absl::StatusOr<at::Tensor> Get(const std::string& name);
  // The mapped data section, e.g. to register it with the device as read-only pinned memory.
  const uint8_t* data() const { return data_; }
  int64_t data_bytes() const { return data_bytes_; }
  void* mapping() const { return mapping_; }
  int64_t mapping_bytes() const { return mapping_bytes_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* mapping_ = nullptr;
  int64_t mapping_bytes_ = 0;
  const uint8_t* data_ = nullptr;
  int64_t data_bytes_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::weak_ptr<SafetensorsFile> self_;
};

// Drops this process's page-table entries for the whole pages of [ptr, ptr + bytes) that lie in a
// live SafetensorsFile mapping (read-only, shared: madvise MADV_DONTNEED). The page cache keeps the
// data and a later read maps it again; RSS stops counting those pages. For callers that copied the
// bytes elsewhere (e.g. into pinned memory) and will not read the mapping soon. Returns the bytes
// dropped: 0 for memory that is not such a mapping (never touched).
int64_t ReleaseMappedPages(const void* ptr, int64_t bytes);

// "F32" ↔ at::kFloat etc.; INVALID_ARGUMENT for a dtype this project does not handle.
absl::StatusOr<at::ScalarType> SafetensorsDtype(const std::string& name);
std::string SafetensorsDtypeName(at::ScalarType dtype);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_SAFETENSORS_H_
