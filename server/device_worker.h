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

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace stowage {

class DeviceWorker {
 public:
  // Called on the worker thread with the time the job waited in the queue.
  using Job = std::function<void(absl::Duration queue_wait)>;

  // `on_queue_depth` (optional) is called with the number of waiting jobs whenever it changes.
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
