#include "models/core/conv_lane.h"

#include <exception>

#include <ATen/ThreadLocalState.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace stowage {
namespace {

thread_local ConvLane* this_threads_lane = nullptr;

}  // namespace

void ConvLane::SetForThisThread(ConvLane* lane) { this_threads_lane = lane; }

ConvLane* ConvLane::ForThisThread() { return this_threads_lane; }

ConvLane::~ConvLane() {
  absl::MutexLock turn(&turn_mu_);
  EndThread();
}

void ConvLane::EndThread() {
  if (!thread_.joinable()) return;
  {
    absl::MutexLock lock(&mu_);
    end_ = true;
  }
  thread_.join();
  absl::MutexLock lock(&mu_);
  end_ = false;
}

void ConvLane::StartThread() {
  thread_ = std::thread([this] { Loop(); });
  absl::MutexLock lock(&mu_);
  ++threads_started_;
}

void ConvLane::Loop() {
  for (;;) {
    const std::function<void()>* task = nullptr;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](ConvLane* lane) ABSL_NO_THREAD_SAFETY_ANALYSIS { return lane->task_ != nullptr || lane->end_; }, this));
      if (task_ == nullptr) return;  // Ended (a task is never pending then: its caller holds the turn).
      task = task_;
    }
    (*task)();  // Catches whatever the caller's function throws (Run's wrapper).
    absl::MutexLock lock(&mu_);
    task_ = nullptr;
    finished_ = true;
    ++runs_;
  }
}

void ConvLane::Run(const std::function<void()>& fn) {
  // The caller's thread-local state (grad and inference modes, dispatch keys, autocast, profiler),
  // set again around fn on the lane's thread.
  const at::ThreadLocalState state;
  std::exception_ptr error;
  const std::function<void()> task = [&] {
    try {
      at::ThreadLocalStateGuard guard(state);
      fn();
    } catch (...) {
      error = std::current_exception();
    }
  };
  {
    absl::MutexLock turn(&turn_mu_);
    if (!thread_.joinable()) StartThread();
    absl::MutexLock lock(&mu_);
    finished_ = false;
    task_ = &task;
    mu_.Await(absl::Condition(&finished_));
  }
  if (error) std::rethrow_exception(error);
}

void ConvLane::RunOn(const c10::Device& device, const std::function<void()>& fn) {
  if (device.is_cpu()) {
    Run(fn);
    return;
  }
  // The stream the caller's work on `device` is queued on (its current one): the convolution's
  // kernels go after what the caller queued before it, and what it queues next goes after them.
  const c10::Stream stream = c10::impl::getDeviceGuardImpl(device.type())->getStream(device);
  Run([&] {
    c10::StreamGuard guard(stream);
    fn();
  });
}

void ConvLane::Renew() {
  absl::MutexLock turn(&turn_mu_);
  if (!thread_.joinable()) return;  // None yet: the first run starts a fresh one anyway.
  EndThread();
  StartThread();
}

int ConvLane::threads_started() const {
  absl::MutexLock lock(&mu_);
  return threads_started_;
}

int64_t ConvLane::runs() const {
  absl::MutexLock lock(&mu_);
  return runs_;
}

}  // namespace stowage
