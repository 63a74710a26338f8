#include "runtime/batch_policy.h"

#include <algorithm>

namespace stowage {

absl::Time BatchPolicy::HoldUntil(const std::string& key, absl::Time now, absl::Duration delay) const {
  return ShowsDemand(key) ? now + delay : absl::InfinitePast();
}

size_t BatchPolicy::Gathered(const std::string& key) const {
  const auto it = demand_.find(key);
  return it == demand_.end() ? 0 : it->second;
}

void BatchPolicy::Ran(const std::string& key, size_t members, size_t queued) {
  if (members > 1 || queued > 0) {
    if (demand_.size() >= kMaxKeys && demand_.count(key) == 0) demand_.clear();
    size_t& demand = demand_[key];  // 0 when new.
    demand = std::max(demand, members + queued);
  } else {
    demand_.erase(key);
  }
}

}  // namespace stowage
