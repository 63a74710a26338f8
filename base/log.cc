#include "base/log.h"

#include <memory>

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace stowage {
namespace {

spdlog::logger& Logger() {
  static spdlog::logger* logger = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
    auto* l = new spdlog::logger("stowage", sink);
    l->set_pattern("%Y-%m-%dT%H:%M:%S.%e%z %L %v");
    l->set_level(spdlog::level::info);
    l->flush_on(spdlog::level::info);  // A line is on stderr before the call returns.
    return l;
  }();
  return *logger;
}

// spdlog's level letters are lower case ('i'); operators read I/W/E.
void Write(spdlog::level::level_enum level, absl::string_view line) {
  Logger().log(level, "{}", std::string(line));
}

}  // namespace

void LogInfo(absl::string_view line) { Write(spdlog::level::info, line); }
void LogWarning(absl::string_view line) { Write(spdlog::level::warn, line); }
void LogError(absl::string_view line) { Write(spdlog::level::err, line); }

std::string LogValue(absl::string_view value, size_t max_bytes) {
  const absl::string_view kept = value.substr(0, max_bytes);
  bool plain = !kept.empty();
  for (char c : kept) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u >= 0x7f || c == '"' || c == '\\' || c == '=') plain = false;
  }
  std::string out;
  if (plain) {
    out = std::string(kept);
  } else {
    out = "\"";
    for (char c : kept) {
      const auto u = static_cast<unsigned char>(c);
      if (c == '"' || c == '\\') {
        absl::StrAppend(&out, "\\", std::string(1, c));
      } else if (u < 0x20 || u >= 0x7f) {
        absl::StrAppend(&out, absl::StrFormat("\\x%02x", u));
      } else {
        out.push_back(c);
      }
    }
    out += "\"";
  }
  if (value.size() > max_bytes) absl::StrAppend(&out, "...(", value.size(), " bytes)");
  return out;
}

}  // namespace stowage
