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

std::string ParseTransparentHugePageMode(absl::string_view enabled_file) {
  const size_t open = enabled_file.find('[');
  if (open == absl::string_view::npos) return "";
  const size_t close = enabled_file.find(']', open);
  if (close == absl::string_view::npos) return "";
  return std::string(enabled_file.substr(open + 1, close - open - 1));
}

std::string TransparentHugePageMode() {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string contents;
  if (!file || !std::getline(file, contents)) return "";
  return ParseTransparentHugePageMode(contents);
}

bool TransparentHugePagesOn() {
  const std::string mode = TransparentHugePageMode();
  return mode == "always" || mode == "madvise";
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
