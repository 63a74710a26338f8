// DeviceRuntime: the transport-free runtime of one device. It owns the device (its backend, its
// placement registry and the worker thread that alone changes them) and composes the units that do
// the rest: the hosted pipelines and their lifecycles (HostedPipelines), request checks
// (ValidateRequest), the queue, scheduler and batch former (DeviceWorker, Scheduler, BatchPolicy),
// the request executor (RequestExecutor: runs requests and batches on the worker, measures them,
// assembles replies), LoRA adapters (AdapterTable) and the links to other devices (PeerLinks).
// What it does itself: building and loading pipelines, unloading them, moving components between
// devices, admin changes as worker tasks, descriptions. Knows protobuf messages, not gRPC. DeviceSet
// holds a server's devices and routes between them.
//
// Ownership model (ARCHITECTURE.md, "Who may change device state"): the backend and the
// PlacementManager are touched only by the device's worker (runtime/device_worker.h), and the type
// says so: they are reached through Placement(scope) / Backend(scope), which take the WorkerScope
// the worker hands its jobs, tasks and calls, as do the private methods that change device state.
// Requests are
// jobs on that worker; every change to device state — registering or removing a pipeline's
// components, group offload, strategies — is a task posted with ChangeDevice (or by
// LoadPipeline/UnloadPipeline), which runs between requests and which the caller waits for with
// its own deadline. Readers on other threads (admin views, the metrics scrape) use
// placement_snapshot(), published by the worker after every job and task.
//
// Split layout (PipelineConfig.component_devices): a pipeline homed here may run some components
// on other devices of the server (peers, other DeviceRuntimes). Those components are registered
// with the peer's placement and every run of them executes on the peer's worker through its
// remote-call lane (DeviceWorker::Call), from this device's worker during the request's job; the
// pipeline moves tensors between the devices (ComponentRunner::DeviceOf). Registry changes for a
// split pipeline (load, unload, MoveComponent) are tasks on the home worker that make calls to the
// peers, so they land between the pipeline's requests. Peers must outlive the split pipelines that
// name them (DeviceSet owns all devices and releases them in two phases: ReleaseDeviceState on
// every device, then StopWorker).
//
// Thread-safety: every public method may be called from any thread except the worker's.
#ifndef STOWAGE_RUNTIME_DEVICE_RUNTIME_H_
#define STOWAGE_RUNTIME_DEVICE_RUNTIME_H_

#include <atomic>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "models/pipelines/component.h"
#include "base/load_progress.h"
#include "models/core/conv_lane.h"
#include "models/core/layers.h"
#include "models/core/lora.h"
#include "models/pipelines/pipeline.h"
#include "offload/device_backend.h"
#include "placement/placement_manager.h"
#include "runtime/adapter_table.h"
#include "runtime/device_worker.h"
#include "runtime/hosted_pipelines.h"
#include "runtime/metrics.h"
#include "runtime/peer_links.h"
#include "runtime/request_executor.h"
#include "runtime/runtime_factories.h"
#include "stowage/v1/config.pb.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// What the scheduler's residency order weighs (DeviceWorker::Options::move_bytes): the bytes running
// `pipeline` now would copy onto the device, from a placement snapshot — its whole components that
// are on the host (adapters aside: they move only for the requests that name them), plus, for each of
// its group-offloaded components, what one forward copies (bytes_per_forward) less what its
// spare-room cache spares (cache_link_bytes; DeviceConfig.streamed_group_cache), so a pipeline whose
// streamed groups stayed on the device weighs less than one whose groups all stream. Once the
// pipeline has run (one of its own, unshared components has; with none, one of its shared ones), a
// component on the host that never ran (an image encoder only image-to-image requests use) does not
// count: the next request most likely does not run it either (so a pipeline can move "nothing",
// which preemption asks for).
int64_t PipelineMoveBytes(const PlacementSnapshot& snapshot, const std::string& pipeline);

class DeviceRuntime {
 public:
  // `config` must have been through FinalizeServerConfig. `metrics` may be null. Loads every
  // configured pipeline; any failure fails Create.
  // `factories`: the pipeline registry and backend to use (runtime/runtime_factories.h; defaults:
  // every architecture of this build, the backend the device config names).
  static absl::StatusOr<std::unique_ptr<DeviceRuntime>> Create(const v1::ServerConfig& config,
                                                               ServerMetrics* metrics,
                                                               const RuntimeFactories& factories = {});
  ~DeviceRuntime();

  absl::StatusOr<v1::GenerateResponse> Generate(const v1::GenerateRequest& request,
                                                const CallControl& control);
  v1::ListPipelinesResponse ListPipelines() const;

  // The pipeline name for metric labels: a hosted pipeline's name, or "unknown" (so client input
  // never becomes a label value).
  std::string PipelineLabel(const v1::GenerateRequest& request) const;

  // Loads `config` (validated like the config file's) on this thread, then registers its
  // components on the worker. ALREADY_EXISTS for a name that is loading or loaded;
  // FAILED_PRECONDITION for one being unloaded. If `interrupt` fires before the worker took the
  // registration, nothing remains; a load that fails after it started leaves the name FAILED (with
  // the error) until it is loaded again or unloaded.
  absl::StatusOr<v1::Pipeline> LoadPipeline(const v1::PipelineConfig& config, const Interrupt& interrupt);
  // The same for a split pipeline homed here: `remote` maps component names to the peer devices
  // that run them (DeviceSet resolves config.component_devices; none may be this device).
  // INVALID_ARGUMENT naming pipeline.component_devices when a name is not one of its components.
  absl::StatusOr<v1::Pipeline> LoadPipeline(const v1::PipelineConfig& config, const Interrupt& interrupt,
                                            const std::map<std::string, DeviceRuntime*>& remote,
                                            bool make_default);

  // Moves `component` of the READY pipeline `pipeline` (homed here) to `to` (this device or a
  // peer): a task on this worker, between the pipeline's requests, that unregisters it where it is
  // and registers it on `to`, each by the owning worker. NOT_FOUND for an unknown component;
  // FAILED_PRECONDITION when the pipeline is not READY, the component is already on `to`, is
  // shared with another pipeline, or is group-offloaded. Returns the pipeline's description.
  absl::StatusOr<v1::Pipeline> MoveComponent(const std::string& pipeline, const std::string& component,
                                             DeviceRuntime* to, const Interrupt& interrupt);

  // Runs `fn` — one run (or, with `prefetch_only`, the Prefetch hint) of `component`, a component of
  // a split pipeline homed on another device — on this device's worker, through its remote-call
  // lane, with the calling thread's LibTorch thread-local state (inference mode). `caller` is the
  // scope of the home device's worker, which serves its own lane while it waits. Placement decisions are
  // recorded under `request_id`. Adds this device's peak and copied bytes during the run to
  // `usage`. UNAVAILABLE when this device is stopping; `interrupt`'s status when the caller went
  // before the run started.
  absl::Status RunForPeer(Component& component, const std::function<void()>& fn, bool prefetch_only,
                          const std::string& request_id, WorkerScope* caller, const Interrupt& interrupt,
                          v1::DeviceUsage* usage);

  // The other devices of the server (DeviceSet, once all exist, before split pipelines load):
  // targets of peer eviction (DeviceConfig.peer_bandwidth_bytes_per_second).
  void SetPeers(std::vector<DeviceRuntime*> peers);
  // The peer that runs `component` of hosted pipeline `pipeline`, or null when it runs here.
  DeviceRuntime* PeerFor(const std::string& pipeline, const Component& component) const;

  // Shutdown in two phases (DeviceSet's destructor): removes every pipeline's components, and other
  // devices' split components hosted here, from placement (a task; split pipelines homed here call
  // their peers, which must still run); then StopWorker stops the worker (remote calls still
  // waiting for it fail with UNAVAILABLE).
  void ReleaseDeviceState();
  void StopWorker();
  // Stops accepting requests for `name`; requests already accepted run first, then the worker
  // removes its components. If `interrupt` fires before that, the pipeline is READY again.
  absl::Status UnloadPipeline(const std::string& name, const Interrupt& interrupt);

  // Every adapter loaded on this device's pipelines (GetPlacement lists them).
  std::vector<v1::Adapter> Adapters() const;

  // LoRA adapters (AdminService.LoadAdapter / UnloadAdapter): `file` (models/core/lora.h) is
  // attached, unmerged, to the Linear layers it names in the READY pipeline `pipeline`'s components,
  // its matrices on this device in each component's dtype, on the worker between requests.
  // INVALID_ARGUMENT naming the layer for one the pipeline lacks or of another shape (nothing is
  // attached then); ALREADY_EXISTS for a name in use; FAILED_PRECONDITION for a split pipeline.
  absl::StatusOr<v1::Adapter> LoadAdapter(const std::string& pipeline, const std::string& name,
                                          const std::string& path, const LoraFile& file, const Interrupt& interrupt);
  // NOT_FOUND when the pipeline has no such adapter.
  absl::Status UnloadAdapter(const std::string& pipeline, const std::string& name, const Interrupt& interrupt);

  // Sets a READY pipeline's dynamic batching (validated like the config's); requests submitted
  // afterwards batch under it. NOT_FOUND for a pipeline that is not READY.
  absl::StatusOr<v1::Pipeline> SetBatching(const std::string& pipeline, const v1::BatchingConfig& batching);
  // Replaces the worker's scheduler (`scheduler` validated by CheckSchedulerConfig).
  void SetScheduler(const v1::SchedulerConfig& scheduler);

  // Sets the server config's strategy (validated against the component names registered here),
  // printing its warnings. Create does it, after the pipelines loaded, unless DeviceSet does it
  // later (once split pipelines have registered their components on every device). `also_known`:
  // component names on the server's other devices, which rules may name too (one strategy config
  // serves every device; a split pipeline has some of its components on each); `also_known_ids`:
  // their ids, which footprint.keep_resident may name.
  absl::Status ApplyStrategy(const v1::OffloadStrategy& strategy, const std::vector<std::string>& also_known = {},
                             const std::vector<std::string>& also_known_ids = {});

  // Runs `change` on the device's worker between requests and returns its status (exceptions
  // become INTERNAL). If `interrupt` fires before it started, it never runs.
  absl::Status ChangeDevice(const std::function<absl::Status(PlacementManager&)>& change,
                            const Interrupt& interrupt);

  // What the worker published after its last job or task.
  std::shared_ptr<const PlacementSnapshot> placement_snapshot() const;
  // The newest `limit` placement decisions (safe from any thread).
  std::vector<PlacementDecision> DecisionLog(size_t limit) const;
  // Each hosted pipeline's lifecycle state, for metrics.
  std::vector<PipelineStateView> PipelineStates() const;
  // True when `name` is hosted here and READY (for routing).
  bool IsReady(const std::string& name) const;
  // The default pipeline's name when it is READY, else "".
  std::string ReadyDefault() const;
  const std::string& device_name() const { return device_name_; }
  c10::Device torch_device() const { return torch_device_; }
  // What waits on this device's worker now (DeviceWorker::waiting): a snapshot for diagnostics and
  // for tests that wait for a state instead of sleeping.
  DeviceWorker::Waiting waiting() const { return worker_->waiting(); }
  // Requests the worker runs now (a batch's members; 0 between runs): stowage_requests_running.
  int running() const { return executor_->running(); }
  // Requests accepted by Generate and not yet returned (queued or running); for routing.
  int in_flight() const { return in_flight_.load(std::memory_order_relaxed); }

 private:
  DeviceRuntime() = default;
  absl::StatusOr<std::unique_ptr<Pipeline>> Build(const v1::PipelineConfig& config);
  // Load with a log line as it begins and one with its outcome.
  absl::StatusOr<v1::Pipeline> LoggedLoad(const v1::PipelineConfig& config, bool make_default,
                                          const Interrupt& interrupt,
                                          const std::map<std::string, DeviceRuntime*>& remote);
  absl::StatusOr<v1::Pipeline> Load(const v1::PipelineConfig& config, bool make_default,
                                    const Interrupt& interrupt,
                                    const std::map<std::string, DeviceRuntime*>& remote = {});
  // Runs `change` on `peer`'s worker with the peer's scope (a remote call from this worker, whose
  // scope is `scope`; `change` must not call again). Changes on this device itself run in place.
  absl::Status OnPeer(WorkerScope& scope, DeviceRuntime* peer,
                      const std::function<absl::Status(DeviceRuntime&, WorkerScope&)>& change);
  // Runs `change` on each of `peers` (OnPeer), best effort: bookkeeping a split pipeline's other
  // devices follow (lifecycle marks, guests), whose failure changes nothing here.
  void OnEachPeer(WorkerScope& scope, const std::set<DeviceRuntime*>& peers,
                  const std::function<void(DeviceRuntime&, WorkerScope&)>& change);
  // Peer side: registers a component of another device's split pipeline here, keeps the pipeline
  // alive while it is, and group-offloads it when `offload` says so.
  absl::Status AddGuest(WorkerScope& scope, const std::string& name, std::shared_ptr<Pipeline> pipeline,
                        Component* component, const std::optional<PipelineGroupOffloadOptions>& offload);
  // Peer side: removes one guest component, or all of `name`.
  absl::Status RemoveGuestComponent(WorkerScope& scope, const std::string& name, const Component& component,
                                    const std::string& reason);
  void RemoveGuest(WorkerScope& scope, const std::string& name);
  // Runs `change` on this device's worker between requests (exceptions become INTERNAL); if
  // `interrupt` fires before it started, it never runs.
  absl::Status OnWorker(const std::function<absl::Status(WorkerScope&)>& change, const Interrupt& interrupt,
                        DeviceWorker::TaskOrder order = DeviceWorker::TaskOrder::kNext);
  // This device's state, for the holder of its worker's scope (another device's scope aborts: a
  // scope exists only on its own worker's thread, so that is a bug, not an input).
  PlacementManager& Placement(WorkerScope& scope) const;
  DeviceBackend& Backend(WorkerScope& scope) const;
  void CheckScope(const WorkerScope& scope) const;
  // Worker only, from placement's peer eviction: moves `component` of `pipeline` (homed here,
  // resident here) to `device` by a call to its worker that copies it device to device. Waits
  // without serving this worker's lane (placement is mid-change), ordered with the other workers'
  // such waits (DeviceWorker::CallHoldingLane): of two devices evicting to each other at once, the
  // second is refused at once (ABORTED) and evicts to the host; the first moves to its peer.
  absl::Status MoveToPeer(const std::string& pipeline, Component& component, const std::string& device);
  v1::Pipeline Describe(const HostedPipelines::View& view) const;
  v1::BatchingConfig BatchingOf(const std::string& pipeline) const;
  // Re-measures the device memory held outside the allocator (DeviceBackend::RefreshContextBytes),
  // logging a change of 16 MiB or more.
  void RefreshContext(WorkerScope& scope);
  // Publishes the snapshot other threads read (after every job, task and call).
  void Publish(WorkerScope& scope);

  ServerMetrics* metrics_ = nullptr;
  // The architectures this device builds pipelines from (RuntimeFactories::Registry()).
  const PipelineRegistry* registry_ = nullptr;
  std::string device_name_;
  // Device state: reached through Backend(scope) once the worker runs. The backend outlives
  // everything that may hold device memory.
  std::unique_ptr<DeviceBackend> backend_;
  c10::Device torch_device_ = c10::Device(c10::kCPU);  // The backend's; immutable after Create.
  // Components loaded from model directories, shared between pipelines that name the same ones.
  ComponentCache component_cache_;
  HostedPipelines pipelines_;
  // Loads in progress, by pipeline name (Describe reads them for LOADING entries).
  mutable absl::Mutex loading_mu_;
  std::map<std::string, std::shared_ptr<LoadProgress>> loading_ ABSL_GUARDED_BY(loading_mu_);

  // LoRA adapters loaded per pipeline, with their placement components (changed on the worker;
  // read by ValidateRequest, Describe and the worker).
  AdapterTable adapters_;
  // Detaches the adapter attached as `key` (AdapterKey) from every Linear of `pipeline`.
  static void DetachAdapter(WorkerScope& scope, Pipeline& pipeline, const std::string& key);

  // The other devices, this device's components on them and theirs here (split layouts, peer
  // eviction). Declared before placement_: destroyed after it (guests' modules outlive their hooks).
  PeerLinks links_;
  // Worker only: true while this worker runs a component for a peer (RunForPeer); peer eviction
  // (which calls a peer) is off then, since a remote call makes no call itself.
  bool serving_peer_ = false;
  // Reached through Placement(scope) once the worker runs (DecisionLog, safe from any thread,
  // excepted). Declared after the pipelines: destroyed before them, since group offloading hooks
  // their modules.
  std::unique_ptr<PlacementManager> placement_;
  std::atomic<int> in_flight_{0};
  // Each READY pipeline's batching settings (absent: off).
  mutable absl::Mutex batching_mu_;
  std::map<std::string, v1::BatchingConfig> batching_ ABSL_GUARDED_BY(batching_mu_);
  mutable absl::Mutex snapshot_mu_;
  std::shared_ptr<const PlacementSnapshot> snapshot_ ABSL_GUARDED_BY(snapshot_mu_);
  // Runs the requests (and the warm-up) on the worker; made by Create.
  std::unique_ptr<RequestExecutor> executor_;
  // The executor reaches the device's state with the worker's scope, as the runtime's own methods do.
  friend class RequestExecutor;
  // Declared last: destroyed first, so queued work finishes while everything it uses exists.
  // The device's convolutions' own thread (models/core/conv_lane.h); outlives the worker, whose
  // threads run convolutions through it.
  std::unique_ptr<ConvLane> conv_lane_;
  std::unique_ptr<DeviceWorker> worker_;
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_DEVICE_RUNTIME_H_
