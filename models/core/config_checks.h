// Building blocks of the architecture-config validators (Validate(const XConfig&, file) next to each
// config's parser): range, divisibility and float checks that stop at the first failure, and an
// overflow-safe parameter count. A config is validated completely before any tensor is built, so a
// hostile config.json gets INVALID_ARGUMENT naming the file and the field instead of a SIGFPE (an
// integer division by a zero size), an exception from LibTorch, or a terabyte allocation.
//
// Limits (documented here, used by every validator):
//   kMaxConfigDim        no size (width, channels, vocabulary, head dim, table length) above 2^20;
//   kMaxConfigLayers     no layer or block count above 1024;
//   kMaxConfigPatch      patch sizes in [1, 64];
//   kMaxConfigParameters a whole component at most 2^36 (68.7e9) parameters: 137 GB in bfloat16,
//                        more than any single diffusion component and far below what would
//                        overflow the byte counts. Counted with saturating arithmetic.
//
// Usage:
//   ConfigCheck check(file);
//   check.Size("dim", c.dim).Size("n_heads", c.n_heads).Divides("n_heads", c.n_heads, "dim", c.dim);
//   RETURN_IF_ERROR(check.status());
#ifndef STOWAGE_MODELS_CORE_CONFIG_CHECKS_H_
#define STOWAGE_MODELS_CORE_CONFIG_CHECKS_H_

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace stowage {

inline constexpr int64_t kMaxConfigDim = int64_t{1} << 20;
inline constexpr int64_t kMaxConfigLayers = 1024;
inline constexpr int64_t kMaxConfigPatch = 64;
inline constexpr int64_t kMaxConfigParameters = int64_t{1} << 36;

// Collects the first failure; later checks are skipped once one failed (so a divisibility check
// never runs on a size that already failed its range check). Messages:
// "<file>: <field> is <value>; must be ...".
class ConfigCheck {
 public:
  explicit ConfigCheck(std::string file) : file_(std::move(file)) {}

  // value in [min, max].
  ConfigCheck& Range(absl::string_view field, int64_t value, int64_t min, int64_t max);
  // A size: value in [1, max].
  ConfigCheck& Size(absl::string_view field, int64_t value, int64_t max = kMaxConfigDim) {
    return Range(field, value, 1, max);
  }
  // value >= 1 and divides `of` (named `of_field`).
  ConfigCheck& Divides(absl::string_view field, int64_t value, absl::string_view of_field, int64_t of);
  // value is a multiple of `of` (named `of_field`; of >= 1, else this fails too).
  ConfigCheck& MultipleOf(absl::string_view field, int64_t value, absl::string_view of_field, int64_t of);
  // value is even.
  ConfigCheck& Even(absl::string_view field, int64_t value);
  // value == expected (e.g. two configs that must agree), `expected_field` naming the other.
  ConfigCheck& Equals(absl::string_view field, int64_t value, absl::string_view expected_field, int64_t expected);
  // value finite and in (min, max] (min exclusive: e.g. eps > 0).
  ConfigCheck& Above(absl::string_view field, double value, double min, double max);
  // value finite and in [min, max].
  ConfigCheck& Between(absl::string_view field, double value, double min, double max);
  // Fails with "<file>: <field> <why>" unless `ok`.
  ConfigCheck& Require(bool ok, absl::string_view field, absl::string_view why);

  bool ok() const { return status_.ok(); }
  const absl::Status& status() const { return status_; }
  const std::string& file() const { return file_; }

 private:
  void Fail(absl::string_view field, absl::string_view why);
  std::string file_;
  absl::Status status_;
};

// Parameter (element) count of a config, saturating at INT64_MAX instead of overflowing.
class ParameterCount {
 public:
  // Adds the product of `factors` (each >= 0).
  void Add(std::initializer_list<int64_t> factors);
  // Adds `times` × the count of `other`.
  void AddTimes(int64_t times, const ParameterCount& other);
  int64_t total() const { return total_; }
  // OK, or INVALID_ARGUMENT "<file>: the config describes more than <max> parameters".
  absl::Status Check(absl::string_view file, int64_t max = kMaxConfigParameters) const;

 private:
  int64_t total_ = 0;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_CONFIG_CHECKS_H_
