#include "base/text.h"

#include "absl/strings/str_cat.h"

namespace stowage {

std::string Truncated(absl::string_view s, size_t max) {
  static constexpr char kHex[] = "0123456789abcdef";
  const absl::string_view kept = s.substr(0, max);
  std::string out;
  out.reserve(kept.size() + 24);
  for (const char c : kept) {
    const auto b = static_cast<unsigned char>(c);
    if (b >= 0x20 && b <= 0x7e && b != '\\') {
      out.push_back(c);
    } else {
      out += "\\x";
      out.push_back(kHex[b >> 4]);
      out.push_back(kHex[b & 0xf]);
    }
  }
  if (kept.size() < s.size()) absl::StrAppend(&out, "…(", s.size(), " bytes)");
  return out;
}

}  // namespace stowage
