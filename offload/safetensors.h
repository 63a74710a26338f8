// Safetensors files: writing, and zero-copy reading through a read-only mmap.
//
// Format: 8-byte little-endian header length N, N bytes of JSON
// {"<name>": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, "__metadata__": {...}},
// then the tensor data. The JSON is parsed and written by protobuf's JSON support.
//
// A tensor returned by SafetensorsFile::Get points into the mapping (no copy) and keeps it alive;
// the memory is read-only: writing through such a tensor faults.
//
// Files that change under a live mapping. The mapping is MAP_SHARED, so it sees the file as it is
// now, not as it was at Open:
//   - replaced by rename (mv new old, WriteSafetensors) or removed: safe. The mapping keeps the old
//     inode alive and reads the old data; CheckUnchanged() stays OK.
//   - rewritten in place (cp new old: O_TRUNC, then write): reads past the new end of the file
//     would raise SIGBUS and kill the process. A process-wide SIGBUS handler, installed by the first
//     Open, maps zero pages over the rest of the mapping instead, so the faulting thread (a memcpy,
//     a LibTorch kernel) carries on reading zeros, and marks the file damaged. CheckUnchanged()
//     reports FAILED_PRECONDITION for a damaged file and for one whose size or mtime changed since
//     Open; callers check before and after using the data and discard what they computed from it.
// The handler chains to the previous SIGBUS disposition for every other address. At most
// kMaxGuardedMappings mappings are guarded at a time (beyond that, Open warns once and a fault
// there is fatal as before).
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
  // F8_E4M3 tensors (float8 e4m3fn, which this LibTorch has no type for) are kByte with
  // `float8_e4m3` set: their bytes are the e4m3fn bit patterns (offload/compressed_safetensors.h
  // reads them as fp8 checkpoints).
  at::ScalarType dtype;
  bool float8_e4m3 = false;
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

// The same format written to an open file descriptor from its current offset (e.g. a file created
// and removed at once, which only the descriptor and its mappings then hold), its blocks reserved
// first (fallocate) and written back by the kernel later — or, where the file takes no reservation (a
// filesystem without fallocate, a device), fdatasync'd before returning. The
// header is padded with spaces so that the data section starts at a multiple of `data_align` bytes
// from the file's start (a power of two, at least 8: INVALID_ARGUMENT otherwise; the format's 8 by
// default). RESOURCE_EXHAUSTED naming `what` when the reservation or a write fails (disk full, I/O
// error).
absl::Status WriteSafetensorsToDescriptor(int fd, const std::string& what,
                                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                          const std::map<std::string, std::string>& metadata = {},
                                          int64_t data_align = 8);

class SafetensorsFile {
 public:
  using TensorInfo = SafetensorsTensorInfo;

  // Maps and validates the file (ParseSafetensorsBytes): header size, JSON, dtypes, shapes against
  // byte ranges, ranges inside the file. Errors name the file and the tensor.
  static absl::StatusOr<std::shared_ptr<SafetensorsFile>> Open(const std::string& path);
  // Open for a file already open as `fd` (read access; the caller keeps and closes it: the mapping
  // outlives it); `path` names it in errors and in CheckUnchanged (a removed path counts as unchanged).
  static absl::StatusOr<std::shared_ptr<SafetensorsFile>> OpenDescriptor(int fd, const std::string& path);
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

  // OK while the data seen through the mapping is still the data of Open: the file at path() is
  // the same inode with the same size and mtime, or is another file or none (renamed over or
  // removed: the mapping keeps the old inode). FAILED_PRECONDITION naming the file when it was
  // changed in place or a read of the mapping faulted (damaged()):
  //   "model file '/m/transformer/x.safetensors' changed on disk after it was loaded (size 1234 → 0);
  //    unload and load the pipeline again"
  // Thread-safe; one stat() call.
  absl::Status CheckUnchanged() const;
  // True once a read of the mapping faulted (the file shrank under it) and the SIGBUS handler
  // replaced the rest of the mapping with zero pages. Never goes back to false. Thread-safe.
  bool damaged() const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  // Identity at Open, for CheckUnchanged.
  uint64_t dev_ = 0;
  uint64_t ino_ = 0;
  int64_t mtime_ns_ = 0;
  // Slot in the SIGBUS handler's table; -1 when the table was full (unguarded).
  int guard_slot_ = -1;
  void* mapping_ = nullptr;
  int64_t mapping_bytes_ = 0;
  const uint8_t* data_ = nullptr;
  int64_t data_bytes_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
  std::weak_ptr<SafetensorsFile> self_;

  friend std::vector<std::shared_ptr<const SafetensorsFile>> MappedFilesContaining(
      const std::vector<const void*>& addresses);
};

// Drops this process's page-table entries for the whole pages of [ptr, ptr + bytes) that lie in a
// live SafetensorsFile mapping (read-only, shared: madvise MADV_DONTNEED). The page cache keeps the
// data and a later read maps it again; RSS stops counting those pages. For callers that copied the
// bytes elsewhere (e.g. into pinned memory) and will not read the mapping soon. Returns the bytes
// dropped: 0 for memory that is not such a mapping (never touched).
int64_t ReleaseMappedPages(const void* ptr, int64_t bytes);

// The live SafetensorsFile mappings holding any of `addresses`, each once, in order of first
// appearance. Addresses outside every mapping (heap, pinned memory) are skipped. For checking the
// files that host tensors are still views of (HostWeights::CheckSourceFiles). Thread-safe.
std::vector<std::shared_ptr<const SafetensorsFile>> MappedFilesContaining(
    const std::vector<const void*>& addresses);

// How many mappings the SIGBUS handler can guard at once.
inline constexpr int kMaxGuardedMappings = 32768;

// "F32" ↔ at::kFloat etc.; INVALID_ARGUMENT for a dtype this project does not handle.
absl::StatusOr<at::ScalarType> SafetensorsDtype(const std::string& name);
std::string SafetensorsDtypeName(at::ScalarType dtype);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_SAFETENSORS_H_
