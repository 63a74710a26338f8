// DeviceSet: the devices of one server and the routing of requests between them.
//
// Each device is a DeviceRuntime: its own backend, worker, queue, budget, placement registry and
// strategy, changed only by its worker (runtime/device_worker.h). A pipeline is loaded onto one or
// more devices (PipelineConfig.devices); each copy is a full replica, and a request goes to the
// READY, non-draining replica with the shortest expected wait: (requests in flight there + 1) ×
// that device's recent run time (an exponential average; a device that has not run yet counts as the
// mean of those that have, 1 s when none has). Batching
// happens per replica (each device batches what it is sent). Draining a device sends new requests
// elsewhere; the ones it accepted finish there.
//
// With one device the same rules apply (draining it refuses new requests); every other behaviour
// and message is DeviceRuntime's.
//
// Thread-safety: every method may be called from any thread but a device worker's.
#ifndef STOWAGE_RUNTIME_DEVICE_SET_H_
#define STOWAGE_RUNTIME_DEVICE_SET_H_

#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "runtime/device_runtime.h"
#include "runtime/metrics.h"
#include "runtime/runtime_factories.h"
#include "stowage/v1/admin.pb.h"
#include "stowage/v1/config.pb.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

class DeviceSet {
 public:
  // `config` must have been through FinalizeServerConfig. Creates every device (ServerConfig.devices,
  // or the one ServerConfig.device) and loads each pipeline onto its devices; any failure fails
  // Create. INVALID_ARGUMENT when two devices have one name or a pipeline names an unknown device.
  // `factories` (runtime/runtime_factories.h) go to every device; `config` must have been finalized
  // against the same registry.
  static absl::StatusOr<std::unique_ptr<DeviceSet>> Create(const v1::ServerConfig& config, ServerMetrics* metrics,
                                                           const RuntimeFactories& factories = {});
  // Releases every device's state, then stops every worker (see DeviceRuntime::ReleaseDeviceState).
  ~DeviceSet();

  // Routes to a replica (see above). NOT_FOUND for an unknown pipeline (DeviceRuntime's message);
  // UNAVAILABLE when every replica's device is draining.
  absl::StatusOr<v1::GenerateResponse> Generate(const v1::GenerateRequest& request, const CallControl& control);
  // One entry per pipeline name: the first replica's description, with `devices` listing all.
  v1::ListPipelinesResponse ListPipelines() const;
  std::string PipelineLabel(const v1::GenerateRequest& request) const;
  // The tenant for metric labels: a tenant listed in scheduler.tenant_weights, "default" for
  // none, "other" for the rest (client input never becomes a label value); and the priority,
  // clamped to 0..9.
  std::string TenantLabel(const v1::GenerateRequest& request) const;
  static int PriorityLabel(const v1::GenerateRequest& request);

  // Loads onto `config.devices` (default: the first device), one replica after the other; if one
  // fails, the replicas already loaded are unloaded again and its error returned.
  absl::StatusOr<v1::Pipeline> LoadPipeline(const v1::PipelineConfig& config, const Interrupt& interrupt);
  // A split pipeline (config.component_devices) loads onto its home device (config.devices' one
  // entry, or the first device) with each listed component on its device; INVALID_ARGUMENT naming
  // the entry for an unknown device, the home device, or an unknown component.
  //
  // Unloads every replica. NOT_FOUND when no device has the pipeline.
  absl::Status UnloadPipeline(const std::string& name, const Interrupt& interrupt);
  // On every replica.
  absl::StatusOr<v1::Pipeline> SetBatching(const std::string& pipeline, const v1::BatchingConfig& batching);
  // Replaces every device's scheduler (AdminService.SetScheduler) and returns it; INVALID_ARGUMENT
  // naming the field (nothing changes then).
  absl::StatusOr<v1::SchedulerConfig> SetScheduler(const v1::SchedulerConfig& scheduler);
  // The scheduler in force.
  v1::SchedulerConfig SchedulerInForce() const;
  // Reads the adapter file once and attaches it on every device hosting the pipeline READY (all or
  // nothing). NOT_FOUND when none does.
  absl::StatusOr<v1::Adapter> LoadAdapter(const v1::LoadAdapterRequest& request, const Interrupt& interrupt);
  // On every replica that has it; NOT_FOUND when none has.
  absl::Status UnloadAdapter(const v1::UnloadAdapterRequest& request, const Interrupt& interrupt);

  // The device named `name` ("" = the first). NOT_FOUND naming the devices there are.
  absl::StatusOr<DeviceRuntime*> Device(const std::string& name) const;
  const std::vector<std::unique_ptr<DeviceRuntime>>& devices() const { return devices_; }

  // Admin MoveComponent: moves one component of a one-device (or split) pipeline to `device`, by
  // the owning workers, between the pipeline's requests (DeviceRuntime::MoveComponent). A
  // pipeline with replicas: FAILED_PRECONDITION.
  absl::StatusOr<v1::MoveComponentResponse> MoveComponent(const v1::MoveComponentRequest& request,
                                                          const Interrupt& interrupt);

  // Marks a device draining (or serving again) and returns every device's status.
  absl::StatusOr<v1::DrainDeviceResponse> Drain(const std::string& device, bool drain);

  // For the metrics: every device's latest snapshot and every replica's lifecycle state.
  std::vector<std::shared_ptr<const PlacementSnapshot>> PlacementSnapshots() const;
  std::vector<PipelineStateView> PipelineStates() const;

 private:
  DeviceSet() = default;
  // A split pipeline's home and the devices of its other components, by component name.
  struct Split {
    DeviceRuntime* home = nullptr;
    std::map<std::string, DeviceRuntime*> remote;
  };
  // INVALID_ARGUMENT naming `field`.component_devices[j].device for an unknown device or the home;
  // returns the component devices.
  static absl::StatusOr<std::vector<std::string>> CheckSplit(const v1::PipelineConfig& p, const std::string& field,
                                                             const std::vector<std::string>& names);
  absl::StatusOr<Split> ResolveSplit(const v1::PipelineConfig& p, const std::string& field) const;
  struct Route {
    absl::Mutex mu;
    bool draining ABSL_GUARDED_BY(mu) = false;
    double recent_run_seconds ABSL_GUARDED_BY(mu) = 1.0;
    bool measured ABSL_GUARDED_BY(mu) = false;  // recent_run_seconds is from runs here, not the prior.
  };
  // The name a request asks for, with "" resolved to the default pipeline (the first device's that
  // has one READY).
  std::string Resolve(const std::string& requested) const;
  v1::DrainDeviceResponse Status() const;

  // The architectures pipelines are built from (RuntimeFactories::Registry()).
  const PipelineRegistry* registry_ = nullptr;
  // The scheduler in force and the tenants of its tenant_weights (metric labels); the queue depth
  // tenant_queue_limit is checked against.
  mutable absl::Mutex scheduler_mu_;
  v1::SchedulerConfig scheduler_ ABSL_GUARDED_BY(scheduler_mu_);
  std::set<std::string> listed_tenants_ ABSL_GUARDED_BY(scheduler_mu_);
  int queue_depth_ = 0;
  std::vector<std::unique_ptr<DeviceRuntime>> devices_;
  std::vector<std::unique_ptr<Route>> routes_;  // Parallel to devices_.
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_DEVICE_SET_H_
