// Text that goes into error messages. Messages never echo unbounded input (a 1 MB pipeline name
// comes back as its first bytes and a length) and never carry bytes that would garble a log line
// or a terminal.
#ifndef STOWAGE_BASE_TEXT_H_
#define STOWAGE_BASE_TEXT_H_

#include <cstddef>
#include <string>

#include "absl/strings/string_view.h"

namespace stowage {

// At most `max_bytes` of `s`, with every byte outside printable ASCII replaced by '?', followed by
// "...(N bytes)" when `s` was longer.
std::string Truncated(absl::string_view s, size_t max_bytes = 64);

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool IsValidUtf8(absl::string_view s);

}  // namespace stowage

#endif  // STOWAGE_BASE_TEXT_H_
