// RuntimeFactories: what the runtime builds its devices and pipelines from, injected by whoever
// creates it (DeviceSet::Create, DeviceRuntime::Create). The server passes none and gets the
// defaults: every architecture this build knows (DefaultPipelineRegistry) and the backend a device's
// config names (CUDA, or the simulated accelerator). Tests pass their own registry — e.g. one with a
// pipeline that blocks on a latch — or their own backend, to drive the runtime without gRPC and
// without sleeping to order what happens.
#ifndef STOWAGE_RUNTIME_RUNTIME_FACTORIES_H_
#define STOWAGE_RUNTIME_RUNTIME_FACTORIES_H_

#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "models/pipeline_registry.h"
#include "offload/device_backend.h"
#include "stowage/v1/config.pb.h"

namespace stowage {

struct RuntimeFactories {
  // The architectures pipelines are built from; null: DefaultPipelineRegistry(). Must outlive the
  // runtime. Config validation (FinalizeServerConfig, a LoadPipeline's config) checks built-in
  // names against the same registry.
  const PipelineRegistry* registry = nullptr;
  // Makes a device's backend from its config (the memory budget is applied afterwards by the
  // caller); empty: CUDA for a CUDA device, the simulated accelerator otherwise.
  std::function<absl::StatusOr<std::unique_ptr<DeviceBackend>>(const v1::DeviceConfig&)> make_backend;

  const PipelineRegistry& Registry() const {
    return registry != nullptr ? *registry : DefaultPipelineRegistry();
  }
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_RUNTIME_FACTORIES_H_
