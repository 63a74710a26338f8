#include "base/process_memory.h"

#include <fstream>
#include <sstream>
#include <string>

namespace stowage {

absl::StatusOr<ProcessMemory> ReadProcessMemory() {
  std::ifstream status("/proc/self/status");
  if (!status) return absl::UnavailableError("cannot read /proc/self/status");
  ProcessMemory memory;
  bool have_rss = false;
  bool have_hwm = false;
  std::string line;
  while (std::getline(status, line)) {
    std::istringstream fields(line);
    std::string key;
    int64_t kib = 0;
    fields >> key >> kib;
    if (key == "VmRSS:") {
      memory.rss_bytes = kib * 1024;
      have_rss = true;
    } else if (key == "VmHWM:") {
      memory.peak_rss_bytes = kib * 1024;
      have_hwm = true;
    }
  }
  if (!have_rss || !have_hwm) return absl::UnavailableError("no VmRSS/VmHWM in /proc/self/status");
  return memory;
}

absl::Status ResetPeakRss() {
  std::ofstream clear("/proc/self/clear_refs");
  if (!clear) return absl::UnavailableError("cannot open /proc/self/clear_refs");
  clear << "5";
  clear.flush();
  if (!clear) return absl::UnavailableError("writing /proc/self/clear_refs failed");
  return absl::OkStatus();
}

}  // namespace stowage
