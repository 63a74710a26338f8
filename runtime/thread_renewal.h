// When a device's convolutions go on on a fresh thread (their lane, models/core/conv_lane.h; the
// worker asks before each item through DeviceWorker::Options::renew_thread) after out-of-memory errors
// its allocator raised. LibTorch caches a cuDNN convolution plan per thread and
// shape; when a plan's workspace cannot be allocated it takes the first plan whose workspace fits and
// keeps that one on the thread, slower from then on (multi-tenant run 13: +0.13 s a Z-Image request
// after its first such error). A fresh thread chooses its plans again — worth it only when the room
// is back: where memory stays short the fresh thread would choose short again, and rebuilding every
// plan costs its first item time. So:
//   - errors counted since the last look make a renewal pending, with the largest refusal of the
//     latest request that had them;
//   - a pending renewal happens once that refusal fits in the device's free room now;
//   - a renewal whose first item ran short again doubles the items to wait before the next (up to
//     kMaxGap), a quiet first item resets the wait to one.
// Pure bookkeeping over the numbers it is given; the worker calls it, one thread at a time.
#ifndef STOWAGE_RUNTIME_THREAD_RENEWAL_H_
#define STOWAGE_RUNTIME_THREAD_RENEWAL_H_

#include <cstdint>
#include <string>

namespace stowage {

class ThreadRenewalPolicy {
 public:
  static constexpr int kMaxGap = 64;

  // Called before each item after the first on a thread, with the allocator's cumulative
  // out-of-memory count, the largest allocation it refused in the last request's window (0: none)
  // and the device's free room now (INT64_MAX without a budget). Returns why the device's convolutions
  // (without their lane: the worker) should go on on a fresh thread now ("" for not now); the caller
  // renews whenever it is not empty.
  std::string Next(int64_t ooms, int64_t largest_refused_bytes, int64_t free_bytes);

  int gap() const { return gap_; }
  // Whether the last Next found the fresh thread's first item short of memory again (it doubled the
  // gap): the room, not the plans, is what is missing — the caller may make more of it (the device
  // runtime widens the spare-room caches' margin: PlacementManager::WidenCacheMarginForShortRoom).
  bool fresh_thread_ran_short() const { return fresh_thread_ran_short_; }
  // Errors seen since the last renewal wait for one.
  bool pending() const { return pending_errors_ > 0; }

 private:
  int64_t seen_ooms_ = -1;      // The count at the last look (-1: none yet).
  int64_t pending_errors_ = 0;  // Errors seen since the last renewal.
  int64_t pending_refused_ = 0; // The largest refusal of the latest look that saw errors.
  bool renewed_ = false;        // A renewal happened (its first item's outcome adjusts gap_).
  bool fresh_thread_ran_short_ = false;  // See fresh_thread_ran_short().
  int looks_since_renewal_ = 0;
  int gap_ = 1;                 // Looks after a renewal before the next may happen.
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_THREAD_RENEWAL_H_
