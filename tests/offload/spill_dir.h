// A fresh directory for spill files (offload/host_spill.h) on a disk: under the test's temporary
// directory unless that is a tmpfs or ramfs (which SpillHeapTensors refuses), else under the working
// directory; an absolute path (as /proc/self/maps names files). Empty when neither can hold one.
#ifndef STOWAGE_TESTS_OFFLOAD_SPILL_DIR_H_
#define STOWAGE_TESTS_OFFLOAD_SPILL_DIR_H_

#include <limits.h>
#include <linux/magic.h>
#include <stdlib.h>
#include <sys/vfs.h>

#include <string>

#include <gtest/gtest.h>

namespace stowage {

inline std::string MakeSpillTestDir() {
  auto on_ram = [](const std::string& dir) {
    struct statfs fs;
    return ::statfs(dir.c_str(), &fs) == 0 && (fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC);
  };
  for (std::string base : {::testing::TempDir(), std::string(".")}) {
    if (base.empty() || on_ram(base)) continue;
    std::string dir = base + "/spill.XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) continue;
    char absolute[PATH_MAX];
    return ::realpath(dir.c_str(), absolute) != nullptr ? std::string(absolute) : dir;
  }
  return "";
}

}  // namespace stowage

#endif  // STOWAGE_TESTS_OFFLOAD_SPILL_DIR_H_
