// When a batch waits for more members: the device worker's batching policy on its own (the worker
// collects the members; this decides how long a batch holds the device for them).
//
// A batch key holds a batch open only after it showed concurrent demand — its last batch had several
// members, or ended with more of its kind queued — so a lone client's request (and the first request
// of each new size) starts at once, and clients that send together are gathered for up to the
// pipeline's max_queue_delay. Bounded: at most kMaxKeys keys are remembered (then it forgets all).
//
// Thread-safety: not thread-safe (the worker calls it under its queue's lock).
#ifndef STOWAGE_RUNTIME_BATCH_POLICY_H_
#define STOWAGE_RUNTIME_BATCH_POLICY_H_

#include <cstddef>
#include <set>
#include <string>

#include "absl/time/time.h"

namespace stowage {

class BatchPolicy {
 public:
  static constexpr size_t kMaxKeys = 1024;

  // Until when a batch of `key` about to start at `now` waits for more members: now + `delay` when
  // the key showed concurrent demand, else InfinitePast() (it starts at once).
  absl::Time HoldUntil(const std::string& key, absl::Time now, absl::Duration delay) const;
  // A batch of `key` ran with `members`; `more_queued`: jobs of its key were waiting when it ended.
  void Ran(const std::string& key, size_t members, bool more_queued);
  bool ShowsDemand(const std::string& key) const { return concurrent_keys_.count(key) > 0; }
  size_t remembered() const { return concurrent_keys_.size(); }

 private:
  std::set<std::string> concurrent_keys_;
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_BATCH_POLICY_H_
