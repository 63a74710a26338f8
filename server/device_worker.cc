#include "server/device_worker.h"

#include "absl/strings/str_cat.h"

namespace stowage {

DeviceWorker::DeviceWorker(std::string device, int queue_depth,
                           std::function<void(int)> on_queue_depth)
    : device_(std::move(device)),
      queue_depth_(queue_depth),
      on_queue_depth_(std::move(on_queue_depth)) {
  thread_ = std::thread([this] { Loop(); });
}

DeviceWorker::~DeviceWorker() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
}

absl::Status DeviceWorker::Submit(Job job) {
  int depth = 0;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("server is shutting down");
    if (static_cast<int>(queue_.size()) >= queue_depth_) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the request queue of ", device_, " is full (", queue_depth_,
          " waiting); retry later or raise queue_depth in the server config"));
    }
    queue_.push_back(Queued{std::move(job), absl::Now()});
    depth = static_cast<int>(queue_.size());
  }
  if (on_queue_depth_) on_queue_depth_(depth);
  return absl::OkStatus();
}

void DeviceWorker::Loop() {
  for (;;) {
    Queued next;
    int depth = 0;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](DeviceWorker* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->stopping_ || !w->queue_.empty();
          },
          this));
      if (queue_.empty()) return;
      next = std::move(queue_.front());
      queue_.pop_front();
      depth = static_cast<int>(queue_.size());
    }
    if (on_queue_depth_) on_queue_depth_(depth);
    next.job(absl::Now() - next.enqueued);
  }
}

}  // namespace stowage
