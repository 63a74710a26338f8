#include "runtime/device_set.h"

#include <cmath>

#include "models/core/lora.h"

#include <algorithm>
#include <memory>
#include <set>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "google/protobuf/util/time_util.h"
#include "offload/device_backend.h"
#include "runtime/config.h"

namespace stowage {
namespace {

// The devices a pipeline config names, or the first device.
std::vector<std::string> Targets(const v1::PipelineConfig& p, const std::string& first) {
  if (p.devices().empty()) return {first};
  return {p.devices().begin(), p.devices().end()};
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceSet>> DeviceSet::Create(const v1::ServerConfig& config,
                                                             ServerMetrics* metrics,
                                                             const RuntimeFactories& factories) {
  std::vector<v1::DeviceConfig> devices(config.devices().begin(), config.devices().end());
  if (devices.empty()) devices.push_back(config.device());
  std::vector<std::string> names;
  for (size_t i = 0; i < devices.size(); ++i) {
    const std::string name = DeviceNameOf(devices[i]);
    if (std::find(names.begin(), names.end(), name) != names.end()) {
      return absl::InvalidArgumentError(absl::StrCat("devices[", i, "]: device ", name,
                                                     " is configured twice; each device once"));
    }
    names.push_back(name);
  }
  for (int i = 0; i < config.pipelines_size(); ++i) {
    for (const std::string& target : config.pipelines(i).devices()) {
      if (std::find(names.begin(), names.end(), target) == names.end()) {
        return absl::InvalidArgumentError(absl::StrCat("pipelines[", i, "].devices: '", Truncated(target),
                                                       "' is not a device of this server; devices: ",
                                                       absl::StrJoin(names, ", ")));
      }
    }
  }
  bool split_any = false;
  for (int i = 0; i < config.pipelines_size(); ++i) {
    RETURN_IF_ERROR(CheckSplit(config.pipelines(i), absl::StrCat("pipelines[", i, "]"), names).status());
    split_any = split_any || !config.pipelines(i).component_devices().empty();
  }
  std::unique_ptr<DeviceSet> set(new DeviceSet());
  set->registry_ = &factories.Registry();
  {
    absl::MutexLock lock(&set->scheduler_mu_);
    set->scheduler_ = config.scheduler();
    for (const auto& entry : config.scheduler().tenant_weights()) set->listed_tenants_.insert(entry.first);
  }
  set->queue_depth_ = config.queue_depth();
  for (size_t i = 0; i < devices.size(); ++i) {
    // Each device gets the server's settings, its own device, and the pipelines placed on it (split
    // pipelines load below, once every device exists).
    v1::ServerConfig own = config;
    if (split_any) own.clear_strategy();  // Set below, once split components are registered too.
    own.clear_devices();
    *own.mutable_device() = devices[i];
    own.clear_pipelines();
    for (const v1::PipelineConfig& p : config.pipelines()) {
      if (!p.component_devices().empty()) continue;
      const std::vector<std::string> targets = Targets(p, names.front());
      if (std::find(targets.begin(), targets.end(), names[i]) != targets.end()) *own.add_pipelines() = p;
    }
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceRuntime> core, DeviceRuntime::Create(own, metrics, factories));
    if (core->device_name() != names[i]) {
      return absl::InternalError(absl::StrCat("device ", names[i], " came up as ", core->device_name()));
    }
    set->devices_.push_back(std::move(core));
    set->routes_.push_back(std::make_unique<Route>());
  }
  for (const auto& core : set->devices_) {
    std::vector<DeviceRuntime*> peers;
    for (const auto& other : set->devices_) {
      if (other != core) peers.push_back(other.get());
    }
    core->SetPeers(std::move(peers));
  }
  for (int i = 0; i < config.pipelines_size(); ++i) {
    const v1::PipelineConfig& p = config.pipelines(i);
    if (p.component_devices().empty()) continue;
    ASSIGN_OR_RETURN(const Split split, set->ResolveSplit(p, absl::StrCat("pipelines[", i, "]")));
    absl::StatusOr<v1::Pipeline> loaded = split.home->LoadPipeline(p, nullptr, split.remote, p.default_());
    if (!loaded.ok()) {
      return absl::Status(loaded.status().code(), absl::StrCat("pipelines[", i, "]: ", loaded.status().message()));
    }
  }
  if (split_any && config.has_strategy()) {
    std::vector<std::string> known, known_ids;
    for (const auto& core : set->devices_) {
      for (const ComponentView& v : core->placement_snapshot()->components) {
        known.push_back(v.name);
        known_ids.push_back(v.id);
      }
    }
    for (const auto& core : set->devices_) RETURN_IF_ERROR(core->ApplyStrategy(config.strategy(), known, known_ids));
  }
  return set;
}

DeviceSet::~DeviceSet() {
  // Two phases: a split pipeline's home removes its components from its peers through their
  // workers, so every worker still runs while any device releases its state; then all stop.
  for (const auto& core : devices_) core->ReleaseDeviceState();
  for (const auto& core : devices_) core->StopWorker();
}

absl::StatusOr<std::vector<std::string>> DeviceSet::CheckSplit(const v1::PipelineConfig& p, const std::string& field,
                                                               const std::vector<std::string>& names) {
  const std::string home = p.devices().empty() ? names.front() : p.devices(0);
  std::vector<std::string> peers;
  for (int j = 0; j < p.component_devices_size(); ++j) {
    const std::string& device = p.component_devices(j).device();
    const std::string entry = absl::StrCat(field, ".component_devices[", j, "].device");
    if (std::find(names.begin(), names.end(), device) == names.end()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": '", Truncated(device),
                                                     "' is not a device of this server; devices: ",
                                                     absl::StrJoin(names, ", ")));
    }
    if (device == home) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": ", device, " is the pipeline's home device (",
                                                     p.devices().empty() ? "the server's first device" : "its devices",
                                                     "); list only components that run on another device"));
    }
    peers.push_back(device);
  }
  return peers;
}

absl::StatusOr<DeviceSet::Split> DeviceSet::ResolveSplit(const v1::PipelineConfig& p, const std::string& field) const {
  std::vector<std::string> names;
  for (const auto& core : devices_) names.push_back(core->device_name());
  RETURN_IF_ERROR(CheckSplit(p, field, names).status());
  Split split;
  ASSIGN_OR_RETURN(split.home, Device(p.devices().empty() ? "" : p.devices(0)));
  for (const v1::ComponentDevice& c : p.component_devices()) {
    ASSIGN_OR_RETURN(split.remote[c.component()], Device(c.device()));
  }
  return split;
}

std::string DeviceSet::Resolve(const std::string& requested) const {
  if (!requested.empty()) return requested;
  for (const auto& core : devices_) {
    std::string name = core->ReadyDefault();
    if (!name.empty()) return name;
  }
  return requested;
}

absl::StatusOr<v1::GenerateResponse> DeviceSet::Generate(const v1::GenerateRequest& request,
                                                         const CallControl& control) {
  const std::string name = Resolve(request.pipeline());
  // The READY, non-draining replicas, each with its queue and its recent run time. A replica that
  // has not run yet counts as fast as the mean of those that have (1 s when none has): an untried
  // device must not look slower than a measured one just because its prior is pessimistic.
  struct Candidate {
    int index;
    int in_flight;
    double seconds;
    bool measured;
  };
  std::vector<Candidate> candidates;
  std::vector<std::string> draining;
  double measured_sum = 0;
  int measured_count = 0;
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (name.empty() || !devices_[i]->IsReady(name)) continue;
    Route& route = *routes_[i];
    absl::MutexLock lock(&route.mu);
    if (route.draining) {
      draining.push_back(devices_[i]->device_name());
      continue;
    }
    candidates.push_back({static_cast<int>(i), devices_[i]->in_flight(), route.recent_run_seconds, route.measured});
    if (route.measured) {
      measured_sum += route.recent_run_seconds;
      ++measured_count;
    }
  }
  const double unmeasured = measured_count > 0 ? measured_sum / measured_count : 1.0;
  int best = -1;
  double best_wait = 0;
  for (const Candidate& c : candidates) {
    const double wait = static_cast<double>(c.in_flight + 1) * (c.measured ? c.seconds : unmeasured);
    if (best < 0 || wait < best_wait) {
      best = c.index;
      best_wait = wait;
    }
  }
  if (best < 0 && !draining.empty()) {
    return absl::UnavailableError(absl::StrCat("pipeline '", Truncated(name), "' is served only by draining devices (",
                                               absl::StrJoin(draining, ", "),
                                               "); retry later, or resume one with DrainDevice"));
  }
  if (best < 0) {
    // No READY replica: the first device that has the name in any state explains why (loading,
    // unloading, failed), else the first device reports it unknown.
    for (const auto& core : devices_) {
      for (const PipelineStateView& v : core->PipelineStates()) {
        if (v.pipeline == name) return core->Generate(request, control);
      }
    }
    return devices_.front()->Generate(request, control);
  }
  v1::GenerateRequest routed = request;
  routed.set_pipeline(name);
  absl::StatusOr<v1::GenerateResponse> result = devices_[static_cast<size_t>(best)]->Generate(routed, control);
  if (result.ok()) {
    const double seconds =
        static_cast<double>(google::protobuf::util::TimeUtil::DurationToNanoseconds(result->stats().run_time())) / 1e9;
    Route& route = *routes_[static_cast<size_t>(best)];
    absl::MutexLock lock(&route.mu);
    route.recent_run_seconds = route.measured ? 0.7 * route.recent_run_seconds + 0.3 * seconds : seconds;
    route.measured = true;
  }
  return result;
}

v1::ListPipelinesResponse DeviceSet::ListPipelines() const {
  v1::ListPipelinesResponse merged;
  const std::string default_name = devices_.size() > 1 ? Resolve("") : "";
  for (const auto& core : devices_) {
    const v1::ListPipelinesResponse listed = core->ListPipelines();  // Not a temporary: iterated below.
    for (const v1::Pipeline& p : listed.pipelines()) {
      v1::Pipeline* existing = nullptr;
      for (v1::Pipeline& m : *merged.mutable_pipelines()) {
        if (m.name() == p.name()) existing = &m;
      }
      if (existing == nullptr) {
        existing = merged.add_pipelines();
        *existing = p;
        if (devices_.size() > 1) existing->set_is_default(p.name() == default_name);
      }
      existing->add_devices(core->device_name());
    }
  }
  return merged;
}

std::string DeviceSet::TenantLabel(const v1::GenerateRequest& request) const {
  if (request.tenant().empty()) return "default";
  absl::MutexLock lock(&scheduler_mu_);
  return listed_tenants_.count(request.tenant()) > 0 ? request.tenant() : "other";
}

absl::StatusOr<v1::SchedulerConfig> DeviceSet::SetScheduler(const v1::SchedulerConfig& scheduler) {
  RETURN_IF_ERROR(CheckSchedulerConfig(scheduler, queue_depth_));
  // Held while the devices change: two calls apply in one order everywhere.
  absl::MutexLock lock(&scheduler_mu_);
  for (const auto& core : devices_) core->SetScheduler(scheduler);
  scheduler_ = scheduler;
  listed_tenants_.clear();
  for (const auto& entry : scheduler.tenant_weights()) listed_tenants_.insert(entry.first);
  return scheduler_;
}

v1::SchedulerConfig DeviceSet::SchedulerInForce() const {
  absl::MutexLock lock(&scheduler_mu_);
  return scheduler_;
}

int DeviceSet::PriorityLabel(const v1::GenerateRequest& request) {
  return std::clamp(request.priority(), 0, kMaxPriority);
}

std::string DeviceSet::PipelineLabel(const v1::GenerateRequest& request) const {
  for (const auto& core : devices_) {
    const std::string label = core->PipelineLabel(request);
    if (label != "unknown") return label;
  }
  return "unknown";
}

absl::StatusOr<v1::Pipeline> DeviceSet::LoadPipeline(const v1::PipelineConfig& config, const Interrupt& interrupt) {
  if (!config.component_devices().empty() && config.devices_size() > 1) {
    // FinalizePipelineConfig's message, before any other check.
    v1::PipelineConfig p = config;
    RETURN_IF_ERROR(FinalizePipelineConfig(p, "pipeline", registry_));
  }
  std::vector<std::string> targets = Targets(config, devices_.front()->device_name());
  std::vector<DeviceRuntime*> cores;
  for (const std::string& target : targets) {
    absl::StatusOr<DeviceRuntime*> core = Device(target);
    if (!core.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline.devices: ", core.status().message()));
    }
    if (std::find(cores.begin(), cores.end(), *core) != cores.end()) {
      return absl::InvalidArgumentError(absl::StrCat("pipeline.devices: ", target, " is named twice"));
    }
    cores.push_back(*core);
  }
  if (devices_.size() > 1) {
    // A name is loaded with all its replicas at once: a replica elsewhere means it exists.
    for (const auto& core : devices_) {
      for (const PipelineStateView& v : core->PipelineStates()) {
        if (v.pipeline == config.name() && std::find(cores.begin(), cores.end(), core.get()) == cores.end()) {
          return absl::AlreadyExistsError(absl::StrCat("pipeline '", Truncated(config.name()), "' is already on ",
                                                       core->device_name(), "; unload it first"));
        }
      }
    }
  }
  if (!config.component_devices().empty()) {
    ASSIGN_OR_RETURN(const Split split, ResolveSplit(config, "pipeline"));
    for (const auto& core : devices_) {
      for (const PipelineStateView& v : core->PipelineStates()) {
        if (v.pipeline == config.name()) {
          return absl::AlreadyExistsError(absl::StrCat("pipeline '", Truncated(config.name()), "' is already on ",
                                                       core->device_name(), "; unload it first"));
        }
      }
    }
    ASSIGN_OR_RETURN(v1::Pipeline loaded, split.home->LoadPipeline(config, interrupt, split.remote, false));
    loaded.add_devices(split.home->device_name());
    return loaded;
  }
  v1::Pipeline first;
  for (size_t i = 0; i < cores.size(); ++i) {
    absl::StatusOr<v1::Pipeline> loaded = cores[i]->LoadPipeline(config, interrupt);
    if (!loaded.ok()) {
      for (size_t j = 0; j < i; ++j) (void)cores[j]->UnloadPipeline(config.name(), nullptr);  // All or nothing.
      return loaded.status();
    }
    if (i == 0) first = *loaded;
  }
  for (DeviceRuntime* core : cores) first.add_devices(core->device_name());
  return first;
}

absl::Status DeviceSet::UnloadPipeline(const std::string& name, const Interrupt& interrupt) {
  bool found = false;
  for (const auto& core : devices_) {
    bool here = false;
    for (const PipelineStateView& v : core->PipelineStates()) here = here || v.pipeline == name;
    if (!here) continue;
    found = true;
    RETURN_IF_ERROR(core->UnloadPipeline(name, interrupt));
  }
  if (!found) return devices_.front()->UnloadPipeline(name, interrupt);  // Its NOT_FOUND.
  return absl::OkStatus();
}

absl::StatusOr<v1::Pipeline> DeviceSet::SetBatching(const std::string& pipeline, const v1::BatchingConfig& batching) {
  absl::StatusOr<v1::Pipeline> last = absl::NotFoundError("");
  std::vector<std::string> on;
  for (const auto& core : devices_) {
    if (!core->IsReady(pipeline)) continue;
    last = core->SetBatching(pipeline, batching);
    if (!last.ok()) return last.status();
    on.push_back(core->device_name());
  }
  if (on.empty()) return devices_.front()->SetBatching(pipeline, batching);  // Its NOT_FOUND (or range) error.
  last->clear_devices();
  for (const std::string& d : on) last->add_devices(d);
  return last;
}

absl::StatusOr<v1::Adapter> DeviceSet::LoadAdapter(const v1::LoadAdapterRequest& request, const Interrupt& interrupt) {
  if (request.pipeline().empty()) return absl::InvalidArgumentError("pipeline: name the pipeline the adapter is for");
  if (request.path().empty()) return absl::InvalidArgumentError("path: the adapter's safetensors file is required");
  if (!std::isfinite(request.alpha()) || request.alpha() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("alpha is ", request.alpha(), "; allowed: 0 (none) or a positive number"));
  }
  std::vector<DeviceRuntime*> cores;
  for (const auto& core : devices_) {
    if (core->IsReady(request.pipeline())) cores.push_back(core.get());
  }
  if (cores.empty()) {
    return absl::NotFoundError(absl::StrCat("no device has pipeline '", Truncated(request.pipeline()), "' READY"));
  }
  // Read and checked once, off the workers.
  ASSIGN_OR_RETURN(LoraFile file, ReadLoraFile(request.path(), "transformer", request.alpha()));
  v1::Adapter first;
  for (size_t i = 0; i < cores.size(); ++i) {
    absl::StatusOr<v1::Adapter> loaded =
        cores[i]->LoadAdapter(request.pipeline(), request.name(), request.path(), file, interrupt);
    if (!loaded.ok()) {
      for (size_t j = 0; j < i; ++j) (void)cores[j]->UnloadAdapter(request.pipeline(), request.name(), nullptr);
      return loaded.status();
    }
    if (i == 0) first = *loaded;
  }
  return first;
}

absl::Status DeviceSet::UnloadAdapter(const v1::UnloadAdapterRequest& request, const Interrupt& interrupt) {
  absl::Status last = absl::NotFoundError(
      absl::StrCat("no device has pipeline '", Truncated(request.pipeline()), "' READY"));
  bool unloaded = false;
  for (const auto& core : devices_) {
    if (!core->IsReady(request.pipeline())) continue;
    last = core->UnloadAdapter(request.pipeline(), request.name(), interrupt);
    if (last.ok()) {
      unloaded = true;
    } else if (last.code() != absl::StatusCode::kNotFound) {
      return last;
    }
  }
  return unloaded ? absl::OkStatus() : last;
}

absl::StatusOr<v1::MoveComponentResponse> DeviceSet::MoveComponent(const v1::MoveComponentRequest& request,
                                                                   const Interrupt& interrupt) {
  if (request.pipeline().empty()) return absl::InvalidArgumentError("pipeline is required");
  if (request.component().empty()) {
    return absl::InvalidArgumentError("component is required (a component name such as \"text_encoder\")");
  }
  if (request.device().empty()) return absl::InvalidArgumentError("device is required (for example \"cuda:1\")");
  ASSIGN_OR_RETURN(DeviceRuntime * to, Device(request.device()));
  std::vector<DeviceRuntime*> homes;
  std::vector<std::string> home_names;
  for (const auto& core : devices_) {
    for (const PipelineStateView& v : core->PipelineStates()) {
      if (v.pipeline == request.pipeline()) {
        homes.push_back(core.get());
        home_names.push_back(core->device_name());
      }
    }
  }
  if (homes.empty()) {
    return absl::NotFoundError(absl::StrCat("no pipeline named '", Truncated(request.pipeline()),
                                            "'; ListPipelines shows them"));
  }
  if (homes.size() > 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "pipeline '", request.pipeline(), "' has replicas on ", absl::StrJoin(home_names, ", "),
        "; components move only in a pipeline with one device (load it with one device to split it)"));
  }
  ASSIGN_OR_RETURN(v1::Pipeline pipeline, homes.front()->MoveComponent(request.pipeline(), request.component(), to, interrupt));
  pipeline.add_devices(homes.front()->device_name());
  v1::MoveComponentResponse response;
  *response.mutable_pipeline() = std::move(pipeline);
  return response;
}

absl::StatusOr<DeviceRuntime*> DeviceSet::Device(const std::string& name) const {
  if (name.empty()) return devices_.front().get();
  std::vector<std::string> names;
  for (const auto& core : devices_) {
    if (core->device_name() == name) return core.get();
    names.push_back(core->device_name());
  }
  return absl::NotFoundError(absl::StrCat("device '", Truncated(name), "' is not one of this server's: ",
                                          absl::StrJoin(names, ", ")));
}

v1::DrainDeviceResponse DeviceSet::Status() const {
  v1::DrainDeviceResponse response;
  for (size_t i = 0; i < devices_.size(); ++i) {
    v1::DeviceStatus* s = response.add_devices();
    s->set_device(devices_[i]->device_name());
    {
      absl::MutexLock lock(&routes_[i]->mu);
      s->set_draining(routes_[i]->draining);
    }
    s->set_in_flight(devices_[i]->in_flight());
    std::set<std::string> hosted;  // Every pipeline with a replica here, in any state.
    for (const PipelineStateView& v : devices_[i]->PipelineStates()) {
      hosted.insert(v.pipeline);
      if (v.state == "ready") s->add_pipelines(v.pipeline);
    }
    const std::shared_ptr<const PlacementSnapshot> snapshot = devices_[i]->placement_snapshot();
    if (snapshot == nullptr) continue;
    for (const ComponentView& c : snapshot->components) {
      if (std::none_of(c.pipelines.begin(), c.pipelines.end(), [&](const std::string& p) { return hosted.count(p) > 0; })) {
        s->add_guest_components(c.id);
      }
    }
  }
  return response;
}

absl::StatusOr<v1::DrainDeviceResponse> DeviceSet::Drain(const std::string& device, bool drain) {
  if (device.empty()) return absl::InvalidArgumentError("device is required (for example \"cuda:1\")");
  ASSIGN_OR_RETURN(DeviceRuntime * core, Device(device));
  for (size_t i = 0; i < devices_.size(); ++i) {
    if (devices_[i].get() != core) continue;
    absl::MutexLock lock(&routes_[i]->mu);
    routes_[i]->draining = drain;
  }
  return Status();
}

std::vector<std::shared_ptr<const PlacementSnapshot>> DeviceSet::PlacementSnapshots() const {
  std::vector<std::shared_ptr<const PlacementSnapshot>> out;
  for (const auto& core : devices_) out.push_back(core->placement_snapshot());
  return out;
}

std::vector<PipelineStateView> DeviceSet::PipelineStates() const {
  std::vector<PipelineStateView> out;
  for (const auto& core : devices_) {
    for (PipelineStateView v : core->PipelineStates()) {
      v.device = core->device_name();
      out.push_back(std::move(v));
    }
  }
  return out;
}

}  // namespace stowage
