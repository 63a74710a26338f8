// A fresh directory for spill files (offload/host_spill.h) on a disk: under the test's temporary
// directory unless that is a tmpfs or ramfs (which SpillHeapTensors refuses), else under the working
// directory; an absolute path (as /proc/self/maps names files). Empty when neither can hold one.
#ifndef STOWAGE_TESTS_OFFLOAD_SPILL_DIR_H_
#define STOWAGE_TESTS_OFFLOAD_SPILL_DIR_H_

#include <limits.h>
#include <stdlib.h>

#include <fstream>
#include <string>

#include "offload/host_spill.h"

namespace stowage {

inline std::string MakeSpillTestDir() {
  // TEST_TMPDIR: Bazel's (and the CMake build's ctest) private temporary directory, else TMPDIR, else
  // /tmp. No gtest here: a helper library that links gtest ahead of a test's gmock_main breaks static
  // links (CMake build).
  const char* tmp = ::getenv("TEST_TMPDIR");
  if (tmp == nullptr || *tmp == '\0') tmp = ::getenv("TMPDIR");
  if (tmp == nullptr || *tmp == '\0') tmp = "/tmp";
  for (const std::string& base : {std::string(tmp), std::string(".")}) {
    if (base.empty() || OnRamFilesystem(base)) continue;
    std::string dir = base + "/spill.XXXXXX";
    if (::mkdtemp(dir.data()) == nullptr) continue;
    char absolute[PATH_MAX];
    return ::realpath(dir.c_str(), absolute) != nullptr ? std::string(absolute) : dir;
  }
  return "";
}

// This process's mappings of spill files created in `dir` (removed ones included): the host copies that
// view them.
inline int CountSpillMappings(const std::string& dir) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  int mappings = 0;
  while (std::getline(maps, line)) mappings += line.find(dir + "/stowage-spill-") != std::string::npos;
  return mappings;
}

}  // namespace stowage

#endif  // STOWAGE_TESTS_OFFLOAD_SPILL_DIR_H_
