#include "runtime/admin_core.h"

#include <algorithm>
#include <iostream>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "google/protobuf/util/time_util.h"
#include "runtime/config.h"

namespace stowage {
namespace {

using google::protobuf::util::TimeUtil;

v1::ComponentPlacement::State ToProto(ComponentState state) {
  switch (state) {
    case ComponentState::kOffloaded:
      return v1::ComponentPlacement::OFFLOADED;
    case ComponentState::kResident:
      return v1::ComponentPlacement::RESIDENT;
    case ComponentState::kGroupOffloaded:
      return v1::ComponentPlacement::GROUP_OFFLOADED;
    case ComponentState::kPartiallyResident:
      return v1::ComponentPlacement::PARTIALLY_RESIDENT;
  }
  return v1::ComponentPlacement::STATE_UNSPECIFIED;
}

void FillComponents(const PlacementSnapshot& snapshot,
                    google::protobuf::RepeatedPtrField<v1::ComponentPlacement>* out,
                    const std::function<bool(const ComponentView&)>& keep) {
  for (const ComponentView& v : snapshot.components) {
    if (!keep(v)) continue;
    v1::ComponentPlacement* c = out->Add();
    c->set_id(v.id);
    c->set_name(v.name);
    c->set_kind(v.kind);
    c->set_compute(v.compute);
    for (const std::string& p : v.pipelines) c->add_pipelines(p);
    c->set_weight_bytes(v.weight_bytes);
    c->set_device_bytes(v.device_bytes);
    c->set_run_headroom_bytes(v.run_headroom_bytes);
    c->set_state(ToProto(v.state));
    switch (v.lifecycle) {
      case ComponentLifecycle::kLoading:
        c->set_lifecycle(v1::ComponentPlacement::LOADING);
        break;
      case ComponentLifecycle::kReady:
        c->set_lifecycle(v1::ComponentPlacement::READY);
        break;
      case ComponentLifecycle::kUnloading:
        c->set_lifecycle(v1::ComponentPlacement::UNLOADING);
        break;
    }
    if (v.last_use != absl::InfinitePast()) {
      *c->mutable_last_use() = TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(v.last_use));
    }
    if (v.group_offload.has_value()) {
      const GroupOffloadStats& s = *v.group_offload;
      v1::GroupOffloadStatus* g = c->mutable_group_offload();
      g->set_groups(s.groups);
      g->set_streamed_groups(s.streamed_groups);
      g->set_resident_groups(s.resident_groups);
      g->set_slots(s.slots);
      g->set_slot_bytes(s.slot_bytes);
      g->set_working_set_bytes(s.working_set_bytes);
      g->set_forwards(s.forwards);
      g->set_prefetches(s.prefetches);
      g->set_sync_onloads(s.sync_onloads);
      g->set_pinned_in_place_bytes(s.pinned_in_place_bytes);
      g->set_pin_in_place_error(s.pin_in_place_error);
      g->set_compress(s.compress);
      g->set_compressed_host_bytes(s.compressed_host_bytes);
      g->set_one_pass_fp8_weights(s.one_pass_fp8_weights);
      g->set_scratch_bytes(s.scratch_bytes);
      g->set_bytes_per_forward(s.bytes_per_forward);
      g->set_early_prefetches(s.early_prefetches);
      g->set_prefetches_skipped_after_last(s.prefetches_skipped_after_last);
      g->set_cache_allowance_bytes(s.cache_allowance_bytes);
      g->set_cached_groups(s.cached_groups);
      g->set_cache_bytes(s.cache_bytes);
      g->set_cache_hits(s.cache_hits);
      g->set_cache_hit_bytes(s.cache_hit_bytes);
      g->set_cache_link_bytes(s.cache_link_bytes);
    }
  }
}

bool UsedBy(const ComponentView& v, const std::string& pipeline) {
  return std::find(v.pipelines.begin(), v.pipelines.end(), pipeline) != v.pipelines.end();
}

bool IsGroupOffloaded(const ComponentView& v) {
  return v.state == ComponentState::kGroupOffloaded || v.state == ComponentState::kPartiallyResident;
}

// Placement warnings go to the server's log as well as into replies and metrics.
void LogWarnings(const std::vector<std::string>& warnings) {
  for (const std::string& w : warnings) LogWarning(w);
}

}  // namespace

absl::StatusOr<v1::GetPlacementResponse> AdminCore::GetPlacement(const v1::GetPlacementRequest& request) const {
  ASSIGN_OR_RETURN(DeviceRuntime * core, devices_->Device(request.device()));
  const std::shared_ptr<const PlacementSnapshot> snapshot = core->placement_snapshot();
  v1::GetPlacementResponse response;
  response.set_device(snapshot->device);
  response.set_budget_bytes(snapshot->memory.budget_bytes);
  response.set_allocated_bytes(snapshot->memory.allocated_bytes);
  response.set_reserved_bytes(snapshot->memory.reserved_bytes);
  response.set_context_bytes(snapshot->memory.context_bytes);
  response.set_strategy(snapshot->strategy);
  FillComponents(*snapshot, response.mutable_components(), [](const ComponentView&) { return true; });
  for (const std::string& w : snapshot->warnings) response.add_warnings(w);
  response.set_oom_recoveries(snapshot->counters.oom_recoveries);
  response.set_pipeline_prefetches(snapshot->counters.pipeline_prefetches);
  response.set_pipeline_prefetch_bytes(snapshot->counters.pipeline_prefetch_bytes);
  response.set_pipeline_prefetches_used(snapshot->counters.pipeline_prefetches_used);
  response.set_pipeline_prefetches_unused(snapshot->counters.pipeline_prefetches_unused);
  response.set_runs_begun(snapshot->counters.runs_begun);
  response.set_cache_margin_bytes(snapshot->cache_margin_bytes);
  response.set_allocator_retries(snapshot->memory.allocator_retries);
  response.set_allocator_ooms(snapshot->memory.allocator_ooms);
  for (v1::Adapter& adapter : core->Adapters()) *response.add_adapters() = std::move(adapter);
  return response;
}

absl::StatusOr<v1::SetOffloadStrategyResponse> AdminCore::SetOffloadStrategy(
    const v1::SetOffloadStrategyRequest& request, const Interrupt& interrupt) {
  v1::SetOffloadStrategyResponse response;
  ASSIGN_OR_RETURN(DeviceRuntime * core, devices_->Device(request.device()));
  RETURN_IF_ERROR(core->ChangeDevice(
      [&](PlacementManager& placement) -> absl::Status {
        // Workflow rules name components: validated against those registered now, on the worker,
        // so no load or unload can slip in between the check and the change.
        std::vector<std::string> names, ids;
        for (const ComponentView& v : placement.Snapshot()) {
          names.push_back(v.name);
          ids.push_back(v.id);
        }
        ASSIGN_OR_RETURN(std::unique_ptr<OffloadStrategy> strategy,
                         ToOffloadStrategy(request.strategy(), names, ids));
        response.set_strategy(strategy->name());
        const std::string warning = placement.SetStrategy(std::move(strategy));
        if (!warning.empty()) response.add_warnings(warning);
        return absl::OkStatus();
      },
      interrupt));
  LogWarnings({response.warnings().begin(), response.warnings().end()});
  return response;
}

absl::StatusOr<v1::EnableGroupOffloadResponse> AdminCore::EnableGroupOffload(
    const v1::EnableGroupOffloadRequest& request, const Interrupt& interrupt) {
  ASSIGN_OR_RETURN(DeviceRuntime * core, devices_->Device(request.device()));
  std::function<absl::Status(PlacementManager&)> change;
  std::function<bool(const ComponentView&)> changed;
  if (request.has_component_id()) {
    if (request.exclude_size() > 0 || request.overrides_size() > 0) {
      return absl::InvalidArgumentError("exclude and overrides apply to a pipeline target, not to component_id");
    }
    ASSIGN_OR_RETURN(GroupOffloadOptions options, ToGroupOffloadOptions(request.options(), "options"));
    const std::string id = request.component_id();
    change = [id, options](PlacementManager& placement) { return placement.EnableGroupOffload(id, options); };
    changed = [id](const ComponentView& v) { return v.id == id; };
  } else if (request.has_pipeline()) {
    v1::PipelineGroupOffload config;
    *config.mutable_defaults() = request.options();
    *config.mutable_exclude() = request.exclude();
    *config.mutable_overrides() = request.overrides();
    ASSIGN_OR_RETURN(PipelineGroupOffloadOptions options, ToPipelineGroupOffloadOptions(config, "request"));
    const std::string pipeline = request.pipeline();
    change = [pipeline, options](PlacementManager& placement) {
      return placement.EnablePipelineGroupOffload(pipeline, options);
    };
    changed = [pipeline](const ComponentView& v) { return UsedBy(v, pipeline); };
  } else {
    return absl::InvalidArgumentError("set component_id or pipeline");
  }
  RETURN_IF_ERROR(core->ChangeDevice(change, interrupt));
  const std::shared_ptr<const PlacementSnapshot> snapshot = core->placement_snapshot();
  LogWarnings(snapshot->warnings);
  v1::EnableGroupOffloadResponse response;
  FillComponents(*snapshot, response.mutable_components(), changed);
  return response;
}

absl::StatusOr<v1::DisableGroupOffloadResponse> AdminCore::DisableGroupOffload(
    const v1::DisableGroupOffloadRequest& request, const Interrupt& interrupt) {
  if (!request.has_component_id() && !request.has_pipeline()) {
    return absl::InvalidArgumentError("set component_id or pipeline");
  }
  ASSIGN_OR_RETURN(DeviceRuntime * core, devices_->Device(request.device()));
  std::vector<std::string> ids;
  RETURN_IF_ERROR(core->ChangeDevice(
      [&](PlacementManager& placement) -> absl::Status {
        if (request.has_component_id()) {
          ids.push_back(request.component_id());
        } else {
          for (const ComponentView& v : placement.Snapshot()) {
            if (UsedBy(v, request.pipeline()) && IsGroupOffloaded(v)) ids.push_back(v.id);
          }
          if (ids.empty()) {
            return absl::FailedPreconditionError(absl::StrCat(
                "pipeline '", Truncated(request.pipeline()), "' has no group-offloaded component"));
          }
        }
        // Disabling fails only for an unknown or not group-offloaded id: check them all first, so
        // a refused request changes nothing.
        for (const std::string& id : ids) {
          RETURN_IF_ERROR(placement.GroupOffloadStatsOf(id).status());
        }
        for (const std::string& id : ids) RETURN_IF_ERROR(placement.DisableGroupOffload(id));
        return absl::OkStatus();
      },
      interrupt));
  v1::DisableGroupOffloadResponse response;
  FillComponents(*core->placement_snapshot(), response.mutable_components(), [&](const ComponentView& v) {
    return std::find(ids.begin(), ids.end(), v.id) != ids.end();
  });
  return response;
}

absl::StatusOr<v1::LoadPipelineResponse> AdminCore::LoadPipeline(const v1::LoadPipelineRequest& request,
                                                                 const Interrupt& interrupt) {
  v1::LoadPipelineResponse response;
  ASSIGN_OR_RETURN(*response.mutable_pipeline(), devices_->LoadPipeline(request.pipeline(), interrupt));
  return response;
}

absl::StatusOr<v1::UnloadPipelineResponse> AdminCore::UnloadPipeline(const v1::UnloadPipelineRequest& request,
                                                                     const Interrupt& interrupt) {
  RETURN_IF_ERROR(devices_->UnloadPipeline(request.name(), interrupt));
  return v1::UnloadPipelineResponse();
}

absl::StatusOr<v1::LoadAdapterResponse> AdminCore::LoadAdapter(const v1::LoadAdapterRequest& request,
                                                               const Interrupt& interrupt) {
  v1::LoadAdapterResponse response;
  ASSIGN_OR_RETURN(*response.mutable_adapter(), devices_->LoadAdapter(request, interrupt));
  return response;
}

absl::StatusOr<v1::UnloadAdapterResponse> AdminCore::UnloadAdapter(const v1::UnloadAdapterRequest& request,
                                                                   const Interrupt& interrupt) {
  RETURN_IF_ERROR(devices_->UnloadAdapter(request, interrupt));
  return v1::UnloadAdapterResponse();
}

absl::StatusOr<v1::SetBatchingResponse> AdminCore::SetBatching(const v1::SetBatchingRequest& request) {
  v1::SetBatchingResponse response;
  ASSIGN_OR_RETURN(*response.mutable_pipeline(), devices_->SetBatching(request.pipeline(), request.batching()));
  return response;
}

absl::StatusOr<v1::SetSchedulerResponse> AdminCore::SetScheduler(const v1::SetSchedulerRequest& request) {
  v1::SetSchedulerResponse response;
  ASSIGN_OR_RETURN(*response.mutable_scheduler(), devices_->SetScheduler(request.scheduler()));
  LogInfo(absl::StrCat("admin set_scheduler ", LogValue(response.scheduler().ShortDebugString())));
  return response;
}

v1::GetSchedulerResponse AdminCore::GetScheduler() const {
  v1::GetSchedulerResponse response;
  *response.mutable_scheduler() = devices_->SchedulerInForce();
  return response;
}

absl::StatusOr<v1::GetPlacementLogResponse> AdminCore::GetPlacementLog(
    const v1::GetPlacementLogRequest& request) const {
  if (request.limit() < 0 || request.limit() > kMaxLogLimit) {
    return absl::InvalidArgumentError(
        absl::StrCat("limit is ", request.limit(), "; must be within [0, ", kMaxLogLimit, "] (0 = ",
                     kDefaultLogLimit, ")"));
  }
  const size_t limit = request.limit() == 0 ? kDefaultLogLimit : static_cast<size_t>(request.limit());
  ASSIGN_OR_RETURN(DeviceRuntime * core, devices_->Device(request.device()));
  v1::GetPlacementLogResponse response;
  for (const PlacementDecision& d : core->DecisionLog(limit)) {
    v1::PlacementDecision* out = response.add_decisions();
    *out->mutable_time() = TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(d.time));
    out->set_request_id(d.request_id);
    out->set_component(d.component);
    out->set_action(d.action);
    out->set_bytes(d.bytes);
    out->set_free_before(d.free_before == INT64_MAX ? -1 : d.free_before);
    out->set_free_after(d.free_after == INT64_MAX ? -1 : d.free_after);
    out->set_strategy(d.strategy);
    out->set_reason(d.reason);
    out->set_to_device(d.to_device);
    out->set_d2d_seconds(d.d2d_seconds);
    out->set_h2d_seconds(d.h2d_seconds);
  }
  return response;
}

absl::StatusOr<v1::MoveComponentResponse> AdminCore::MoveComponent(const v1::MoveComponentRequest& request,
                                                                   const Interrupt& interrupt) {
  return devices_->MoveComponent(request, interrupt);
}

absl::StatusOr<v1::SetMemoryBudgetResponse> AdminCore::SetMemoryBudget(const v1::SetMemoryBudgetRequest& request,
                                                                       const Interrupt& interrupt) {
  if (request.memory_budget_bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat("memory_budget_bytes: ", request.memory_budget_bytes(),
                                                   " is negative; >= 0 (0: the whole device)"));
  }
  ASSIGN_OR_RETURN(DeviceRuntime * core, devices_->Device(request.device()));
  std::vector<std::string> offloaded;
  RETURN_IF_ERROR(core->ChangeDevice(
      [&](PlacementManager& placement) { return placement.SetMemoryBudget(request.memory_budget_bytes(), &offloaded); },
      interrupt));
  const std::shared_ptr<const PlacementSnapshot> snapshot = core->placement_snapshot();
  v1::SetMemoryBudgetResponse response;
  response.set_budget_bytes(snapshot->memory.budget_bytes);
  response.set_allocated_bytes(snapshot->memory.allocated_bytes);
  for (std::string& id : offloaded) response.add_offloaded(std::move(id));
  LogInfo(absl::StrCat("admin set_memory_budget device=", snapshot->device, " budget_bytes=", response.budget_bytes(),
                       " allocated_bytes=", response.allocated_bytes(), " offloaded=", offloaded.size()));
  return response;
}

absl::StatusOr<v1::DrainDeviceResponse> AdminCore::DrainDevice(const v1::DrainDeviceRequest& request) {
  return devices_->Drain(request.device(), request.drain());
}

}  // namespace stowage
