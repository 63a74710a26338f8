#include "base/json_limits.h"

#include "absl/strings/str_cat.h"

namespace stowage {

absl::Status CheckJsonLimits(absl::string_view json, const JsonLimits& limits, absl::string_view what) {
  if (static_cast<int64_t>(json.size()) > limits.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": JSON of ", json.size(), " bytes exceeds the limit of ",
                                                   limits.max_bytes, " bytes"));
  }
  int depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < json.size(); ++i) {
    const char c = json[i];
    if (in_string) {
      if (c == '\\') {
        ++i;  // Skip the escaped character (a \uXXXX's digits are plain characters).
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    switch (c) {
      case '"':
        in_string = true;
        break;
      case '{':
      case '[':
        if (++depth > limits.max_depth) {
          return absl::InvalidArgumentError(absl::StrCat(what, ": JSON nests deeper than ", limits.max_depth,
                                                         " levels at byte offset ", i));
        }
        break;
      case '}':
      case ']':
        // Unbalanced closers are the parser's to report; only the depth matters here.
        if (depth > 0) --depth;
        break;
      default:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace stowage
