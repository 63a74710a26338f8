#include "runtime/device_runtime.h"

#include <algorithm>
#include <array>
#include <any>
#include <cmath>
#include <cstdlib>
#include <thread>
#include <iostream>
#include <optional>
#include <random>
#include <set>

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/util/time_util.h"
#include "base/text.h"
#include "models/core/fused_ops.h"
#include "models/pipeline_registry.h"
#include "base/load_progress.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "runtime/config.h"
#include "runtime/reply.h"
#include "runtime/request_validation.h"
#include "runtime/thread_renewal.h"
#include "base/process_memory.h"

namespace stowage {

int64_t PipelineMoveBytes(const PlacementSnapshot& snapshot, const std::string& pipeline) {
  const auto ours = [&pipeline](const ComponentView& c) {
    return c.kind != kLoraAdapterKind && std::find(c.pipelines.begin(), c.pipelines.end(), pipeline) != c.pipelines.end();
  };
  // Whether the pipeline itself has run: one of its own components (not shared: another pipeline's
  // run of a shared encoder says nothing of this one's transformer) ran; a pipeline of shared
  // components only, one of them.
  const auto own = [&](const ComponentView& c) { return ours(c) && c.pipelines.size() == 1; };
  const bool has_own = std::any_of(snapshot.components.begin(), snapshot.components.end(), own);
  const bool any_ran = std::any_of(snapshot.components.begin(), snapshot.components.end(),
                                   [&](const ComponentView& c) { return (has_own ? own(c) : ours(c)) && c.ran; });
  int64_t bytes = 0;
  for (const ComponentView& c : snapshot.components) {
    if (!ours(c) || (any_ran && !c.ran)) continue;
    if (c.group_offload.has_value()) {
      const GroupOffloadStats& g = *c.group_offload;
      bytes += std::max<int64_t>(g.bytes_per_forward - g.cache_link_bytes, 0);
    } else if (c.state == ComponentState::kOffloaded) {
      bytes += c.weight_bytes;
    }
  }
  return bytes;
}
namespace {

// The backend a device's config names (RuntimeFactories::make_backend's default).
absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateBackend(const v1::DeviceConfig& device) {
  if (ResolvedKind(device) == v1::DeviceConfig::KIND_CUDA) return CreateCudaBackend(device.index());
  SimulatedBackendOptions options;
  options.index = device.index();
  options.bandwidth_bytes_per_second = device.simulated_bandwidth_bytes_per_second();
  options.context_bytes = device.simulated_context_bytes();
  return CreateSimulatedBackend(options);
}

// Narrows a pipeline's group-offload options to the components on one device (exclusions and
// overrides naming components elsewhere were checked against the whole pipeline).
PipelineGroupOffloadOptions NarrowedTo(const PipelineGroupOffloadOptions& options, const std::set<std::string>& here) {
  PipelineGroupOffloadOptions out;
  out.defaults = options.defaults;
  for (const std::string& e : options.exclude) {
    if (here.count(e) > 0) out.exclude.push_back(e);
  }
  for (const auto& entry : options.overrides) {
    if (here.count(entry.first) > 0) out.overrides.insert(entry);
  }
  return out;
}

std::string ComponentNames(Pipeline& pipeline) {
  std::vector<std::string> names;
  for (Component* c : pipeline.components()) names.push_back(c->name());
  return absl::StrJoin(names, ", ");
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceRuntime>> DeviceRuntime::Create(
    const v1::ServerConfig& config, ServerMetrics* metrics, const RuntimeFactories& factories) {
  std::unique_ptr<DeviceRuntime> core(new DeviceRuntime());
  core->metrics_ = metrics;
  core->registry_ = &factories.Registry();
  if (config.cpu_threads() > 0) at::set_num_threads(config.cpu_threads());
  ASSIGN_OR_RETURN(core->backend_, factories.make_backend ? factories.make_backend(config.device())
                                                          : CreateBackend(config.device()));
  if (core->backend_ == nullptr) return absl::InternalError("RuntimeFactories::make_backend returned no backend");
  if (config.device().memory_budget_bytes() > 0) {
    RETURN_IF_ERROR(core->backend_->SetMemoryBudget(config.device().memory_budget_bytes()));
  }
  core->device_name_ = core->backend_->name();
  if (metrics != nullptr) metrics->InitializeDevice(core->device_name_);
  core->torch_device_ = core->backend_->torch_device();
  core->placement_ = std::make_unique<PlacementManager>(core->backend_.get());
  core->executor_ = std::make_unique<RequestExecutor>(*core, metrics);
  core->placement_->set_prefetch_next_component(
      !config.device().has_prefetch_next_component() || config.device().prefetch_next_component());
  core->placement_->set_prefetch_next_pipeline(
      !config.device().has_prefetch_next_pipeline() || config.device().prefetch_next_pipeline());
  core->placement_->set_pin_host_copies(config.device().has_pin_host_copies()
                                            ? config.device().pin_host_copies()
                                            : config.device().memory_budget_bytes() > 0);
  core->placement_->set_host_memory_budget(config.device().host_memory_budget_bytes());
  if (config.device().streamed_group_cache().enabled()) {
    const int64_t margin = config.device().streamed_group_cache().margin_bytes();
    core->placement_->set_streamed_group_cache(true, margin > 0 ? margin : int64_t{256} << 20);
  }
  if (config.device().peer_bandwidth_bytes_per_second() > 0) {
    PeerEviction peer;
    peer.peer_bytes_per_second = static_cast<double>(config.device().peer_bandwidth_bytes_per_second());
    double h2d = static_cast<double>(config.device().host_to_device_bandwidth_bytes_per_second());
    if (h2d <= 0) {
      h2d = core->torch_device_.is_cuda() ? 2.5e10
                                          : static_cast<double>(config.device().simulated_bandwidth_bytes_per_second());
    }
    peer.host_to_device_bytes_per_second = h2d;
    DeviceRuntime* self = core.get();
    peer.eligible = [self](const std::string& pipeline) {
      // Worker only (placement calls it). A component of a pipeline homed here, outside a peer's call.
      if (self->serving_peer_) return false;
      // A pipeline with LoRA adapters keeps its components here: its adapted layers read adapters
      // this device holds, and a peer's run would not see the request's adapters.
      if (!self->adapters_.Of(pipeline).empty()) return false;
      for (const HostedPipelines::View& view : self->pipelines_.List()) {
        if (view.name == pipeline) return view.pipeline != nullptr;
      }
      return false;
    };
    peer.peers = [self] {
      const std::vector<DeviceRuntime*> peers = self->links_.peers();
      std::vector<std::pair<std::string, int64_t>> out;
      for (DeviceRuntime* p : peers) {
        const std::shared_ptr<const PlacementSnapshot> snapshot = p->placement_snapshot();
        if (snapshot != nullptr) out.emplace_back(p->device_name(), snapshot->memory.free_bytes());
      }
      return out;
    };
    peer.move = [self](const std::string& pipeline, Component& component, const std::string& device) {
      return self->MoveToPeer(pipeline, component, device);
    };
    core->placement_->SetPeerEviction(std::move(peer));
  }
  DeviceWorker::Options worker;
  worker.device = core->device_name_;
  worker.queue_depth = config.queue_depth();
  const std::string device = core->device_name_;
  worker.on_queue_depth = [metrics, device](int depth) {
    if (metrics != nullptr) metrics->SetQueueDepth(device, depth);
  };
  DeviceRuntime* raw = core.get();
  worker.after_each = [raw](WorkerScope& scope) { raw->Publish(scope); };
  worker.scheduler = ToSchedulerOptions(config.scheduler());
  worker.tenant_queue_limit = config.scheduler().tenant_queue_limit();
  // Residency for the scheduler: the bytes of a pipeline's components that are on the host now
  // (group-offloaded ones stream whatever the order), from the snapshot the worker published last.
  worker.move_bytes = [raw](const std::string& pipeline) -> int64_t {
    const std::shared_ptr<const PlacementSnapshot> snapshot = raw->placement_snapshot();
    return snapshot == nullptr ? 0 : PipelineMoveBytes(*snapshot, pipeline);
  };
  const auto record = [raw](const std::string& action) {
    return [raw, action](WorkerScope& scope, const DeviceWorker::Job& job, const std::string& reason) {
      std::string request_id;
      if (const auto* pending = std::any_cast<RequestExecutor::Request*>(&job.payload); pending != nullptr && *pending != nullptr) {
        request_id = (*pending)->request->request_id();
      }
      raw->Placement(scope).RecordSchedule(request_id, job.schedule.pipeline, reason, action);
      if (action == "preempt" && raw->metrics_ != nullptr) raw->metrics_->RecordPreemption(raw->device_name_);
    };
  };
  worker.on_reorder = record("schedule");
  worker.on_preempt = record("preempt");
  // The device's convolutions run on a lane of their own (models/core/conv_lane.h), installed on the
  // worker's thread (unless DeviceConfig.convolution_lane is false: then they run on the worker's).
  if (!config.device().has_convolution_lane() || config.device().convolution_lane()) {
    core->conv_lane_ = std::make_unique<ConvLane>();
  }
  ConvLane* lane = core->conv_lane_.get();
  const bool high_priority = config.device().high_priority_compute();
  worker.on_start = [raw, lane, high_priority] {
    if (high_priority) raw->backend_->EnterComputeThread(/*high_priority=*/true);
    ConvLane::SetForThisThread(lane);
  };
  // After allocator out-of-memory errors the convolutions go on on a fresh thread, once the room is
  // back (runtime/thread_renewal.h: LibTorch keeps a cuDNN convolution plan chosen short of memory on
  // its thread). Only the lane's thread: the worker's keeps the attention graphs and whatever else
  // LibTorch cached on it (until session 45 the worker's own thread was renewed, and the next run of
  // every pipeline built its cuDNN attention graphs again — multi-tenant run 16, 15 renewals). Without
  // a lane the worker itself goes on on a fresh thread (DeviceWorker's hand-over, on_renewed below).
  // A fresh thread whose first item ran short again says the room is what is missing: the spare-room
  // caches' margin widens then (and only then: a single shortfall costs its run a few hundredths of a
  // second, a wider margin every streamed request after it copies).
  // (Not when the item's own failed run widened it already: one shortfall, one widening.)
  struct RenewalState {
    ThreadRenewalPolicy policy;
    int64_t widenings = 0;  // The placement's count at the last look.
  };
  // Each renewal, logged and counted: `thread` says which (the convolutions' or the worker's).
  const auto renewed = [raw](const char* thread, const std::string& reason) {
    LogInfo(absl::StrCat("device_thread_renewed device=", raw->device_name_, " thread=", thread,
                         " reason=", LogValue(reason)));
    if (raw->metrics_ != nullptr) raw->metrics_->RecordThreadRenewal(raw->device_name_);
  };
  worker.renew_thread = [raw, lane, renewed, state = std::make_shared<RenewalState>()](WorkerScope& scope) -> std::string {
    PlacementManager& placement = raw->Placement(scope);
    const DeviceMemoryStats stats = placement.backend().GetMemoryStats();
    const std::string reason = state->policy.Next(stats.allocator_ooms, stats.largest_refused_bytes, stats.free_bytes());
    if (state->policy.fresh_thread_ran_short() && placement.cache_margin_widenings() == state->widenings) {
      placement.WidenCacheMarginForShortRoom(
          stats.largest_refused_bytes,
          absl::StrCat("the first item after the ", lane != nullptr ? "convolutions" : "worker",
                       " went on on a fresh thread ran short of memory again (the largest refusal ",
                       stats.largest_refused_bytes, " bytes)"));
    }
    state->widenings = placement.cache_margin_widenings();
    if (reason.empty() || lane == nullptr) return reason;
    lane->Renew();
    renewed("convolutions", reason);
    return "";  // The worker goes on on its own thread.
  };
  worker.on_renewed = [renewed](WorkerScope&, const std::string& reason) { renewed("worker", reason); };
  core->worker_ = std::make_unique<DeviceWorker>(std::move(worker));
  if (metrics != nullptr) metrics->SetQueueDepth(device, 0);
  // From here on only the worker touches the backend and placement.
  RETURN_IF_ERROR(core->ChangeDevice([](PlacementManager&) { return absl::OkStatus(); }, nullptr));
  for (const v1::PipelineConfig& p : config.pipelines()) {
    absl::StatusOr<v1::Pipeline> loaded = core->LoggedLoad(p, p.default_(), nullptr, {});
    if (!loaded.ok()) return loaded.status();
  }
  if (config.has_strategy()) RETURN_IF_ERROR(core->ApplyStrategy(config.strategy()));
  return core;
}

absl::Status DeviceRuntime::ApplyStrategy(const v1::OffloadStrategy& config,
                                           const std::vector<std::string>& also_known,
                                           const std::vector<std::string>& also_known_ids) {
  RETURN_IF_ERROR(ChangeDevice(
      [&](PlacementManager& placement) -> absl::Status {
        std::vector<std::string> names = also_known, ids = also_known_ids;
        for (const ComponentView& v : placement.Snapshot()) {
          names.push_back(v.name);
          ids.push_back(v.id);
        }
        ASSIGN_OR_RETURN(std::unique_ptr<OffloadStrategy> strategy, ToOffloadStrategy(config, names, ids));
        placement.SetStrategy(std::move(strategy));
        return absl::OkStatus();
      },
      nullptr));
  for (const std::string& warning : placement_snapshot()->warnings) {
    LogWarning(warning);
  }
  return absl::OkStatus();
}

DeviceRuntime::~DeviceRuntime() {
  if (worker_ != nullptr) {
    // Group offloading hooks the pipelines' modules: placement lets go of them, on the worker,
    // before anything is destroyed. (A no-op after DeviceSet's two phases stopped the worker.)
    ReleaseDeviceState();
    worker_.reset();
  }
}

void DeviceRuntime::ReleaseDeviceState() {
  (void)worker_->RunTask(
      [this](WorkerScope& scope) {
        for (const HostedPipelines::View& view : pipelines_.List()) {
          for (const auto& entry : links_.RemoteOf(view.name)) {
            (void)OnPeer(scope, entry.second, [&](DeviceRuntime& peer, WorkerScope& peer_scope) {
              peer.RemoveGuest(peer_scope, view.name);
              return absl::OkStatus();
            });
          }
          Placement(scope).Unregister(view.name);
        }
        for (const std::string& guest : links_.GuestNames()) RemoveGuest(scope, guest);
        return absl::OkStatus();
      },
      nullptr);
}

void DeviceRuntime::StopWorker() { worker_->Stop(); }

void DeviceRuntime::SetPeers(std::vector<DeviceRuntime*> peers) { links_.SetPeers(std::move(peers)); }

DeviceRuntime* DeviceRuntime::PeerFor(const std::string& pipeline, const Component& component) const {
  return links_.PeerFor(pipeline, &component);
}

absl::Status DeviceRuntime::MoveToPeer(const std::string& pipeline, Component& component, const std::string& device) {
  DeviceRuntime* peer = links_.PeerNamed(device);
  std::shared_ptr<Pipeline> hosted;
  for (const HostedPipelines::View& view : pipelines_.List()) {
    if (view.name == pipeline) hosted = view.pipeline;
  }
  if (peer == nullptr || hosted == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("no peer ", device, " or pipeline ", pipeline, " here"));
  }
  const std::string reason = absl::StrCat("evicted from ", device_name_, ": cheaper here than from the host");
  // Placement here is mid-change: this worker waits without serving its lane. The workers order such
  // waits (DeviceWorker::CallHoldingLane): when the peer is itself evicting towards this device, this
  // move is refused at once and placement takes the host instead.
  RETURN_IF_ERROR(peer->worker_->CallHoldingLane(
      [&](WorkerScope& peer_scope) -> absl::Status {
        RETURN_IF_ERROR(peer->Placement(peer_scope).AdoptFromPeer(pipeline, component, reason));
        peer->links_.AddGuest(pipeline, hosted);
        return absl::OkStatus();
      },
      *worker_));
  links_.SetRemoteComponent(pipeline, &component, peer);
  return absl::OkStatus();
}

absl::StatusOr<v1::Pipeline> DeviceRuntime::MoveComponent(const std::string& name, const std::string& component_name,
                                                           DeviceRuntime* to, const Interrupt& interrupt) {
  std::shared_ptr<Pipeline> pipeline;
  for (const HostedPipelines::View& view : pipelines_.List()) {
    if (view.name != name) continue;
    if (view.state != PipelineState::kReady) {
      return absl::FailedPreconditionError(absl::StrCat("pipeline '", name, "' is ", PipelineStateName(view.state),
                                                        "; a component moves only while its pipeline is READY"));
    }
    pipeline = view.pipeline;
  }
  if (pipeline == nullptr) {
    return absl::NotFoundError(absl::StrCat("no pipeline named '", Truncated(name), "' on ", device_name_));
  }
  Component* component = nullptr;
  for (Component* c : pipeline->components()) {
    if (c->name() == component_name) component = c;
  }
  if (component == nullptr) {
    return absl::NotFoundError(absl::StrCat("pipeline '", name, "' has no component '", Truncated(component_name),
                                            "'; its components: ", ComponentNames(*pipeline)));
  }
  v1::Pipeline described;
  RETURN_IF_ERROR(worker_->RunTask(
      [&](WorkerScope& scope) -> absl::Status {
        // Between the pipeline's requests (they run as jobs on this worker): nothing runs it now.
        if (!pipelines_.StillHosted(name, pipeline.get()) || !IsReady(name)) {
          return absl::FailedPreconditionError(
              absl::StrCat("pipeline '", name, "' began unloading; a component moves only while its pipeline is READY"));
        }
        std::map<const Component*, DeviceRuntime*> remote = links_.RemoteOf(name);
        DeviceRuntime* from = remote.count(component) > 0 ? remote[component] : this;
        if (from == to) {
          return absl::FailedPreconditionError(absl::StrCat("component '", component_name, "' of pipeline '", name,
                                                            "' is already on ", to->device_name_, "; nothing to move"));
        }
        absl::Status checked;
        RETURN_IF_ERROR(OnPeer(scope, from, [&](DeviceRuntime& source, WorkerScope& source_scope) -> absl::Status {
          PlacementManager& source_placement = source.Placement(source_scope);
          const std::vector<std::string> users = source_placement.PipelinesOf(*component);
          if (users.size() > 1) {
            return absl::FailedPreconditionError(absl::StrCat(
                "component '", component_name, "' of pipeline '", name, "' is shared with pipeline(s) ",
                absl::StrJoin(users, ", "), " on ", source.device_name_,
                "; a shared component does not move (it would move for every pipeline using it)"));
          }
          const std::optional<ComponentState> state = source_placement.StateOf(*component);
          if (state == ComponentState::kGroupOffloaded || state == ComponentState::kPartiallyResident) {
            return absl::FailedPreconditionError(absl::StrCat("component '", component_name, "' of pipeline '", name,
                                                              "' is group-offloaded on ", source.device_name_,
                                                              "; disable its group offload first"));
          }
          const std::string reason = absl::StrCat("moved to ", to->device_name_, " (admin MoveComponent)");
          return &source == this ? source_placement.UnregisterComponent(name, *component, reason)
                                 : source.RemoveGuestComponent(source_scope, name, *component, reason);
        }));
        const absl::Status added = OnPeer(scope, to, [&](DeviceRuntime& target, WorkerScope& target_scope) -> absl::Status {
          if (&target == this) {
            RETURN_IF_ERROR(target.Placement(target_scope).Register(name, component));
          } else {
            RETURN_IF_ERROR(target.AddGuest(target_scope, name, pipeline, component, std::nullopt));
          }
          target.Placement(target_scope).MarkReady(name);
          return absl::OkStatus();
        });
        if (!added.ok()) {
          // Back where it was, so the pipeline still has every component.
          (void)OnPeer(scope, from, [&](DeviceRuntime& source, WorkerScope& source_scope) -> absl::Status {
            if (&source == this) {
              RETURN_IF_ERROR(source.Placement(source_scope).Register(name, component));
            } else {
              RETURN_IF_ERROR(source.AddGuest(source_scope, name, pipeline, component, std::nullopt));
            }
            source.Placement(source_scope).MarkReady(name);
            return absl::OkStatus();
          });
          return added;
        }
        links_.SetRemoteComponent(name, component, to == this ? nullptr : to);
        for (const HostedPipelines::View& view : pipelines_.List()) {
          if (view.name == name) described = Describe(view);
        }
        return absl::OkStatus();
      },
      interrupt));
  return described;
}

absl::Status DeviceRuntime::OnPeer(WorkerScope& scope, DeviceRuntime* peer,
                                    const std::function<absl::Status(DeviceRuntime&, WorkerScope&)>& change) {
  if (peer == this) return change(*this, scope);
  return peer->worker_->Call(
      [&](WorkerScope& peer_scope) -> absl::Status {
        absl::Status status;
        const absl::Status thrown = CatchAsStatus(absl::StrCat("changing device state of ", peer->device_name_),
                                                  [&] { status = change(*peer, peer_scope); });
        return thrown.ok() ? status : thrown;
      },
      nullptr, &scope);
}

void DeviceRuntime::OnEachPeer(WorkerScope& scope, const std::set<DeviceRuntime*>& peers,
                               const std::function<void(DeviceRuntime&, WorkerScope&)>& change) {
  for (DeviceRuntime* peer : peers) {
    (void)OnPeer(scope, peer, [&](DeviceRuntime& other, WorkerScope& other_scope) {
      change(other, other_scope);
      return absl::OkStatus();
    });
  }
}

absl::Status DeviceRuntime::AddGuest(WorkerScope& scope, const std::string& name, std::shared_ptr<Pipeline> pipeline,
                                      Component* component, const std::optional<PipelineGroupOffloadOptions>& offload) {
  PlacementManager& placement = Placement(scope);
  RETURN_IF_ERROR(placement.Register(name, component));
  if (offload.has_value()) {
    const std::set<std::string> here = {component->name()};
    PipelineGroupOffloadOptions narrowed = NarrowedTo(*offload, here);
    if (narrowed.exclude.empty()) {
      auto it = narrowed.overrides.find(component->name());
      const absl::Status enabled = placement.EnableGroupOffload(
          absl::StrCat(name, "/", component->name()), it != narrowed.overrides.end() ? it->second : narrowed.defaults);
      if (!enabled.ok()) {
        (void)placement.UnregisterComponent(name, *component, "its group offload was refused");
        return enabled;
      }
    }
  }
  links_.AddGuest(name, std::move(pipeline));
  return absl::OkStatus();
}

absl::Status DeviceRuntime::RemoveGuestComponent(WorkerScope& scope, const std::string& name,
                                                  const Component& component, const std::string& reason) {
  RETURN_IF_ERROR(Placement(scope).UnregisterComponent(name, component, reason));
  if (!Placement(scope).Hosts(name)) (void)links_.TakeGuest(name);
  return absl::OkStatus();
}

void DeviceRuntime::RemoveGuest(WorkerScope& scope, const std::string& name) {
  Placement(scope).Unregister(name);
  (void)links_.TakeGuest(name);  // Released here, outside PeerLinks' lock.
}

absl::Status DeviceRuntime::RunForPeer(Component& component, const std::function<void()>& fn, bool prefetch_only,
                                        const std::string& request_id, WorkerScope* caller,
                                        const Interrupt& interrupt, v1::DeviceUsage* usage) {
  const at::ThreadLocalState caller_state;  // Inference mode and the rest of the caller's LibTorch state.
  // What the caller queued on this device for `fn` (a step's timesteps, its batch's row index: tensors
  // it made here) is on the caller's current stream for this device, which is not this worker's
  // compute stream: the compute stream waits for it before the run reads them. (The outputs go back
  // complete: the run synchronizes below.)
  const c10::impl::VirtualGuardImpl streams(torch_device_.type());  // Each thread's current stream here.
  std::optional<c10::Event> inputs_queued;
  if (!prefetch_only && torch_device_.is_cuda()) {
    inputs_queued.emplace(torch_device_.type());
    inputs_queued->record(streams.getStream(torch_device_));
  }
  return worker_->Call(
      [&](WorkerScope& scope) -> absl::Status {
        at::ThreadLocalStateGuard state_guard(caller_state);
        if (inputs_queued.has_value()) inputs_queued->block(streams.getStream(torch_device_));
        DeviceBackend& backend = Backend(scope);
        PlacementManager& placement = Placement(scope);
        serving_peer_ = true;
        const DeviceMemoryStats before = backend.GetMemoryStats();
        // This device's own request (if one is running) keeps the peak it reached so far.
        executor_->KeepPeakFloor(before);
        backend.ResetPeakStats();
        const std::string own_request = placement.request_id();
        placement.BeginPeerRun(request_id);
        absl::Status status;
        const absl::Status thrown = CatchAsStatus(absl::StrCat("running ", component.name(), " on ", device_name_), [&] {
          if (prefetch_only) {
            placement.Prefetch(component);
          } else {
            status = placement.Run(component, fn);
            // Its outputs are complete before the home device reads them.
            backend.Synchronize();
          }
        });
        placement.SetRequestId(own_request);
        serving_peer_ = false;
        const DeviceMemoryStats after = backend.GetMemoryStats();
        usage->set_peak_device_memory_bytes(std::max(usage->peak_device_memory_bytes(), after.peak_allocated_bytes));
        usage->set_peak_device_reserved_bytes(std::max(usage->peak_device_reserved_bytes(), after.peak_process_bytes()));
        usage->set_host_to_device_bytes(usage->host_to_device_bytes() + after.host_to_device_bytes -
                                        before.host_to_device_bytes);
        usage->set_device_to_host_bytes(usage->device_to_host_bytes() + after.device_to_host_bytes -
                                        before.device_to_host_bytes);
        return thrown.ok() ? status : thrown;
      },
      interrupt, caller);
}

void DeviceRuntime::Publish(WorkerScope& scope) {
  auto snapshot = std::make_shared<const PlacementSnapshot>(Placement(scope).TakeSnapshot());
  absl::MutexLock lock(&snapshot_mu_);
  snapshot_ = std::move(snapshot);
}

std::shared_ptr<const PlacementSnapshot> DeviceRuntime::placement_snapshot() const {
  absl::MutexLock lock(&snapshot_mu_);
  return snapshot_;
}

std::vector<PlacementDecision> DeviceRuntime::DecisionLog(size_t limit) const {
  return placement_->DecisionLog(limit);
}

std::vector<PipelineStateView> DeviceRuntime::PipelineStates() const {
  std::vector<PipelineStateView> states;
  for (const HostedPipelines::View& view : pipelines_.List()) {
    states.push_back(PipelineStateView{view.name, PipelineStateName(view.state)});
  }
  return states;
}

bool DeviceRuntime::IsReady(const std::string& name) const {
  for (const HostedPipelines::View& view : pipelines_.List()) {
    if (view.name == name) return view.state == PipelineState::kReady;
  }
  return false;
}

std::string DeviceRuntime::ReadyDefault() const {
  for (const HostedPipelines::View& view : pipelines_.List()) {
    if (view.is_default && view.state == PipelineState::kReady) return view.name;
  }
  return "";
}

absl::Status DeviceRuntime::ChangeDevice(const std::function<absl::Status(PlacementManager&)>& change,
                                          const Interrupt& interrupt) {
  return OnWorker([&](WorkerScope& scope) { return change(Placement(scope)); }, interrupt);
}

absl::Status DeviceRuntime::OnWorker(const std::function<absl::Status(WorkerScope&)>& change,
                                      const Interrupt& interrupt, DeviceWorker::TaskOrder order) {
  return worker_->RunTask(
      [&](WorkerScope& scope) -> absl::Status {
        absl::Status status;
        const absl::Status thrown = CatchAsStatus("changing device state", [&] { status = change(scope); });
        return thrown.ok() ? status : thrown;
      },
      interrupt, order);
}

void DeviceRuntime::CheckScope(const WorkerScope& scope) const {
  if (&scope.worker() != worker_.get()) {
    // A scope exists only on its own worker's thread: another device's scope here is a bug.
    std::cerr << "stowage_server: internal error: device " << device_name_ << "'s state reached with the scope of "
              << scope.worker().device() << std::endl;
    std::abort();
  }
}

PlacementManager& DeviceRuntime::Placement(WorkerScope& scope) const {
  CheckScope(scope);
  return *placement_;
}

DeviceBackend& DeviceRuntime::Backend(WorkerScope& scope) const {
  CheckScope(scope);
  return *backend_;
}

absl::StatusOr<std::unique_ptr<Pipeline>> DeviceRuntime::Build(const v1::PipelineConfig& p) {
  PipelineLoadOptions options;
  options.name = p.name();
  options.dtype = p.dtype() == "bfloat16" ? at::kBFloat16 : at::kFloat;
  options.weight_seed = p.weight_seed();
  options.component_seeds.insert(p.component_weight_seeds().begin(), p.component_weight_seeds().end());
  options.device = torch_device_;
  options.random_weights = p.random_weights();
  options.default_size = p.default_size();
  options.host_spill_dir = p.host_spill_dir();
  // A split pipeline's components are its own: a shared one would be registered on two devices.
  options.cache = p.component_devices().empty() ? &component_cache_ : nullptr;
  for (const auto& [component, mode] : p.compute()) {
    if (mode == v1::COMPUTE_FP8) options.fp8_components.insert(component);
  }
  // FP8 components group-offloaded from an int4 host copy at start: their FP8 form is made with that
  // copy in one pass over the bf16 weights instead of on the host first (MakeComponent's fp8_one_pass).
  const v1::PipelineGroupOffload& offload = p.group_offload();
  for (const std::string& name : options.fp8_components) {
    if (!offload.enabled() ||
        std::find(offload.exclude().begin(), offload.exclude().end(), name) != offload.exclude().end()) {
      continue;
    }
    const auto it = offload.overrides().find(name);
    const v1::GroupOffloadConfig& c = it != offload.overrides().end() ? it->second : offload.defaults();
    if (c.compress() == v1::GroupOffloadConfig::COMPRESS_INT4) options.fp8_one_pass_components.insert(name);
  }
  if (!options.fp8_components.empty()) {
    const absl::Status supported = fused::Fp8Supported(torch_device_);
    if (!supported.ok()) {
      return absl::Status(supported.code(), absl::StrCat("pipeline.compute: FP8 on device ", device_name_, ": ",
                                                         supported.message()));
    }
  }
  const PipelineRegistry& registry = *registry_;
  absl::StatusOr<std::unique_ptr<Pipeline>> pipeline = absl::InternalError("not built");
  // Loaders report problems as statuses; anything a hostile file still makes LibTorch throw is
  // caught here rather than taking the server down.
  RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("loading pipeline '", p.name(), "'"), [&] {
    pipeline = p.source_case() == v1::PipelineConfig::kModelDir ? registry.LoadDirectory(p.model_dir(), options)
                                                                : registry.CreateBuiltin(p.builtin(), options);
  }));
  if (pipeline.ok()) {
    const auto components = (*pipeline)->components();
    auto check = [&](const std::string& field, const std::string& name) -> absl::Status {
      if (std::any_of(components.begin(), components.end(), [&](Component* c) { return c->name() == name; })) {
        return absl::OkStatus();
      }
      return absl::InvalidArgumentError(absl::StrCat("pipeline.", field, ": '", Truncated(name),
                                                     "' is not a component of pipeline '", p.name(),
                                                     "'; its components: ", ComponentNames(**pipeline)));
    };
    for (const std::string& name : options.fp8_components) RETURN_IF_ERROR(check("compute", name));
    for (const auto& entry : options.component_seeds) RETURN_IF_ERROR(check("component_weight_seeds", entry.first));
  }
  return pipeline;
}

absl::StatusOr<v1::Pipeline> DeviceRuntime::LoadPipeline(const v1::PipelineConfig& config,
                                                          const Interrupt& interrupt) {
  v1::PipelineConfig p = config;
  RETURN_IF_ERROR(FinalizePipelineConfig(p, "pipeline", registry_));
  return LoggedLoad(p, /*make_default=*/false, interrupt, {});
}

absl::StatusOr<v1::Pipeline> DeviceRuntime::LoadPipeline(const v1::PipelineConfig& config, const Interrupt& interrupt,
                                                          const std::map<std::string, DeviceRuntime*>& remote,
                                                          bool make_default) {
  v1::PipelineConfig p = config;
  RETURN_IF_ERROR(FinalizePipelineConfig(p, "pipeline", registry_));
  for (const auto& entry : remote) {
    if (entry.second == this || entry.second == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline.component_devices: '", Truncated(entry.first),
                                                     "' names the pipeline's home device ", device_name_,
                                                     "; list only components that run on another device"));
    }
  }
  return LoggedLoad(p, make_default, interrupt, remote);
}

absl::StatusOr<v1::Pipeline> DeviceRuntime::LoggedLoad(const v1::PipelineConfig& p, bool make_default,
                                                        const Interrupt& interrupt,
                                                        const std::map<std::string, DeviceRuntime*>& remote) {
  const absl::Time start = absl::Now();
  const std::string source = !p.model_dir().empty() ? absl::StrCat("model_dir=", LogValue(p.model_dir(), 512))
                                                    : absl::StrCat("builtin=", LogValue(p.builtin()));
  LogInfo(absl::StrCat("load pipeline=", LogValue(p.name()), " device=", device_name_, " ", source,
                       " dtype=", LogValue(p.dtype()), " phase=begin"));
  // Its progress, for ListPipelines while it runs and a log line every 5 s.
  auto progress = std::make_shared<LoadProgress>();
  {
    absl::MutexLock lock(&loading_mu_);
    // A second load of a name already loading is refused; the first keeps its entry.
    loading_.emplace(p.name(), progress);
  }
  absl::Notification finished;
  std::thread ticker([&] {
    while (!finished.WaitForNotificationWithTimeout(absl::Seconds(5))) {
      LogInfo(absl::StrCat("load pipeline=", LogValue(p.name()), " device=", device_name_,
                           " phase=loading bytes_read=", progress->bytes_read.load(),
                           " bytes_total=", progress->bytes_total.load(),
                           " bytes_pinned=", progress->bytes_pinned.load(),
                           absl::StrFormat(" seconds=%.1f", absl::ToDoubleSeconds(absl::Now() - start))));
    }
  });
  absl::StatusOr<v1::Pipeline> loaded = absl::InternalError("not loaded");
  {
    const ScopedLoadProgress scoped(progress.get());
    loaded = Load(p, make_default, interrupt, remote);
  }
  finished.Notify();
  ticker.join();
  {
    absl::MutexLock lock(&loading_mu_);
    // Another load of the name (refused, or after this one) may have replaced the entry.
    auto it = loading_.find(p.name());
    if (it != loading_.end() && it->second == progress) loading_.erase(it);
  }
  const std::string seconds = absl::StrFormat("%.3f", absl::ToDoubleSeconds(absl::Now() - start));
  if (loaded.ok()) {
    if (metrics_ != nullptr) metrics_->InitializePipeline(p.name());
    int64_t bytes = 0;
    for (const v1::PipelineComponent& c : loaded->components()) bytes += c.weight_bytes();
    LogInfo(absl::StrCat("load pipeline=", LogValue(p.name()), " device=", device_name_, " phase=ready seconds=",
                         seconds, " components=", loaded->components_size(), " weight_bytes=", bytes,
                         " pinned_bytes=", progress->bytes_pinned.load()));
  } else {
    LogWarning(absl::StrCat("load pipeline=", LogValue(p.name()), " device=", device_name_,
                            " phase=failed seconds=", seconds,
                            " code=", absl::StatusCodeToString(loaded.status().code()),
                            " error=", LogValue(loaded.status().message(), 300)));
  }
  return loaded;
}

absl::StatusOr<v1::Pipeline> DeviceRuntime::Load(const v1::PipelineConfig& p, bool make_default,
                                                  const Interrupt& interrupt,
                                                  const std::map<std::string, DeviceRuntime*>& remote_names) {
  std::optional<PipelineGroupOffloadOptions> offload;
  if (p.group_offload().enabled()) {
    ASSIGN_OR_RETURN(offload, ToPipelineGroupOffloadOptions(p.group_offload(), "pipeline.group_offload"));
  }
  const std::string& name = p.name();
  RETURN_IF_ERROR(pipelines_.BeginLoad(name));
  absl::StatusOr<std::unique_ptr<Pipeline>> built = Build(p);
  if (!built.ok()) {
    pipelines_.FailLoad(name, built.status());
    return built.status();
  }
  std::shared_ptr<Pipeline> pipeline = *std::move(built);
  // Split layout: which components run on which peer.
  std::map<const Component*, DeviceRuntime*> remote;
  std::set<std::string> all_names, local_names;
  for (Component* component : pipeline->components()) all_names.insert(component->name());
  for (const auto& entry : remote_names) {
    Component* found = nullptr;
    for (Component* component : pipeline->components()) {
      if (component->name() == entry.first) found = component;
    }
    if (found == nullptr) {
      pipelines_.AbandonLoad(name);
      return absl::InvalidArgumentError(absl::StrCat("pipeline.component_devices: '", Truncated(entry.first),
                                                     "' is not a component of pipeline '", name,
                                                     "'; its components: ", ComponentNames(*pipeline)));
    }
    remote[found] = entry.second;
  }
  for (Component* component : pipeline->components()) {
    if (remote.count(component) == 0) local_names.insert(component->name());
  }
  if (offload.has_value()) {
    // Checked against the whole pipeline: each device then gets the part about its components.
    for (const std::string& e : offload->exclude) {
      if (all_names.count(e) == 0) {
        pipelines_.AbandonLoad(name);
        return absl::InvalidArgumentError(absl::StrCat("pipeline.group_offload.exclude: pipeline '", name,
                                                       "' has no component '", Truncated(e), "'"));
      }
    }
    for (const auto& o : offload->overrides) {
      if (all_names.count(o.first) == 0) {
        pipelines_.AbandonLoad(name);
        return absl::InvalidArgumentError(absl::StrCat("pipeline.group_offload.overrides: pipeline '", name,
                                                       "' has no component '", Truncated(o.first), "'"));
      }
    }
  }
  bool ran = false;  // Written on the worker; read after RunTask returned (synchronised by it).
  v1::Pipeline described;
  LoadProgress* const progress = CurrentLoadProgress();  // The loading thread's, for the pinning.
  const absl::Status status = OnWorker(
      [&](WorkerScope& scope) -> absl::Status {
        ran = true;
        const ScopedLoadProgress pinning(progress);
        PlacementManager& placement = Placement(scope);
        absl::Status registered;
        std::set<DeviceRuntime*> peers_used;
        for (Component* component : pipeline->components()) {
          auto it = remote.find(component);
          if (it == remote.end()) {
            registered = placement.Register(name, component);
          } else {
            peers_used.insert(it->second);
            registered = OnPeer(scope, it->second, [&](DeviceRuntime& peer, WorkerScope& peer_scope) {
              return peer.AddGuest(peer_scope, name, pipeline, component, offload);
            });
          }
          if (!registered.ok()) break;
        }
        if (registered.ok() && offload.has_value() && !local_names.empty()) {
          registered = placement.EnablePipelineGroupOffload(name, NarrowedTo(*offload, local_names));
        }
        if (!registered.ok()) {
          placement.Unregister(name);  // All or nothing.
          executor_->ForgetPipeline(name);
          OnEachPeer(scope, peers_used, [&](DeviceRuntime& other, WorkerScope& other_scope) {
            other.RemoveGuest(other_scope, name);
          });
          return registered;
        }
        links_.SetRemote(name, remote);
        const bool warmup = p.has_warmup() ? p.warmup() : torch_device_.is_cuda();
        if (warmup) executor_->WarmUp(scope, *pipeline, interrupt);
        placement.MarkReady(name);
        OnEachPeer(scope, peers_used, [&](DeviceRuntime& other, WorkerScope& other_scope) {
          other.Placement(other_scope).MarkReady(name);
        });
        {
          absl::MutexLock lock(&batching_mu_);
          batching_[name] = p.batching();
        }
        pipelines_.FinishLoad(name, pipeline, make_default);
        // Described now: an unload may begin the moment the load has finished.
        for (const HostedPipelines::View& view : pipelines_.List()) {
          if (view.name == name) described = Describe(view);
        }
        return absl::OkStatus();
      },
      interrupt);
  if (!status.ok()) {
    if (ran) {
      pipelines_.FailLoad(name, status);
    } else {
      pipelines_.AbandonLoad(name);  // Withdrawn before it ran: nothing changed.
    }
    return status;
  }
  return described;
}

void DeviceRuntime::RefreshContext(WorkerScope& scope) {
  const DeviceBackend::ContextChange change = Backend(scope).RefreshContextBytes();
  constexpr int64_t kMiB = int64_t{1} << 20;
  // Every rise (what the budget must hold grew: a few MiB after start-up took multi-tenant run 11
  // over its budget, and its log could not show it), and drops of 16 MiB or more.
  if (change.after > change.before || change.before - change.after >= 16 * kMiB) {
    LogInfo(absl::StrCat("context device=", device_name_, " outside_allocator_mib=", change.after / kMiB,
                         " was_mib=", change.before / kMiB, " outside_allocator_bytes=", change.after,
                         " was_bytes=", change.before,
                         " (kernels and library workspaces loaded at first use; the budget and the peaks count it)"));
  }
}

absl::Status DeviceRuntime::UnloadPipeline(const std::string& name, const Interrupt& interrupt) {
  ASSIGN_OR_RETURN(std::shared_ptr<Pipeline> pipeline, pipelines_.BeginUnload(name));
  if (pipeline == nullptr) return absl::OkStatus();  // A failed load: nothing on the device.
  // Its components show UNLOADING at once; the removal waits behind the requests already queued.
  absl::Status status = OnWorker(
      [&](WorkerScope& scope) {
        Placement(scope).MarkUnloading(name);
        OnEachPeer(scope, links_.PeersOf(name), [&](DeviceRuntime& other, WorkerScope& other_scope) {
          other.Placement(other_scope).MarkUnloading(name);
        });
        return absl::OkStatus();
      },
      interrupt);
  bool removed = false;
  if (status.ok()) {
    status = worker_->RunTask(
        [&](WorkerScope& scope) {
          removed = true;
          // No request of the pipeline runs now (they ran before this task): its components on
          // peers go too, each by its own worker.
          OnEachPeer(scope, links_.PeersOf(name), [&](DeviceRuntime& other, WorkerScope& other_scope) {
            other.RemoveGuest(other_scope, name);
          });
          links_.SetRemote(name, {});
          Placement(scope).Unregister(name);
          executor_->ForgetPipeline(name);
          {
            absl::MutexLock lock(&batching_mu_);
            batching_.erase(name);
          }
          // Its adapters go with it (its components may live on in another pipeline that shares
          // them: nothing of this pipeline's adapters stays attached to them).
          // (Their placement components went with Unregister above.)
          for (const std::string& adapter : adapters_.RemovePipeline(name)) {
            DetachAdapter(scope, *pipeline, AdapterKey(name, adapter));
          }
          pipelines_.FinishUnload(name);
          return absl::OkStatus();
        },
        interrupt, DeviceWorker::TaskOrder::kAfterQueuedJobs);
  }
  if (!status.ok() && !removed) {
    // Withdrawn before the removal ran: everything is as it was. The pipeline serves again at
    // once; its components' UNLOADING marks go at the worker's next boundary.
    pipelines_.AbandonUnload(name);
    (void)OnWorker(
        [&](WorkerScope& scope) {
          Placement(scope).AbandonUnloading(name);
          OnEachPeer(scope, links_.PeersOf(name), [&](DeviceRuntime& other, WorkerScope& other_scope) {
            other.Placement(other_scope).AbandonUnloading(name);
          });
          return absl::OkStatus();
        },
        nullptr);
  }
  return status;
}

std::string DeviceRuntime::PipelineLabel(const v1::GenerateRequest& request) const {
  for (const HostedPipelines::View& view : pipelines_.List()) {
    if (request.pipeline().empty() ? view.is_default : view.name == request.pipeline()) return view.name;
  }
  return "unknown";
}

v1::BatchingConfig DeviceRuntime::BatchingOf(const std::string& pipeline) const {
  absl::MutexLock lock(&batching_mu_);
  auto it = batching_.find(pipeline);
  if (it != batching_.end()) return it->second;
  v1::BatchingConfig off;
  off.set_max_batch_size(1);
  return off;
}

void DeviceRuntime::SetScheduler(const v1::SchedulerConfig& scheduler) {
  worker_->SetScheduling(ToSchedulerOptions(scheduler), scheduler.tenant_queue_limit());
}

absl::StatusOr<v1::Pipeline> DeviceRuntime::SetBatching(const std::string& name, const v1::BatchingConfig& batching) {
  v1::BatchingConfig b = batching;
  RETURN_IF_ERROR(FinalizeBatchingConfig(b, "batching"));
  for (const HostedPipelines::View& view : pipelines_.List()) {
    if (view.name != name || view.state != PipelineState::kReady) continue;
    {
      absl::MutexLock lock(&batching_mu_);
      batching_[name] = b;
    }
    return Describe(view);
  }
  return absl::NotFoundError(absl::StrCat("no READY pipeline named '", Truncated(name), "'; ListPipelines shows them"));
}

absl::StatusOr<v1::GenerateResponse> DeviceRuntime::Generate(const v1::GenerateRequest& request,
                                                              const CallControl& control) {
  ASSIGN_OR_RETURN(std::shared_ptr<Pipeline> pipeline, pipelines_.Resolve(request.pipeline()));
  ASSIGN_OR_RETURN(GenerationParams params,
                   ValidateRequest(request, *pipeline, adapters_, /*split=*/links_.HasRemote(pipeline->name())));
  RETURN_IF_ERROR(control.interrupt ? control.interrupt() : absl::OkStatus());
  in_flight_.fetch_add(1, std::memory_order_relaxed);
  struct Done {
    std::atomic<int>& n;
    ~Done() { n.fetch_sub(1, std::memory_order_relaxed); }
  } done_counting{in_flight_};

  absl::Notification done;
  RequestExecutor::Request pending;
  pending.pipeline = pipeline;
  pending.params = params;
  pending.request = &request;
  pending.control = &control;
  DeviceWorker::Job job;
  job.payload = &pending;
  job.schedule.priority = request.priority();
  job.schedule.tenant = request.tenant();
  job.schedule.pipeline = pipeline->name();
  job.schedule.deadline = control.deadline;
  // Work: steps x megapixels (a request of 8 steps at 1024x1024 costs 8).
  job.schedule.cost = std::max(1e-3, params.steps * static_cast<double>(params.width) * params.height / (1024.0 * 1024.0));
  job.run = [&](WorkerScope& scope, absl::Duration queue_wait) {
    pending.queue_wait = queue_wait;
    executor_->Run(scope, {&pending}, /*batching=*/false);
  };
  const v1::BatchingConfig batching = BatchingOf(pipeline->name());
  if (pipeline->batched() && batching.max_batch_size() > 1) {
    // Requests that may share a forward: one pipeline, one image size, one step count.
    job.batch_key = absl::StrCat(pipeline->name(), "/", BatchKey(params, pipeline->limits().mixes_adapters));
    job.max_batch_size = batching.max_batch_size();
    job.max_batch_delay = absl::Milliseconds(batching.max_queue_delay_ms());
    job.run_batch = [this](WorkerScope& scope, const std::vector<DeviceWorker::BatchMember>& members) {
      std::vector<RequestExecutor::Request*> requests;
      for (const DeviceWorker::BatchMember& member : members) {
        auto* r = std::any_cast<RequestExecutor::Request*>(member.job->payload);
        r->queue_wait = member.queue_wait;
        r->batch_wait = member.batch_wait;
        requests.push_back(r);
      }
      executor_->Run(scope, requests, /*batching=*/true);
    };
  }
  job.finish = [&] { done.Notify(); };
  if (control.interrupt) {
    job.cancelled = [&] { return !control.interrupt().ok(); };
    job.drop = [&] {
      const absl::Status why = control.interrupt();
      pending.result = why.ok() ? absl::CancelledError("dropped from the queue") : why;
      done.Notify();
    };
  }
  RETURN_IF_ERROR(worker_->Submit(std::move(job)));
  done.WaitForNotification();
  if (!pending.result.ok()) return std::move(pending.result);

  // PNG encoding on the caller's thread: requests of a batch encode in parallel, and the device
  // works on the next request meanwhile.
  v1::GenerateResponse& response = *pending.result;
  if (control.on_progress) {
    v1::Progress progress;
    progress.set_stage("encode_image");
    *progress.mutable_elapsed() = response.stats().run_time();
    *progress.mutable_queue_wait() = response.stats().queue_wait();
    control.on_progress(progress);
  }
  RETURN_IF_ERROR(EncodeReplyImage(pending.image, request.output_format(), response));
  return std::move(pending.result);
}

std::vector<v1::Adapter> DeviceRuntime::Adapters() const { return adapters_.All(); }

absl::StatusOr<v1::Adapter> DeviceRuntime::LoadAdapter(const std::string& pipeline_name, const std::string& name,
                                                        const std::string& path, const LoraFile& file,
                                                        const Interrupt& interrupt) {
  if (pipeline_name.empty()) {
    return absl::InvalidArgumentError("pipeline: name the pipeline the adapter is for");
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Pipeline> pipeline, pipelines_.Resolve(pipeline_name));
  if (!links_.RemoteOf(pipeline_name).empty()) {
    return absl::FailedPreconditionError(absl::StrCat("pipeline '", pipeline_name,
                                                      "' runs on several devices; LoRA adapters need a pipeline on one"));
  }
  ASSIGN_OR_RETURN(PreparedAdapter prepared, PrepareAdapter(*pipeline, name, path, file));
  RETURN_IF_ERROR(OnWorker(
      [&](WorkerScope& scope) -> absl::Status {
        const std::string key = AdapterKey(pipeline_name, name);
        // Unloaded (or replaced) while the file was being prepared: nothing to attach to.
        if (!pipelines_.StillHosted(pipeline_name, pipeline.get()) || !IsReady(pipeline_name)) {
          return absl::FailedPreconditionError(absl::StrCat("pipeline '", pipeline_name,
                                                            "' was unloaded while the adapter was being prepared"));
        }
        if (adapters_.Contains(pipeline_name, name)) {
          return absl::AlreadyExistsError(
              absl::StrCat("pipeline '", pipeline_name, "' already has an adapter named '", name, "'"));
        }
        // Attached while the matrices are still on the host (the layers check their shapes), then
        // registered: placement takes them off until a run holds the adapter.
        std::vector<Linear*> attached;
        absl::Status status;
        for (auto& [layer, weights] : prepared.layers) {
          status = layer->AttachLora(key, weights);
          if (!status.ok()) break;
          attached.push_back(layer);
        }
        PlacementManager& placement = Placement(scope);
        if (status.ok()) status = placement.Register(pipeline_name, prepared.component.get());
        if (status.ok()) {
          placement.MarkReady(pipeline_name);
          status = adapters_.Add(pipeline_name, prepared.info, prepared.component);
          if (!status.ok()) (void)placement.UnregisterComponent(pipeline_name, *prepared.component, "adapter load failed");
        }
        if (!status.ok()) {
          for (Linear* linear : attached) linear->DetachLora(key);
        }
        return status;
      },
      interrupt));
  return prepared.info;
}

void DeviceRuntime::DetachAdapter(WorkerScope&, Pipeline& pipeline, const std::string& key) {
  for (Component* component : pipeline.components()) {
    component->module().ForEachModule([&](Module& m) {
      if (auto* linear = dynamic_cast<Linear*>(&m)) linear->DetachLora(key);
    });
  }
}

absl::Status DeviceRuntime::UnloadAdapter(const std::string& pipeline_name, const std::string& name,
                                           const Interrupt& interrupt) {
  ASSIGN_OR_RETURN(std::shared_ptr<Pipeline> pipeline, pipelines_.Resolve(pipeline_name));
  return OnWorker(
      [&](WorkerScope& scope) -> absl::Status {
        ASSIGN_OR_RETURN(std::shared_ptr<Component> component, adapters_.Remove(pipeline_name, name));
        DetachAdapter(scope, *pipeline, AdapterKey(pipeline_name, name));
        if (component != nullptr) {
          (void)Placement(scope).UnregisterComponent(pipeline_name, *component, "adapter unloaded");
        }
        return absl::OkStatus();
      },
      interrupt);
}

v1::Pipeline DeviceRuntime::Describe(const HostedPipelines::View& view) const {
  v1::Pipeline out;
  out.set_name(view.name);
  out.set_is_default(view.is_default);
  out.set_device(device_name_);
  switch (view.state) {
    case PipelineState::kLoading: {
      out.set_state(v1::PIPELINE_LOADING);
      absl::MutexLock lock(&loading_mu_);
      auto it = loading_.find(view.name);
      if (it != loading_.end() && it->second != nullptr) {
        out.mutable_load_progress()->set_bytes_total(it->second->bytes_total.load());
        out.mutable_load_progress()->set_bytes_read(it->second->bytes_read.load());
        out.mutable_load_progress()->set_bytes_pinned(it->second->bytes_pinned.load());
      }
      break;
    }
    case PipelineState::kReady:
      out.set_state(v1::PIPELINE_READY);
      break;
    case PipelineState::kUnloading:
      out.set_state(v1::PIPELINE_UNLOADING);
      break;
    case PipelineState::kFailed:
      out.set_state(v1::PIPELINE_FAILED);
      out.set_error(view.error);
      break;
  }
  if (view.pipeline == nullptr) return out;
  const Pipeline& p = *view.pipeline;
  const PipelineLimits& limits = p.limits();
  out.set_description(p.description());
  out.set_default_width(limits.default_width);
  out.set_default_height(limits.default_height);
  out.set_min_size(limits.min_size);
  out.set_max_size(limits.max_size);
  out.set_size_multiple(limits.size_multiple);
  out.set_default_inference_steps(limits.default_steps);
  out.set_max_inference_steps(limits.max_steps);
  out.set_default_guidance_scale(limits.default_guidance_scale);
  out.set_max_prompt_bytes(limits.max_prompt_bytes);
  out.set_accepts_images(limits.accepts_images);
  const v1::BatchingConfig batching = BatchingOf(view.name);
  for (const v1::Adapter& adapter : adapters_.Of(view.name)) *out.add_adapters() = adapter;
  out.set_max_batch_size(batching.max_batch_size());
  out.set_max_queue_delay_ms(batching.max_queue_delay_ms());
  // Names, sizes and dtypes are fixed when a component is built: reading them is no device access.
  const std::map<const Component*, DeviceRuntime*> remote = links_.RemoteOf(view.name);
  for (Component* component : view.pipeline->components()) {
    v1::PipelineComponent* c = out.add_components();
    auto it = remote.find(component);
    c->set_device(it == remote.end() ? device_name_ : it->second->device_name());
    c->set_name(component->name());
    c->set_kind(component->kind());
    c->set_weight_bytes(component->weight_bytes());
    c->set_parameter_count(component->parameter_count());
    c->set_dtype(DtypeName(component->dtype()));
    c->set_compute(component->compute());
  }
  return out;
}

v1::ListPipelinesResponse DeviceRuntime::ListPipelines() const {
  v1::ListPipelinesResponse response;
  for (const HostedPipelines::View& view : pipelines_.List()) *response.add_pipelines() = Describe(view);
  return response;
}

}  // namespace stowage
