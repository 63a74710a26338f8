// Status helpers shared by every layer. Abseil 20220623 (Debian 12) has no ABSL_RETURN_IF_ERROR,
// so the project keeps its own two macros, and the boundary where LibTorch's exceptions become
// absl::Status.
#ifndef STOWAGE_BASE_STATUS_MACROS_H_
#define STOWAGE_BASE_STATUS_MACROS_H_

#include <exception>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define STOWAGE_CONCAT_INNER_(a, b) a##b
#define STOWAGE_CONCAT_(a, b) STOWAGE_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define RETURN_IF_ERROR(expr)                     \
  do {                                            \
    ::absl::Status stowage_status_ = (expr);      \
    if (!stowage_status_.ok()) return stowage_status_; \
  } while (0)

// `ASSIGN_OR_RETURN(auto x, StatusOrExpr());` binds the value or returns the error.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(STOWAGE_CONCAT_(stowage_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return std::move(tmp).status(); \
  lhs = std::move(tmp).value()

namespace stowage {

// Runs `fn` and turns any exception (c10::Error from LibTorch, std::exception) into an absl::Status.
// `what` names the operation for the message. Out-of-memory exceptions become RESOURCE_EXHAUSTED so
// callers can recover from them; everything else is INTERNAL.
absl::Status StatusFromException(const std::exception& e, absl::string_view what);

template <typename Fn>
absl::Status CatchAsStatus(absl::string_view what, Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
    return absl::OkStatus();
  } catch (const std::exception& e) {
    return StatusFromException(e, what);
  }
}

}  // namespace stowage

#endif  // STOWAGE_BASE_STATUS_MACROS_H_
