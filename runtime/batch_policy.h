// When a batch waits for more members: the device worker's batching policy on its own (the worker
// collects the members; this decides how long a batch holds the device for them).
//
// A batch key holds a batch open only after it showed concurrent demand — its last batch had several
// members, or ended with more of its kind queued — so a lone client's request (and the first request
// of each new size) starts at once, and clients that send together are gathered for up to the
// pipeline's max_queue_delay. A held batch starts before its delay is over once it has gathered the
// most its key ever had at once since its demand began — a batch's members plus those queued when it
// ended (Gathered): clients that sent together and came back together start at once, so a closed
// loop of N clients in step runs batches of N without paying the delay each time; fewer wait the
// delay out, as before, and demand resets only with a lone batch.
// Bounded: at most kMaxKeys keys are remembered (then it forgets all).
//
// Thread-safety: not thread-safe (the worker calls it under its queue's lock).
#ifndef STOWAGE_RUNTIME_BATCH_POLICY_H_
#define STOWAGE_RUNTIME_BATCH_POLICY_H_

#include <cstddef>
#include <map>
#include <string>

#include "absl/time/time.h"

namespace stowage {

class BatchPolicy {
 public:
  static constexpr size_t kMaxKeys = 1024;

  // Until when a batch of `key` about to start at `now` waits for more members: now + `delay` when
  // the key showed concurrent demand, else InfinitePast() (it starts at once).
  absl::Time HoldUntil(const std::string& key, absl::Time now, absl::Duration delay) const;
  // A batch of `key` ran with `members`; `queued`: jobs of its key waiting when it ended.
  void Ran(const std::string& key, size_t members, size_t queued);
  bool ShowsDemand(const std::string& key) const { return demand_.count(key) > 0; }
  // The members at which a held batch of `key` starts without waiting out its delay: the most of its
  // batches' members plus those queued when each ended, since its demand began; 0 without demand.
  size_t Gathered(const std::string& key) const;
  size_t remembered() const { return demand_.size(); }

 private:
  std::map<std::string, size_t> demand_;  // Keys that showed demand → Gathered.
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_BATCH_POLICY_H_
