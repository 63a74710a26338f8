#include "offload/host_store_factory.h"

#include <string>

#include "base/status_macros.h"

#include "offload/compressed_host_store.h"
#include "offload/disk_host_store.h"
#include "offload/pinned_host_store.h"
#include "offload/pinned_in_place_host_store.h"
#include "offload/staged_host_store.h"

namespace stowage {

absl::Status ValidateHostStoreOptions(const HostStoreOptions& options) {
  if (options.target != OffloadTarget::kPinnedHost &&
      (options.staging_buffers < 1 || options.staging_buffer_bytes < (int64_t{1} << 16))) {
    return absl::InvalidArgumentError("staging needs at least one buffer of at least 64 KiB");
  }
  if (options.staging_threads < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("staging_threads must be >= 1 (threads copying host memory), not ", options.staging_threads));
  }
  if (options.compress != CompressFormat::kNone && options.target != OffloadTarget::kPinnedHost) {
    return absl::InvalidArgumentError(
        "compress needs target pinned_host (the 8-bit groups are packed into pinned memory)");
  }
  if (options.compress != CompressFormat::kNone && options.quantize_chunk_elements < 1024) {
    return absl::InvalidArgumentError(absl::StrCat("quantize_chunk_elements must be >= 1024 (values quantized at a time), not ",
                                                   options.quantize_chunk_elements));
  }
  if (options.prequantized != nullptr && options.compress == CompressFormat::kNone) {
    return absl::InvalidArgumentError("8-bit weights were given but compress is none");
  }
  return absl::OkStatus();
}

StoreScratch PlanStoreScratch(const HostStoreOptions& options, HostWeights& weights) {
  if (options.compress == CompressFormat::kNone) {
    return StoreScratch{std::vector<int64_t>(weights.entries().size(), 0), {}, 0};
  }
  return CompressedHostStore::PlanScratch(options.compress, weights);
}

absl::StatusOr<std::unique_ptr<HostStore>> CreateHostStore(const HostStoreOptions& options,
                                                           const std::vector<PlannedGroup>& groups,
                                                           HostWeights& weights, DeviceBackend& backend) {
  RETURN_IF_ERROR(ValidateHostStoreOptions(options));
  if (options.compress != CompressFormat::kNone) return CompressedHostStore::Create(options, groups, weights, backend);
  // The other stores copy, map or pin the host bytes as they are: deferred FP8 weights are written
  // first.
  weights.MaterializeDeferred();
  switch (options.target) {
    case OffloadTarget::kPinnedHost:
      return PinnedHostStore::Create(groups, weights, backend, options.staging_threads);
    case OffloadTarget::kDisk:
      return DiskHostStore::Create(options, groups, weights, backend);
    case OffloadTarget::kPageableHost: {
      std::string refused;
      if (options.pin_in_place) {
        absl::StatusOr<std::unique_ptr<HostStore>> in_place =
            PinnedInPlaceHostStore::Create(groups, weights, backend);
        if (in_place.ok()) return in_place;
        refused = std::string(in_place.status().message());
      }
      return StagedHostStore::Create(options, groups, weights, backend, std::move(refused));
    }
  }
  return absl::InvalidArgumentError("unknown offload target");
}

}  // namespace stowage
