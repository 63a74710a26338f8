// CreateHostStore: the one place that maps an OffloadTarget to its HostStore class
// (offload/host_store.h). The engine calls it once per Apply and never names a store.
//
// Thread-safety: reentrant; the store it returns is used as HostStore says.
#ifndef STOWAGE_OFFLOAD_HOST_STORE_FACTORY_H_
#define STOWAGE_OFFLOAD_HOST_STORE_FACTORY_H_

#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/device_backend.h"
#include "offload/group_plan.h"
#include "offload/host_store.h"
#include "offload/host_weights.h"

namespace stowage {

// Checks the options the target uses, before anything is planned or moved (INVALID_ARGUMENT names
// the option, not the component: the caller adds it).
absl::Status ValidateHostStoreOptions(const HostStoreOptions& options);

// The device scratch each host tensor of `weights` needs under `options` (in entries() order) and
// the fixed part: what the planner reserves (PlanTensor::scratch_bytes,
// GroupPlanOptions::fixed_scratch_bytes) and the created store's device_scratch_bytes() matches.
StoreScratch PlanStoreScratch(const HostStoreOptions& options, HostWeights& weights);

// Creates the store of options.target for the planned groups of `weights`:
//   compress != kNone -> CompressedHostStore (target kPinnedHost only)
//   kPinnedHost   -> PinnedHostStore
//   kPageableHost -> PinnedInPlaceHostStore when pin_in_place and the host accepts; otherwise
//                    StagedHostStore (with the refusal in stats().pin_in_place_error)
//   kDisk         -> DiskHostStore
// The backend and `weights` must outlive the store.
absl::StatusOr<std::unique_ptr<HostStore>> CreateHostStore(const HostStoreOptions& options,
                                                           const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_STORE_FACTORY_H_
