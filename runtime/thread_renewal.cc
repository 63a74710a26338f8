#include "runtime/thread_renewal.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace stowage {

std::string ThreadRenewalPolicy::Next(int64_t ooms, int64_t largest_refused_bytes, int64_t free_bytes) {
  const bool grew = seen_ooms_ >= 0 && ooms > seen_ooms_;
  const int64_t errors = grew ? ooms - seen_ooms_ : 0;
  seen_ooms_ = ooms;
  ++looks_since_renewal_;
  // The fresh thread's first item: short again means the room, not the plans, is what is missing.
  const bool first_on_fresh_thread = renewed_ && looks_since_renewal_ == 1;
  fresh_thread_ran_short_ = first_on_fresh_thread && grew;
  if (first_on_fresh_thread) gap_ = grew ? std::min(gap_ * 2, kMaxGap) : 1;
  if (grew) {
    pending_errors_ += errors;
    // The latest shortfall's: one larger than any room (a request no budget holds) must not hold
    // back the renewal a later, passing one calls for.
    pending_refused_ = largest_refused_bytes;
  }
  if (!pending() || looks_since_renewal_ < gap_ || pending_refused_ > free_bytes) return "";
  // A size of 0: the errors' request window was reset before the look (a failed run's retry opens
  // its own), so no size holds the renewal back.
  std::string reason =
      pending_refused_ > 0
          ? absl::StrCat(pending_errors_, " allocator out-of-memory errors, the largest refusal ", pending_refused_,
                         " bytes, now within the free room")
          : absl::StrCat(pending_errors_, " allocator out-of-memory errors (the refused size not kept past their run)");
  pending_errors_ = 0;
  pending_refused_ = 0;
  renewed_ = true;
  looks_since_renewal_ = 0;
  return reason;
}

}  // namespace stowage
