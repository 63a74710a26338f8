#include "server/admin_service.h"

#include <chrono>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/generation_service.h"

namespace stowage {
namespace {

Interrupt InterruptFor(grpc::ServerContext* context) {
  return [context]() -> absl::Status {
    if (context->IsCancelled()) return absl::CancelledError("cancelled by the client");
    if (context->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("deadline exceeded before the change could run; nothing changed");
    }
    return absl::OkStatus();
  };
}

template <typename Response>
grpc::Status Reply(absl::StatusOr<Response> result, Response* response) {
  if (!result.ok()) return ToGrpcStatus(result.status());
  *response = *std::move(result);
  return grpc::Status::OK;
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

// Each RPC: authenticate, then one call into the transport-free core.
#define STOWAGE_AUTHORIZE(context) \
  if (absl::Status auth = Authorize(context); !auth.ok()) return ToGrpcStatus(auth)

grpc::Status AdminServiceImpl::GetPlacement(grpc::ServerContext* context, const v1::GetPlacementRequest* request,
                                            v1::GetPlacementResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.GetPlacement(*request), response);
}

grpc::Status AdminServiceImpl::SetOffloadStrategy(grpc::ServerContext* context,
                                                  const v1::SetOffloadStrategyRequest* request,
                                                  v1::SetOffloadStrategyResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.SetOffloadStrategy(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::EnableGroupOffload(grpc::ServerContext* context,
                                                  const v1::EnableGroupOffloadRequest* request,
                                                  v1::EnableGroupOffloadResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.EnableGroupOffload(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::DisableGroupOffload(grpc::ServerContext* context,
                                                   const v1::DisableGroupOffloadRequest* request,
                                                   v1::DisableGroupOffloadResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.DisableGroupOffload(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::LoadPipeline(grpc::ServerContext* context, const v1::LoadPipelineRequest* request,
                                            v1::LoadPipelineResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.LoadPipeline(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::UnloadPipeline(grpc::ServerContext* context, const v1::UnloadPipelineRequest* request,
                                              v1::UnloadPipelineResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.UnloadPipeline(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::LoadAdapter(grpc::ServerContext* context, const v1::LoadAdapterRequest* request,
                                           v1::LoadAdapterResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.LoadAdapter(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::UnloadAdapter(grpc::ServerContext* context, const v1::UnloadAdapterRequest* request,
                                             v1::UnloadAdapterResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.UnloadAdapter(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::SetBatching(grpc::ServerContext* context, const v1::SetBatchingRequest* request,
                                           v1::SetBatchingResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.SetBatching(*request), response);
}

grpc::Status AdminServiceImpl::SetScheduler(grpc::ServerContext* context, const v1::SetSchedulerRequest* request,
                                            v1::SetSchedulerResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.SetScheduler(*request), response);
}

grpc::Status AdminServiceImpl::GetScheduler(grpc::ServerContext* context, const v1::GetSchedulerRequest* request,
                                            v1::GetSchedulerResponse* response) {
  (void)request;
  STOWAGE_AUTHORIZE(context);
  *response = core_.GetScheduler();
  return grpc::Status::OK;
}

grpc::Status AdminServiceImpl::DrainDevice(grpc::ServerContext* context, const v1::DrainDeviceRequest* request,
                                           v1::DrainDeviceResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.DrainDevice(*request), response);
}

grpc::Status AdminServiceImpl::MoveComponent(grpc::ServerContext* context, const v1::MoveComponentRequest* request,
                                             v1::MoveComponentResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.MoveComponent(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::SetMemoryBudget(grpc::ServerContext* context, const v1::SetMemoryBudgetRequest* request,
                                               v1::SetMemoryBudgetResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.SetMemoryBudget(*request, InterruptFor(context)), response);
}

grpc::Status AdminServiceImpl::GetPlacementLog(grpc::ServerContext* context,
                                               const v1::GetPlacementLogRequest* request,
                                               v1::GetPlacementLogResponse* response) {
  STOWAGE_AUTHORIZE(context);
  return Reply(core_.GetPlacementLog(*request), response);
}

#undef STOWAGE_AUTHORIZE

}  // namespace stowage
