// GenerationCore: the transport-free heart of the server. It owns the device (backend, placement,
// request queue) and the hosted pipelines, validates requests against a pipeline's limits, runs
// them on the device's worker, and measures their statistics. Knows protobuf messages, not gRPC.
//
// Thread-safety: Generate and ListPipelines may be called concurrently from any thread; runs are
// serialised by the device's worker.
#ifndef STOWAGE_SERVER_GENERATION_CORE_H_
#define STOWAGE_SERVER_GENERATION_CORE_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "models/pipeline.h"
#include "offload/device_backend.h"
#include "placement/placement_manager.h"
#include "server/device_worker.h"
#include "server/metrics.h"
#include "stowage/v1/config.pb.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// How a caller controls one request.
struct CallControl {
  // Non-OK (CANCELLED, DEADLINE_EXCEEDED) when the request must stop; checked before the run and
  // between denoising steps.
  std::function<absl::Status()> interrupt;
  // Optional; called on the device worker's thread for each progress event.
  std::function<void(const v1::Progress&)> on_progress;
};

class GenerationCore {
 public:
  // `config` must have been through FinalizeServerConfig. `metrics` may be null.
  static absl::StatusOr<std::unique_ptr<GenerationCore>> Create(const v1::ServerConfig& config,
                                                               ServerMetrics* metrics);
  ~GenerationCore();

  absl::StatusOr<v1::GenerateResponse> Generate(const v1::GenerateRequest& request,
                                                const CallControl& control);
  v1::ListPipelinesResponse ListPipelines();

  // The pipeline name for metric labels: the resolved name, or "unknown" (so client input never
  // becomes a label value).
  std::string PipelineLabel(const v1::GenerateRequest& request);

  DeviceBackend& backend() { return *backend_; }
  PlacementManager& placement() { return *placement_; }

  // Loads and serves a pipeline (validated like the config's). ALREADY_EXISTS for a taken name.
  absl::StatusOr<v1::Pipeline> LoadPipeline(const v1::PipelineConfig& config);
  // Stops serving `name`: new requests get NOT_FOUND; waits (until `interrupt` fails) for its
  // in-flight requests, then removes its components.
  absl::Status UnloadPipeline(const std::string& name, const std::function<absl::Status()>& interrupt);
  // Component names of every hosted pipeline (for validating workflow rules).
  std::vector<std::string> ComponentNames();

 private:
  struct Hosted {
    std::unique_ptr<Pipeline> pipeline;
    bool is_default = false;
  };
  GenerationCore() = default;
  absl::StatusOr<std::shared_ptr<Hosted>> Resolve(const std::string& name);
  absl::StatusOr<std::shared_ptr<Hosted>> Build(const v1::PipelineConfig& config);
  v1::Pipeline Describe(const Hosted& hosted) const;
  absl::StatusOr<GenerationParams> Validate(const v1::GenerateRequest& request,
                                            const Pipeline& pipeline) const;
  absl::StatusOr<v1::GenerateResponse> RunOnWorker(Hosted& hosted, const GenerationParams& params,
                                                   const v1::GenerateRequest& request,
                                                   const CallControl& control,
                                                   absl::Duration queue_wait);

  ServerMetrics* metrics_ = nullptr;
  std::unique_ptr<DeviceBackend> backend_;
  // Components loaded from model directories, shared between pipelines that name the same ones.
  ComponentCache component_cache_;
  absl::Mutex pipelines_mu_;
  // A request holds its pipeline's shared_ptr while it runs, so an unload can wait for it.
  std::vector<std::shared_ptr<Hosted>> pipelines_ ABSL_GUARDED_BY(pipelines_mu_);
  // After the pipelines: destroyed before them, since group offloading hooks their modules.
  std::unique_ptr<PlacementManager> placement_;
  // Declared last: destroyed first, so queued jobs finish while everything they use still exists.
  std::unique_ptr<DeviceWorker> worker_;
  int64_t request_counter_ = 0;  // Used on the worker thread only.
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_GENERATION_CORE_H_
