// Safe echoing of untrusted text in messages: names that came from a file (tensor names, component
// names, dtype labels, class names) are cut to a short prefix and their non-printable bytes escaped,
// so an error message stays short and printable whatever the file held.
#ifndef STOWAGE_BASE_TEXT_H_
#define STOWAGE_BASE_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace stowage {

// `s` when it is at most `max` bytes of printable ASCII; otherwise its first `max` bytes with every
// byte outside 0x20..0x7e (and the backslash) written as \xNN, followed by "…(N bytes)" when it was
// cut. The result is at most 4 * max + 24 bytes of printable ASCII (plus the ellipsis' UTF-8).
//   Truncated("conv_in.weight")          == "conv_in.weight"
//   Truncated(std::string(1000, 'a'), 4) == "aaaa…(1000 bytes)"
std::string Truncated(absl::string_view s, size_t max = 64);

}  // namespace stowage

#endif  // STOWAGE_BASE_TEXT_H_
