#include "runtime/batch_policy.h"

namespace stowage {

absl::Time BatchPolicy::HoldUntil(const std::string& key, absl::Time now, absl::Duration delay) const {
  return ShowsDemand(key) ? now + delay : absl::InfinitePast();
}

void BatchPolicy::Ran(const std::string& key, size_t members, bool more_queued) {
  if (members > 1 || more_queued) {
    if (concurrent_keys_.size() >= kMaxKeys && concurrent_keys_.count(key) == 0) concurrent_keys_.clear();
    concurrent_keys_.insert(key);
  } else {
    concurrent_keys_.erase(key);
  }
}

}  // namespace stowage
