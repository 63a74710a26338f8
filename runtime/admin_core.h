// AdminCore: the transport-free admin API. Each method takes the request message, returns the
// response or a status, and knows nothing of gRPC or HTTP; AdminServiceImpl (and any other front)
// is authentication plus a one-line adapter per RPC.
//
// Every change goes through DeviceRuntime::ChangeDevice (or its Load/Unload), so it runs on the
// device's worker between requests; reads use the snapshot the worker published. A refused change
// changes nothing: requests are validated completely before a task is posted, and whole-pipeline
// changes are all or nothing on the worker. Client text echoed in messages is cut to a short prefix.
//
// Thread-safety: thread-safe (every method may be called from any thread but the device worker's).
#ifndef STOWAGE_RUNTIME_ADMIN_CORE_H_
#define STOWAGE_RUNTIME_ADMIN_CORE_H_

#include "absl/status/statusor.h"
#include "runtime/device_set.h"
#include "runtime/device_runtime.h"
#include "stowage/v1/admin.pb.h"

namespace stowage {

class AdminCore {
 public:
  // `devices` must outlive this object. Requests naming a device ("" = the first) act on it.
  explicit AdminCore(DeviceSet* devices) : devices_(devices) {}

  absl::StatusOr<v1::GetPlacementResponse> GetPlacement(const v1::GetPlacementRequest& request) const;
  absl::StatusOr<v1::SetOffloadStrategyResponse> SetOffloadStrategy(const v1::SetOffloadStrategyRequest& request,
                                                                    const Interrupt& interrupt);
  absl::StatusOr<v1::EnableGroupOffloadResponse> EnableGroupOffload(const v1::EnableGroupOffloadRequest& request,
                                                                    const Interrupt& interrupt);
  absl::StatusOr<v1::DisableGroupOffloadResponse> DisableGroupOffload(
      const v1::DisableGroupOffloadRequest& request, const Interrupt& interrupt);
  absl::StatusOr<v1::LoadPipelineResponse> LoadPipeline(const v1::LoadPipelineRequest& request,
                                                        const Interrupt& interrupt);
  absl::StatusOr<v1::UnloadPipelineResponse> UnloadPipeline(const v1::UnloadPipelineRequest& request,
                                                            const Interrupt& interrupt);
  absl::StatusOr<v1::LoadAdapterResponse> LoadAdapter(const v1::LoadAdapterRequest& request,
                                                      const Interrupt& interrupt);
  absl::StatusOr<v1::UnloadAdapterResponse> UnloadAdapter(const v1::UnloadAdapterRequest& request,
                                                          const Interrupt& interrupt);
  absl::StatusOr<v1::GetPlacementLogResponse> GetPlacementLog(const v1::GetPlacementLogRequest& request) const;
  absl::StatusOr<v1::SetBatchingResponse> SetBatching(const v1::SetBatchingRequest& request);
  absl::StatusOr<v1::SetSchedulerResponse> SetScheduler(const v1::SetSchedulerRequest& request);
  v1::GetSchedulerResponse GetScheduler() const;
  absl::StatusOr<v1::DrainDeviceResponse> DrainDevice(const v1::DrainDeviceRequest& request);
  absl::StatusOr<v1::MoveComponentResponse> MoveComponent(const v1::MoveComponentRequest& request,
                                                          const Interrupt& interrupt);
  absl::StatusOr<v1::SetMemoryBudgetResponse> SetMemoryBudget(const v1::SetMemoryBudgetRequest& request,
                                                              const Interrupt& interrupt);

  // Bounds of GetPlacementLogRequest.limit (0 = kDefaultLogLimit).
  static constexpr int kMaxLogLimit = 4096;
  static constexpr int kDefaultLogLimit = 100;

 private:
  DeviceSet* devices_;
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_ADMIN_CORE_H_
