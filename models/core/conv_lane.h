// A device's convolutions on a thread of their own.
//
// LibTorch keeps the cuDNN convolution plan it chose per thread and shape; a plan chosen while memory
// was short (its workspace refused, a slower plan taken instead) stays on that thread (multi-tenant
// run 13: +0.13 s a Z-Image decode from then on). Going on on a fresh thread drops it — but the same
// thread also holds every attention graph cuDNN built for it (per thread and shape too), so renewing
// the device's worker thread made the next run of every pipeline build those again (multi-tenant
// run 16: its 38 first runs of a pipeline after a renewal took +0.074 s at the median, up to +0.432 s,
// in prompt encoding + denoising — `multi_tenant.py analyze`). A ConvLane runs the convolutions of the threads it
// is installed on (Conv2d::Forward asks ForThisThread) on a thread of its own, so a renewal replaces
// that thread only: the plans it drops are the convolutions'.
//
// Run hands a function to the lane's thread and waits for it: the caller's thread-local LibTorch state
// goes with it (at::ThreadLocalState: grad and inference modes, dispatch keys, autocast, profiler) and,
// with RunOn, the caller's current stream on that device — device work goes through RunOn, or it would
// queue on the lane thread's own current stream; what it throws is rethrown to the caller. One function
// at a time: callers from several threads take turns. The caller waits throughout, so on a device's
// worker the lane computes for the worker (an ATen op on tensors the worker handed it) and touches no
// placement or backend state of its own.
#ifndef STOWAGE_MODELS_CORE_CONV_LANE_H_
#define STOWAGE_MODELS_CORE_CONV_LANE_H_

#include <cstdint>
#include <functional>
#include <thread>

#include <c10/core/Device.h>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"

namespace stowage {

class ConvLane {
 public:
  ConvLane() = default;
  ~ConvLane();
  ConvLane(const ConvLane&) = delete;
  ConvLane& operator=(const ConvLane&) = delete;

  // Runs fn on the lane's thread (started on first use) and returns once it has; rethrows what fn
  // threw.
  void Run(const std::function<void()>& fn) ABSL_LOCKS_EXCLUDED(turn_mu_, mu_);
  // Run, with the caller's current stream of `device` current on the lane's thread too (a CPU
  // device has none to carry).
  void RunOn(const c10::Device& device, const std::function<void()>& fn) ABSL_LOCKS_EXCLUDED(turn_mu_, mu_);

  // The lane goes on on a fresh thread now: the current one ends (whatever it cached with it) once
  // the function it runs, if any, has returned. Before the first run: nothing to renew.
  void Renew() ABSL_LOCKS_EXCLUDED(turn_mu_, mu_);

  // Threads started so far (the first, at the first run, then one for each Renew after it).
  int threads_started() const ABSL_LOCKS_EXCLUDED(mu_);
  // Functions run so far.
  int64_t runs() const ABSL_LOCKS_EXCLUDED(mu_);

  // The lane of the calling thread's convolutions (nullptr: they run where they are called).
  static void SetForThisThread(ConvLane* lane);
  static ConvLane* ForThisThread();

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  // Starts the lane's thread (none running) and counts it.
  void StartThread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(turn_mu_) ABSL_LOCKS_EXCLUDED(mu_);
  // Ends the lane's thread, if any, and waits for it.
  void EndThread() ABSL_EXCLUSIVE_LOCKS_REQUIRED(turn_mu_) ABSL_LOCKS_EXCLUDED(mu_);

  // Held by the caller whose function is handed over, from handing it to its end: callers take turns,
  // and only the caller holding it starts or ends the thread.
  absl::Mutex turn_mu_ ABSL_ACQUIRED_BEFORE(mu_);
  std::thread thread_ ABSL_GUARDED_BY(turn_mu_);

  mutable absl::Mutex mu_;
  const std::function<void()>* task_ ABSL_GUARDED_BY(mu_) = nullptr;  // The function to run now.
  bool finished_ ABSL_GUARDED_BY(mu_) = false;                         // task_ ran.
  bool end_ ABSL_GUARDED_BY(mu_) = false;                              // The thread should return.
  int threads_started_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t runs_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_CONV_LANE_H_
