// Process memory figures from the kernel, for per-request peak CPU RSS.
//
// Mechanism: Linux keeps the process's peak resident set size as VmHWM in /proc/self/status, and
// writing "5" to /proc/self/clear_refs resets that peak to the current RSS (Linux 4.0+). Requests on
// a device run one at a time, so resetting at request start and reading VmHWM at the end gives the
// peak RSS of the process while that request ran. getrusage's ru_maxrss cannot be reset, and
// sampling VmRSS from a thread would miss short peaks.
#ifndef STOWAGE_BASE_PROCESS_MEMORY_H_
#define STOWAGE_BASE_PROCESS_MEMORY_H_

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace stowage {

struct ProcessMemory {
  int64_t rss_bytes = 0;       // VmRSS.
  int64_t peak_rss_bytes = 0;  // VmHWM.
};

absl::StatusOr<ProcessMemory> ReadProcessMemory();
// Resets VmHWM to the current RSS. Fails where /proc/self/clear_refs is not writable.
absl::Status ResetPeakRss();

// Transparent huge pages: the mode the kernel runs them in, from
// /sys/kernel/mm/transparent_hugepage/enabled ("always [madvise] never": the bracketed word).
// "always", "madvise" or "never"; "" where the file is missing or holds no bracketed mode.
std::string TransparentHugePageMode();
std::string ParseTransparentHugePageMode(absl::string_view enabled_file);
// True where a region advised MADV_HUGEPAGE gets huge pages: the mode is "always" or "madvise".
bool TransparentHugePagesOn();

}  // namespace stowage

#endif  // STOWAGE_BASE_PROCESS_MEMORY_H_
