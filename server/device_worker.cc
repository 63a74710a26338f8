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

void DeviceWorker::ReportDepth() {
  if (on_queue_depth_) on_queue_depth_(static_cast<int>(queue_.size()));
}

void DeviceWorker::TakeCancelled(std::vector<Queued>& dropped) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->job.cancelled && it->job.cancelled()) {
      dropped.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
}

absl::Status DeviceWorker::Submit(Job job) {
  std::vector<Queued> dropped;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("server is shutting down");
    if (static_cast<int>(queue_.size()) >= queue_depth_) TakeCancelled(dropped);
    if (static_cast<int>(queue_.size()) >= queue_depth_) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "the request queue of ", device_, " is full (", queue_depth_,
          " waiting); retry later or raise queue_depth in the server config"));
    } else {
      queue_.push_back(Queued{std::move(job), absl::Now()});
    }
    ReportDepth();
  }
  for (Queued& q : dropped) {
    if (q.job.drop) q.job.drop();
  }
  return status;
}

void DeviceWorker::Loop() {
  for (;;) {
    Queued next;
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
      ReportDepth();
    }
    if (next.job.cancelled && next.job.cancelled()) {
      if (next.job.drop) next.job.drop();
    } else {
      next.job.run(absl::Now() - next.enqueued);
    }
  }
}

}  // namespace stowage
