// Ordering actions in tests of the runtime and of the in-process server without sleeping: wait for a
// state the runtime reports — requests running on a device, requests queued, a pipeline's
// lifecycle — read from its DeviceSet (whatever the devices are: sim:0 on CI, cuda:0 on the GPU host).
#ifndef STOWAGE_TESTS_RUNTIME_RUNTIME_STATE_H_
#define STOWAGE_TESTS_RUNTIME_RUNTIME_STATE_H_

#include <string>

#include "absl/time/clock.h"
#include "runtime/device_set.h"

namespace stowage {

// Requests the devices' workers run now (DeviceRuntime::running), summed over the devices.
inline int RunningRequests(const DeviceSet& devices) {
  int n = 0;
  for (const auto& device : devices.devices()) n += device->running();
  return n;
}

// Requests waiting in the devices' queues, summed.
inline int QueuedRequests(const DeviceSet& devices) {
  int n = 0;
  for (const auto& device : devices.devices()) n += device->waiting().jobs;
  return n;
}

// The lifecycle state `name` is listed in (PIPELINE_STATE_UNSPECIFIED when not listed).
inline v1::PipelineState StateOf(const DeviceSet& devices, const std::string& name) {
  const v1::ListPipelinesResponse list = devices.ListPipelines();
  for (const v1::Pipeline& p : list.pipelines()) {
    if (p.name() == name) return p.state();
  }
  return v1::PIPELINE_STATE_UNSPECIFIED;
}

// Waits until `ready()` holds (polling a state; it orders nothing by time); false after `timeout`.
template <typename Predicate>
bool AwaitState(Predicate ready, absl::Duration timeout = absl::Seconds(60)) {
  for (const absl::Time give_up = absl::Now() + timeout; !ready();) {
    if (absl::Now() > give_up) return false;
    absl::SleepFor(absl::Milliseconds(2));
  }
  return true;
}

}  // namespace stowage

#endif  // STOWAGE_TESTS_RUNTIME_RUNTIME_STATE_H_
