#include "models/core/config_checks.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

namespace stowage {
namespace {

constexpr int64_t kSaturated = std::numeric_limits<int64_t>::max();

int64_t SaturatingMul(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_mul_overflow(a, b, &out) ? kSaturated : out;
}

int64_t SaturatingAdd(int64_t a, int64_t b) {
  int64_t out = 0;
  return __builtin_add_overflow(a, b, &out) ? kSaturated : out;
}

}  // namespace

void ConfigCheck::Fail(absl::string_view field, absl::string_view why) {
  if (status_.ok()) status_ = absl::InvalidArgumentError(absl::StrCat(file_, ": ", field, " ", why));
}

ConfigCheck& ConfigCheck::Range(absl::string_view field, int64_t value, int64_t min, int64_t max) {
  if (ok() && (value < min || value > max)) {
    Fail(field, absl::StrCat("is ", value, "; must be in [", min, ", ", max, "]"));
  }
  return *this;
}

ConfigCheck& ConfigCheck::Divides(absl::string_view field, int64_t value, absl::string_view of_field, int64_t of) {
  if (ok() && (value < 1 || of % value != 0)) {
    Fail(field, absl::StrCat("is ", value, "; must be >= 1 and divide ", of_field, " (", of, ")"));
  }
  return *this;
}

ConfigCheck& ConfigCheck::MultipleOf(absl::string_view field, int64_t value, absl::string_view of_field,
                                     int64_t of) {
  if (ok() && (of < 1 || value % of != 0)) {
    Fail(field, absl::StrCat("is ", value, "; must be a multiple of ", of_field, " (", of, ")"));
  }
  return *this;
}

ConfigCheck& ConfigCheck::Even(absl::string_view field, int64_t value) {
  if (ok() && value % 2 != 0) Fail(field, absl::StrCat("is ", value, "; must be even"));
  return *this;
}

ConfigCheck& ConfigCheck::Equals(absl::string_view field, int64_t value, absl::string_view expected_field,
                                 int64_t expected) {
  if (ok() && value != expected) {
    Fail(field, absl::StrCat("is ", value, "; must equal ", expected_field, " (", expected, ")"));
  }
  return *this;
}

ConfigCheck& ConfigCheck::Above(absl::string_view field, double value, double min, double max) {
  if (ok() && !(std::isfinite(value) && value > min && value <= max)) {
    Fail(field, absl::StrCat("is ", value, "; must be finite, > ", min, " and <= ", max));
  }
  return *this;
}

ConfigCheck& ConfigCheck::Between(absl::string_view field, double value, double min, double max) {
  if (ok() && !(std::isfinite(value) && value >= min && value <= max)) {
    Fail(field, absl::StrCat("is ", value, "; must be finite and in [", min, ", ", max, "]"));
  }
  return *this;
}

ConfigCheck& ConfigCheck::Require(bool condition, absl::string_view field, absl::string_view why) {
  if (ok() && !condition) Fail(field, why);
  return *this;
}

void ParameterCount::Add(std::initializer_list<int64_t> factors) {
  int64_t product = 1;
  for (int64_t f : factors) product = SaturatingMul(product, f < 0 ? 0 : f);
  total_ = SaturatingAdd(total_, product);
}

void ParameterCount::AddTimes(int64_t times, const ParameterCount& other) {
  total_ = SaturatingAdd(total_, SaturatingMul(times < 0 ? 0 : times, other.total_));
}

absl::Status ParameterCount::Check(absl::string_view file, int64_t max) const {
  if (total_ > max) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": the config describes ",
                                                   total_ == kSaturated ? std::string("over 2^63")
                                                                        : absl::StrCat(total_),
                                                   " parameters; at most ", max, " are accepted"));
  }
  return absl::OkStatus();
}

}  // namespace stowage
