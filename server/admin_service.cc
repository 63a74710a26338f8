#include "server/admin_service.h"

#include <chrono>
#include <iostream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "google/protobuf/util/time_util.h"
#include "base/status_macros.h"
#include "server/config.h"
#include "server/generation_service.h"

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

void FillComponents(PlacementManager& placement,
                    google::protobuf::RepeatedPtrField<v1::ComponentPlacement>* out,
                    const std::function<bool(const ComponentView&)>& keep) {
  for (const ComponentView& v : placement.Snapshot()) {
    if (!keep(v)) continue;
    v1::ComponentPlacement* c = out->Add();
    c->set_id(v.id);
    c->set_name(v.name);
    c->set_kind(v.kind);
    for (const std::string& p : v.pipelines) c->add_pipelines(p);
    c->set_weight_bytes(v.weight_bytes);
    c->set_device_bytes(v.device_bytes);
    c->set_state(ToProto(v.state));
    if (v.last_use != absl::InfinitePast()) {
      *c->mutable_last_use() = TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(v.last_use));
    }
    if (v.state == ComponentState::kGroupOffloaded || v.state == ComponentState::kPartiallyResident) {
      absl::StatusOr<GroupOffloadStats> s = placement.GroupOffloadStatsOf(v.id);
      if (s.ok()) {
        v1::GroupOffloadStatus* g = c->mutable_group_offload();
        g->set_groups(s->groups);
        g->set_streamed_groups(s->streamed_groups);
        g->set_resident_groups(s->resident_groups);
        g->set_slots(s->slots);
        g->set_slot_bytes(s->slot_bytes);
        g->set_working_set_bytes(s->working_set_bytes);
        g->set_forwards(s->forwards);
        g->set_prefetches(s->prefetches);
        g->set_sync_onloads(s->sync_onloads);
        g->set_pinned_in_place_bytes(s->pinned_in_place_bytes);
        g->set_pin_in_place_error(s->pin_in_place_error);
      }
    }
  }
}

std::function<absl::Status()> InterruptFor(grpc::ServerContext* context) {
  return [context]() -> absl::Status {
    if (context->IsCancelled()) return absl::CancelledError("cancelled by the client");
    if (context->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("deadline exceeded while waiting for in-flight requests");
    }
    return absl::OkStatus();
  };
}

// Placement warnings go to the server's log as well as into replies and metrics.
void LogWarnings(const std::vector<std::string>& warnings) {
  for (const std::string& w : warnings) std::cerr << "stowage_server: warning: " << w << std::endl;
}

}  // namespace

bool ConstantTimeEquals(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const size_t n = std::max(a.size(), b.size());
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0;
}

absl::Status CheckBearerToken(const std::string& expected, const std::string* header) {
  if (expected.empty()) {
    return absl::FailedPreconditionError(
        "the admin API is disabled: set auth.admin_token or auth.admin_token_file in the server config");
  }
  if (header == nullptr) {
    return absl::UnauthenticatedError("missing 'authorization: Bearer <token>' metadata");
  }
  if (!absl::StartsWith(*header, "Bearer ")) {
    return absl::UnauthenticatedError("authorization metadata must be 'Bearer <token>'");
  }
  if (!ConstantTimeEquals(header->substr(7), expected)) {
    return absl::PermissionDeniedError("wrong admin token");
  }
  return absl::OkStatus();
}

absl::Status AdminServiceImpl::Authorize(grpc::ServerContext* context) const {
  const auto& metadata = context->client_metadata();
  auto it = metadata.find("authorization");
  std::string header;
  if (it != metadata.end()) header.assign(it->second.data(), it->second.size());
  return CheckBearerToken(token_, it == metadata.end() ? nullptr : &header);
}

grpc::Status AdminServiceImpl::GetPlacement(grpc::ServerContext* context,
                                            const v1::GetPlacementRequest*,
                                            v1::GetPlacementResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  PlacementManager& placement = core_->placement();
  const DeviceMemoryStats stats = core_->backend().GetMemoryStats();
  response->set_device(core_->backend().name());
  response->set_budget_bytes(stats.budget_bytes);
  response->set_allocated_bytes(stats.allocated_bytes);
  response->set_strategy(placement.strategy_name());
  FillComponents(placement, response->mutable_components(), [](const ComponentView&) { return true; });
  for (const std::string& w : placement.Warnings()) response->add_warnings(w);
  response->set_oom_recoveries(placement.oom_recoveries());
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::SetOffloadStrategy(grpc::ServerContext* context,
                                                  const v1::SetOffloadStrategyRequest* request,
                                                  v1::SetOffloadStrategyResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<std::unique_ptr<OffloadStrategy>> strategy =
      ToOffloadStrategy(request->strategy(), core_->ComponentNames());
  if (!strategy.ok()) return ToGrpcStatus(strategy.status());
  response->set_strategy((*strategy)->name());
  const std::string warning = core_->placement().SetStrategy(*std::move(strategy));
  if (!warning.empty()) {
    response->add_warnings(warning);
    LogWarnings({warning});
  }
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::EnableGroupOffload(grpc::ServerContext* context,
                                                  const v1::EnableGroupOffloadRequest* request,
                                                  v1::EnableGroupOffloadResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  absl::Status status;
  std::string pipeline;
  if (request->has_component_id()) {
    if (request->exclude_size() > 0 || request->overrides_size() > 0) {
      return ToGrpcStatus(absl::InvalidArgumentError(
          "exclude and overrides apply to a pipeline target, not to component_id"));
    }
    absl::StatusOr<GroupOffloadOptions> options = ToGroupOffloadOptions(request->options(), "options");
    if (!options.ok()) return ToGrpcStatus(options.status());
    status = core_->placement().EnableGroupOffload(request->component_id(), *options);
  } else if (request->has_pipeline()) {
    v1::PipelineGroupOffload config;
    *config.mutable_defaults() = request->options();
    *config.mutable_exclude() = request->exclude();
    *config.mutable_overrides() = request->overrides();
    absl::StatusOr<PipelineGroupOffloadOptions> options = ToPipelineGroupOffloadOptions(config, "request");
    if (!options.ok()) return ToGrpcStatus(options.status());
    pipeline = request->pipeline();
    status = core_->placement().EnablePipelineGroupOffload(pipeline, *options);
  } else {
    return ToGrpcStatus(absl::InvalidArgumentError("set component_id or pipeline"));
  }
  if (!status.ok()) return ToGrpcStatus(status);
  LogWarnings(core_->placement().Warnings());
  const std::string id = request->component_id();
  FillComponents(core_->placement(), response->mutable_components(), [&](const ComponentView& v) {
    return id.empty() ? std::find(v.pipelines.begin(), v.pipelines.end(), pipeline) != v.pipelines.end()
                      : v.id == id;
  });
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::DisableGroupOffload(grpc::ServerContext* context,
                                                   const v1::DisableGroupOffloadRequest* request,
                                                   v1::DisableGroupOffloadResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  PlacementManager& placement = core_->placement();
  std::vector<std::string> ids;
  if (request->has_component_id()) {
    ids.push_back(request->component_id());
  } else if (request->has_pipeline()) {
    for (const ComponentView& v : placement.Snapshot()) {
      if (std::find(v.pipelines.begin(), v.pipelines.end(), request->pipeline()) != v.pipelines.end() &&
          (v.state == ComponentState::kGroupOffloaded || v.state == ComponentState::kPartiallyResident)) {
        ids.push_back(v.id);
      }
    }
    if (ids.empty()) {
      return ToGrpcStatus(absl::FailedPreconditionError(absl::StrCat(
          "pipeline '", request->pipeline(), "' has no group-offloaded component")));
    }
  } else {
    return ToGrpcStatus(absl::InvalidArgumentError("set component_id or pipeline"));
  }
  for (const std::string& id : ids) {
    if (absl::Status s = placement.DisableGroupOffload(id); !s.ok()) return ToGrpcStatus(s);
  }
  FillComponents(placement, response->mutable_components(), [&](const ComponentView& v) {
    return std::find(ids.begin(), ids.end(), v.id) != ids.end();
  });
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::LoadPipeline(grpc::ServerContext* context,
                                            const v1::LoadPipelineRequest* request,
                                            v1::LoadPipelineResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  absl::StatusOr<v1::Pipeline> loaded = core_->LoadPipeline(request->pipeline());
  if (!loaded.ok()) return ToGrpcStatus(loaded.status());
  *response->mutable_pipeline() = *std::move(loaded);
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::UnloadPipeline(grpc::ServerContext* context,
                                              const v1::UnloadPipelineRequest* request,
                                              v1::UnloadPipelineResponse*) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  return ToGrpcStatus(core_->UnloadPipeline(request->name(), InterruptFor(context)));
}

grpc::Status AdminServiceImpl::GetPlacementLog(grpc::ServerContext* context,
                                               const v1::GetPlacementLogRequest* request,
                                               v1::GetPlacementLogResponse* response) {
  if (absl::Status s = Authorize(context); !s.ok()) return ToGrpcStatus(s);
  if (request->limit() < 0 || request->limit() > 4096) {
    return ToGrpcStatus(absl::InvalidArgumentError("limit must be within [0, 4096] (0 = 100)"));
  }
  const size_t limit = request->limit() == 0 ? 100 : static_cast<size_t>(request->limit());
  for (const PlacementDecision& d : core_->placement().DecisionLog(limit)) {
    v1::PlacementDecision* out = response->add_decisions();
    *out->mutable_time() = TimeUtil::NanosecondsToTimestamp(absl::ToUnixNanos(d.time));
    out->set_request_id(d.request_id);
    out->set_component(d.component);
    out->set_action(d.action);
    out->set_bytes(d.bytes);
    out->set_free_before(d.free_before == INT64_MAX ? -1 : d.free_before);
    out->set_free_after(d.free_after == INT64_MAX ? -1 : d.free_after);
    out->set_strategy(d.strategy);
    out->set_reason(d.reason);
  }
  return grpc::Status::OK;
}

}  // namespace stowage
