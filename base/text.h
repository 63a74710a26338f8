// Text that came from outside (a client's request, a config file) and goes back out in a message or
// a log line: cut to a short printable prefix, so an error never echoes a megabyte or raw control
// bytes.
#ifndef STOWAGE_BASE_TEXT_H_
#define STOWAGE_BASE_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace stowage {

// `s` with every byte outside printable ASCII (0x20..0x7e) replaced by '?', cut to its first
// `max_bytes` bytes; a cut string ends in "...(N bytes)" with N the length of `s`.
//   Truncated("tiny") == "tiny"
//   Truncated(std::string(100, 'a'), 4) == "aaaa...(100 bytes)"
std::string Truncated(absl::string_view s, size_t max_bytes = 64);

}  // namespace stowage

#endif  // STOWAGE_BASE_TEXT_H_
