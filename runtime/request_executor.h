// RequestExecutor: runs requests on one device's worker — one request, or a batch of one pipeline's
// requests. Drops the members whose pipeline or caller went while they waited, names them (their
// request_id or one it assigns), resets and reads the device's peaks and byte counters, holds the
// members' LoRA adapters on the device, runs the pipeline through a ComponentRunner whose
// components on peers run there (split layouts, peer eviction), and turns each member's image into
// its reply (runtime/reply.h). Also the warm-up generation a pipeline runs when it loads.
//
// Part of DeviceRuntime (which makes it, and which it reaches with the worker's scope: Placement,
// Backend, the hosted pipelines and adapters). Thread-safety: Run, WarmUp and KeepPeakFloor on the
// device's worker only (they take its WorkerScope or run inside its calls); running() from any thread.
#ifndef STOWAGE_RUNTIME_REQUEST_EXECUTOR_H_
#define STOWAGE_RUNTIME_REQUEST_EXECUTOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/core/image.h"
#include "models/pipelines/pipeline.h"
#include "offload/device_backend.h"
#include "runtime/device_worker.h"
#include "runtime/metrics.h"
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
  // Optional; receives the request's previews (GenerateRequest.partial_images of them, at
  // PreviewSteps) with their index, step and image, on the device worker's thread (keep it short).
  // Without it a request's partial_images are not made.
  std::function<void(int index, int step, const Image& image)> on_preview;
  // When the caller gives up (its gRPC deadline; infinite for none): the scheduler does not pause
  // the running request for another (preemption) when the expected pause would pass it.
  absl::Time deadline = absl::InfiniteFuture();
};

class DeviceRuntime;

class RequestExecutor {
 public:
  // One accepted request, from Generate to the worker and back.
  struct Request {
    std::shared_ptr<Pipeline> pipeline;
    GenerationParams params;
    const v1::GenerateRequest* request = nullptr;
    const CallControl* control = nullptr;
    absl::Duration queue_wait;
    absl::Duration batch_wait;
    // Set by Run: the response without its image, and the image, which the caller's own thread
    // encodes (so the worker goes on to the next request meanwhile).
    absl::StatusOr<v1::GenerateResponse> result = absl::InternalError("request did not run");
    Image image;
  };

  // `metrics` may be null.
  RequestExecutor(DeviceRuntime& device, ServerMetrics* metrics);

  // Runs `requests` (one pipeline's, BatchCompatible) as one batch, or one alone, and sets each
  // one's result. `batching`: the pipeline batches (its batches go to the batch metrics).
  void Run(WorkerScope& scope, const std::vector<Request*>& requests, bool batching);
  // One small generation so that the first request finds kernels loaded, library handles made and
  // components placed (PipelineConfig.warmup), then one step at several prompt lengths. Failures
  // are logged, not returned.
  void WarmUp(WorkerScope& scope, Pipeline& pipeline, const Interrupt& interrupt);
  // A peer's run on this device (DeviceRuntime::RunForPeer) resets the device's peaks to measure
  // itself: the request running here keeps the peak it had reached (`before`).
  void KeepPeakFloor(const DeviceMemoryStats& before);
  // Forgets what `pipeline`'s runs taught (the order it runs its components in): it is unloaded, or
  // its load failed. Worker only.
  void ForgetPipeline(const std::string& pipeline) { run_order_.erase(pipeline); }
  // Requests running now (a batch's members; 0 between runs).
  int running() const { return running_.load(std::memory_order_relaxed); }

 private:
  // Ends a context reserve set for a first run (warm-up, first request after a change): measures
  // the context again and warns, naming `what`, when it grew beyond `reserve`.
  void EndContextReserve(WorkerScope& scope, int64_t reserve, const std::string& what);

  DeviceRuntime& device_;
  ServerMetrics* const metrics_;
  // Worker only.
  int64_t request_counter_ = 0;
  int64_t peak_floor_allocated_ = 0;
  int64_t peak_floor_reserved_ = 0;
  int64_t peak_floor_rss_ = 0;  // A preempting run's RSS peak (it resets the process's).
  // A run's pauses for preempting requests (Run).
  struct Paused {
    absl::Duration time;
    int count = 0;
    int64_t host_to_device_bytes = 0;
    int64_t device_to_host_bytes = 0;
    int64_t allocator_retries = 0;
    int64_t allocator_ooms = 0;
  };
  // PlacementManager::run_changes() when a request or warm-up last ran.
  int64_t run_changes_seen_ = 0;
  // Per pipeline name: the order its last run first used its components in (indices into
  // Pipeline::components() of `pipeline`, the hosted object it was learned from), for the
  // cross-pipeline prefetch (PlacementManager::PrefetchPipeline).
  struct LearnedOrder {
    const Pipeline* pipeline = nullptr;
    std::vector<size_t> components;
  };
  std::map<std::string, LearnedOrder> run_order_;
  std::atomic<int> running_{0};
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_REQUEST_EXECUTOR_H_
