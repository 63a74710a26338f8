#include "base/bounded_read.h"

#include <sys/stat.h>

#include <fstream>
#include <iterator>

#include "absl/strings/str_cat.h"

namespace stowage {

absl::StatusOr<std::string> ReadFileAtMost(const std::string& path, int64_t max_bytes) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a regular file"));
  if (st.st_size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": ", st.st_size, " bytes exceeds the limit of ", max_bytes, " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::string bytes;
  bytes.reserve(static_cast<size_t>(st.st_size));
  // At most max_bytes + 1 bytes even if the file grew since stat: a longer read is refused.
  char buffer[1 << 16];
  while (in.read(buffer, sizeof(buffer)), in.gcount() > 0) {
    bytes.append(buffer, static_cast<size_t>(in.gcount()));
    if (static_cast<int64_t>(bytes.size()) > max_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(path, ": more than ", max_bytes, " bytes"));
    }
  }
  if (in.bad()) return absl::DataLossError(absl::StrCat("error reading '", path, "'"));
  return bytes;
}

}  // namespace stowage
