#include "base/text.h"

#include "absl/strings/str_cat.h"

namespace stowage {

std::string Truncated(absl::string_view s, size_t max_bytes) {
  const absl::string_view kept = s.substr(0, max_bytes);
  std::string out;
  out.reserve(kept.size() + 24);
  for (char c : kept) {
    const auto byte = static_cast<unsigned char>(c);
    out.push_back(byte >= 0x20 && byte <= 0x7e ? c : '?');
  }
  if (kept.size() < s.size()) absl::StrAppend(&out, "...(", s.size(), " bytes)");
  return out;
}

}  // namespace stowage
