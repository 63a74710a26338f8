// Reading a whole untrusted file whose size is bounded: the size is checked before any byte is read.
#ifndef STOWAGE_BASE_BOUNDED_READ_H_
#define STOWAGE_BASE_BOUNDED_READ_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace stowage {

// The bytes of the regular file `path`, at most `max_bytes` of them. NOT_FOUND "cannot read
// '<path>'" when it cannot be opened; INVALID_ARGUMENT "'<path>' is not a regular file", or
// "<path>: N bytes exceeds the limit of M bytes" before reading.
absl::StatusOr<std::string> ReadFileAtMost(const std::string& path, int64_t max_bytes);

}  // namespace stowage

#endif  // STOWAGE_BASE_BOUNDED_READ_H_
