// GenerationCore: the transport-free heart of the server for one device. It owns the device (its
// backend, its placement registry and the worker thread that alone changes them), the table of
// hosted pipelines and their lifecycles, validates requests against a pipeline's limits, runs them
// on the worker and measures their statistics. Knows protobuf messages, not gRPC.
//
// Ownership model (ARCHITECTURE.md, "Who may change device state"): the backend and the
// PlacementManager are touched only by the device's worker (server/device_worker.h). Requests are
// jobs on that worker; every change to device state — registering or removing a pipeline's
// components, group offload, strategies — is a task posted with ChangeDevice (or by
// LoadPipeline/UnloadPipeline), which runs between requests and which the caller waits for with
// its own deadline. Readers on other threads (admin views, the metrics scrape) use
// placement_snapshot(), published by the worker after every job and task.
//
// Thread-safety: every public method may be called from any thread except the worker's.
#ifndef STOWAGE_SERVER_GENERATION_CORE_H_
#define STOWAGE_SERVER_GENERATION_CORE_H_

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "models/component.h"
#include "models/pipeline.h"
#include "offload/device_backend.h"
#include "placement/placement_manager.h"
#include "server/device_worker.h"
#include "server/hosted_pipelines.h"
#include "server/metrics.h"
#include "stowage/v1/config.pb.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// Non-OK (CANCELLED, DEADLINE_EXCEEDED) once the caller has gone.
using Interrupt = std::function<absl::Status()>;

// How a caller controls one request.
struct CallControl {
  // Checked before the run and between denoising steps.
  Interrupt interrupt;
  // Optional; called for each progress event, one at a time: on the device worker's thread while
  // the request runs there, then on the calling thread for the final "encode_image" stage.
  std::function<void(const v1::Progress&)> on_progress;
};

class GenerationCore {
 public:
  // `config` must have been through FinalizeServerConfig. `metrics` may be null. Loads every
  // configured pipeline; any failure fails Create.
  static absl::StatusOr<std::unique_ptr<GenerationCore>> Create(const v1::ServerConfig& config,
                                                               ServerMetrics* metrics);
  ~GenerationCore();

  absl::StatusOr<v1::GenerateResponse> Generate(const v1::GenerateRequest& request,
                                                const CallControl& control);
  v1::ListPipelinesResponse ListPipelines() const;

  // The pipeline name for metric labels: a hosted pipeline's name, or "unknown" (so client input
  // never becomes a label value).
  std::string PipelineLabel(const v1::GenerateRequest& request) const;

  // Loads `config` (validated like the config file's) on this thread, then registers its
  // components on the worker. ALREADY_EXISTS for a name that is loading or loaded;
  // FAILED_PRECONDITION for one being unloaded. If `interrupt` fires before the worker took the
  // registration, nothing remains; a load that fails after it started leaves the name FAILED (with
  // the error) until it is loaded again or unloaded.
  absl::StatusOr<v1::Pipeline> LoadPipeline(const v1::PipelineConfig& config, const Interrupt& interrupt);
  // Stops accepting requests for `name`; requests already accepted run first, then the worker
  // removes its components. If `interrupt` fires before that, the pipeline is READY again.
  absl::Status UnloadPipeline(const std::string& name, const Interrupt& interrupt);

  // Sets a READY pipeline's dynamic batching (validated like the config's); requests submitted
  // afterwards batch under it. NOT_FOUND for a pipeline that is not READY.
  absl::StatusOr<v1::Pipeline> SetBatching(const std::string& pipeline, const v1::BatchingConfig& batching);

  // Runs `change` on the device's worker between requests and returns its status (exceptions
  // become INTERNAL). If `interrupt` fires before it started, it never runs.
  absl::Status ChangeDevice(const std::function<absl::Status(PlacementManager&)>& change,
                            const Interrupt& interrupt);

  // What the worker published after its last job or task.
  std::shared_ptr<const PlacementSnapshot> placement_snapshot() const;
  // The newest `limit` placement decisions (safe from any thread).
  std::vector<PlacementDecision> DecisionLog(size_t limit) const;
  // Each hosted pipeline's lifecycle state, for metrics.
  std::vector<PipelineStateView> PipelineStates() const;
  // True when `name` is hosted here and READY (for routing).
  bool IsReady(const std::string& name) const;
  // The default pipeline's name when it is READY, else "".
  std::string ReadyDefault() const;
  const std::string& device_name() const { return device_name_; }
  // Requests accepted by Generate and not yet returned (queued or running); for routing.
  int in_flight() const { return in_flight_.load(std::memory_order_relaxed); }

 private:
  // One accepted request, from Generate to the worker and back.
  struct PendingRequest {
    std::shared_ptr<Pipeline> pipeline;
    GenerationParams params;
    const v1::GenerateRequest* request = nullptr;
    const CallControl* control = nullptr;
    absl::Duration queue_wait;
    absl::Duration batch_wait;
    // Set by the worker: the response without its image, and the image, which the caller's own
    // thread encodes (so the worker goes on to the next request meanwhile).
    absl::StatusOr<v1::GenerateResponse> result = absl::InternalError("request did not run");
    Image image;
  };

  GenerationCore() = default;
  absl::StatusOr<std::unique_ptr<Pipeline>> Build(const v1::PipelineConfig& config);
  absl::StatusOr<v1::Pipeline> Load(const v1::PipelineConfig& config, bool make_default,
                                    const Interrupt& interrupt);
  v1::Pipeline Describe(const HostedPipelines::View& view) const;
  absl::StatusOr<GenerationParams> Validate(const v1::GenerateRequest& request,
                                            const Pipeline& pipeline) const;
  v1::BatchingConfig BatchingOf(const std::string& pipeline) const;
  // Worker only: one small generation so that the first request finds kernels loaded, library
  // handles made and components placed (PipelineConfig.warmup). Failures are logged, not returned.
  void WarmUp(Pipeline& pipeline, const Interrupt& interrupt);
  // Worker only. Runs requests for one pipeline as one batch (or one request alone) and sets each
  // one's result.
  // `batching`: the pipeline batches (its batches go to the batch metrics).
  void RunOnWorker(const std::vector<PendingRequest*>& requests, bool batching);
  void Publish();  // Worker only.

  ServerMetrics* metrics_ = nullptr;
  std::string device_name_;
  // Device state, worker only. The backend outlives everything that may hold device memory.
  std::unique_ptr<DeviceBackend> backend_;
  // Components loaded from model directories, shared between pipelines that name the same ones.
  ComponentCache component_cache_;
  HostedPipelines pipelines_;
  // Worker only. Declared after the pipelines: destroyed before them, since group offloading
  // hooks their modules.
  std::unique_ptr<PlacementManager> placement_;
  int64_t request_counter_ = 0;
  std::atomic<int> in_flight_{0};
  // Each READY pipeline's batching settings (absent: off).
  mutable absl::Mutex batching_mu_;
  std::map<std::string, v1::BatchingConfig> batching_ ABSL_GUARDED_BY(batching_mu_);
  mutable absl::Mutex snapshot_mu_;
  std::shared_ptr<const PlacementSnapshot> snapshot_ ABSL_GUARDED_BY(snapshot_mu_);
  // Declared last: destroyed first, so queued work finishes while everything it uses exists.
  std::unique_ptr<DeviceWorker> worker_;
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_GENERATION_CORE_H_
