// AdminService over gRPC: bearer-token authentication, then a one-line adapter per RPC over the
// transport-free AdminCore. A refused change changes nothing.
#ifndef STOWAGE_SERVER_ADMIN_SERVICE_H_
#define STOWAGE_SERVER_ADMIN_SERVICE_H_

#include <string>

#include "absl/status/status.h"
#include "runtime/admin_core.h"
#include "stowage/v1/admin.grpc.pb.h"

namespace stowage {

// Checks "authorization: Bearer <token>" against `expected` in constant time. Empty `expected`
// (no token configured): FAILED_PRECONDITION; missing or malformed header: UNAUTHENTICATED;
// wrong token: PERMISSION_DENIED.
absl::Status CheckBearerToken(const std::string& expected, const std::string* header);

// Compares two strings in time that depends only on their lengths.
bool ConstantTimeEquals(const std::string& a, const std::string& b);

class AdminServiceImpl final : public v1::AdminService::Service {
 public:
  // `core` must outlive the service. `token` empty disables the API (every call fails).
  AdminServiceImpl(DeviceSet* devices, std::string token) : core_(devices), token_(std::move(token)) {}

  grpc::Status GetPlacement(grpc::ServerContext* context, const v1::GetPlacementRequest* request,
                            v1::GetPlacementResponse* response) override;
  grpc::Status SetOffloadStrategy(grpc::ServerContext* context,
                                  const v1::SetOffloadStrategyRequest* request,
                                  v1::SetOffloadStrategyResponse* response) override;
  grpc::Status EnableGroupOffload(grpc::ServerContext* context,
                                  const v1::EnableGroupOffloadRequest* request,
                                  v1::EnableGroupOffloadResponse* response) override;
  grpc::Status DisableGroupOffload(grpc::ServerContext* context,
                                   const v1::DisableGroupOffloadRequest* request,
                                   v1::DisableGroupOffloadResponse* response) override;
  grpc::Status LoadPipeline(grpc::ServerContext* context, const v1::LoadPipelineRequest* request,
                            v1::LoadPipelineResponse* response) override;
  grpc::Status UnloadPipeline(grpc::ServerContext* context, const v1::UnloadPipelineRequest* request,
                              v1::UnloadPipelineResponse* response) override;
  grpc::Status LoadAdapter(grpc::ServerContext* context, const v1::LoadAdapterRequest* request,
                           v1::LoadAdapterResponse* response) override;
  grpc::Status UnloadAdapter(grpc::ServerContext* context, const v1::UnloadAdapterRequest* request,
                             v1::UnloadAdapterResponse* response) override;
  grpc::Status SetBatching(grpc::ServerContext* context, const v1::SetBatchingRequest* request,
                           v1::SetBatchingResponse* response) override;
  grpc::Status SetScheduler(grpc::ServerContext* context, const v1::SetSchedulerRequest* request,
                            v1::SetSchedulerResponse* response) override;
  grpc::Status GetScheduler(grpc::ServerContext* context, const v1::GetSchedulerRequest* request,
                            v1::GetSchedulerResponse* response) override;
  grpc::Status DrainDevice(grpc::ServerContext* context, const v1::DrainDeviceRequest* request,
                           v1::DrainDeviceResponse* response) override;
  grpc::Status MoveComponent(grpc::ServerContext* context, const v1::MoveComponentRequest* request,
                             v1::MoveComponentResponse* response) override;
  grpc::Status SetMemoryBudget(grpc::ServerContext* context, const v1::SetMemoryBudgetRequest* request,
                               v1::SetMemoryBudgetResponse* response) override;
  grpc::Status GetPlacementLog(grpc::ServerContext* context,
                               const v1::GetPlacementLogRequest* request,
                               v1::GetPlacementLogResponse* response) override;

 private:
  absl::Status Authorize(grpc::ServerContext* context) const;
  AdminCore core_;
  std::string token_;
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_ADMIN_SERVICE_H_
