// DeviceWorker: the request queue of one device. Jobs run one at a time, in arrival order, on the
// worker's own thread, so a request's peak device memory and peak RSS are its own. A bounded
// queue: Submit fails with RESOURCE_EXHAUSTED when `queue_depth` jobs are already waiting.
//
// Thread-safety: Submit may be called from any thread.
#ifndef STOWAGE_SERVER_DEVICE_WORKER_H_
#define STOWAGE_SERVER_DEVICE_WORKER_H_

#include <deque>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace stowage {

class DeviceWorker {
 public:
  struct Job {
    // Called on the worker thread with the time the job waited in the queue.
    std::function<void(absl::Duration queue_wait)> run;
    // Optional: true once the job's caller has gone (cancelled, deadline passed). A cancelled job
    // gives up its place: it is dropped when it reaches the front, or when a new job finds the
    // queue full.
    std::function<bool()> cancelled;
    // Called instead of `run` for a dropped job (on the worker or the submitting thread).
    std::function<void()> drop;
  };

  // `on_queue_depth` (optional) is called, under the queue's lock so reports never go stale, with the
  // number of waiting jobs whenever it changes. It must be quick and must not call Submit.
  DeviceWorker(std::string device, int queue_depth, std::function<void(int)> on_queue_depth);
  // Runs the jobs already queued, then stops.
  ~DeviceWorker();

  const std::string& device() const { return device_; }
  absl::Status Submit(Job job);

 private:
  struct Queued {
    Job job;
    absl::Time enqueued;
  };
  void Loop();
  // Moves cancelled jobs out of the queue into `dropped`.
  void TakeCancelled(std::vector<Queued>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void ReportDepth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::string device_;
  const int queue_depth_;
  std::function<void(int)> on_queue_depth_;
  absl::Mutex mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_DEVICE_WORKER_H_
