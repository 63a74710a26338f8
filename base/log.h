// The server's log: one line per event on stderr, through Debian's spdlog, as
//   2026-12-02T05:30:01.123+00:00 I request id=req-7 pipeline=zimage status=OK run_s=0.962 ...
// (timestamp with milliseconds and zone, level letter I/W/E, then the event and its key=value
// fields, logfmt style, for operators to grep and parse). Thread-safe.
//
//   LogInfo(absl::StrCat("load pipeline=", LogValue(name), " outcome=ready seconds=", s));
#ifndef STOWAGE_BASE_LOG_H_
#define STOWAGE_BASE_LOG_H_

#include <string>

#include "absl/strings/string_view.h"

namespace stowage {

void LogInfo(absl::string_view line);
void LogWarning(absl::string_view line);
void LogError(absl::string_view line);

// A value for a key=value field: printable ASCII without spaces, quotes or backslashes as it is;
// anything else quoted ("...") with quotes and backslashes escaped and other bytes outside printable
// ASCII as \xHH; at most `max_bytes` of it, then "...(N bytes)" (client input never floods a line).
std::string LogValue(absl::string_view value, size_t max_bytes = 128);

}  // namespace stowage

#endif  // STOWAGE_BASE_LOG_H_
