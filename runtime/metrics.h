// ServerMetrics: every Prometheus metric of the server, declared once, recorded through small
// helpers. Names follow Prometheus conventions: prefix stowage_, base units, _total for counters.
//
// Thread-safety: all methods are thread-safe (prometheus-cpp metrics are).
#ifndef STOWAGE_RUNTIME_METRICS_H_
#define STOWAGE_RUNTIME_METRICS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "placement/placement_manager.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace stowage {

class ServerMetrics {
 public:
  ServerMetrics();

  std::shared_ptr<prometheus::Registry> registry() { return registry_; }

  // Every series of a device and of a pipeline, at 0, so that rates and alerts see them from the
  // start (not only after the first request): the device's bytes moved and queue depth; the
  // pipeline's requests by the status codes a request ends with (ok, invalid_argument,
  // resource_exhausted, unavailable, deadline_exceeded, cancelled, failed_precondition, internal),
  // its duration and peaks; the default tenant's requests at priority 0. Idempotent.
  void InitializeDevice(const std::string& device);
  void InitializePipeline(const std::string& pipeline);

  // One finished request (any outcome). Resource figures are recorded for successful requests.
  void RecordRequest(const std::string& pipeline, absl::StatusCode code, absl::Duration duration);
  // Peak device bytes as the allocator counts them (allocated) and as the GPU sees them (reserved
  // plus context), and peak CPU RSS.
  void RecordRequestResources(const std::string& pipeline, int64_t peak_device_bytes,
                              int64_t peak_device_reserved_bytes, int64_t peak_rss_bytes);
  // One stage of a successful request (RequestStats.stages: "tokenize", "encode_prompt", "denoise",
  // ...; the server's own names, a bounded set): the time the request spent in it (a batch's shared
  // stage is each member's).
  void RecordStage(const std::string& pipeline, const std::string& stage, absl::Duration duration);
  void RecordBytesMoved(const std::string& device, int64_t host_to_device, int64_t device_to_host);
  void SetQueueDepth(const std::string& device, int64_t depth);
  // Requests the device's worker is running now (a batch's members; 0 when idle).
  void SetRunning(const std::string& device, int64_t requests);
  // One request run between the denoising steps of another on `device` (scheduler.preemption).
  void RecordPreemption(const std::string& device);
  // The device's convolutions went on on a fresh thread after allocator out-of-memory errors (cuDNN
  // plans chosen short of memory left behind: runtime/thread_renewal.h, models/core/conv_lane.h).
  void RecordThreadRenewal(const std::string& device);
  // One batch run by a pipeline with batching on: how many requests it held (1 = alone) and how
  // long the server held it open waiting for more.
  void RecordBatch(const std::string& pipeline, int size, absl::Duration held_open);
  // One finished request by scheduling class: `tenant` is a bounded label (DeviceSet::TenantLabel),
  // `priority` 0..9; its queue wait when it ran (successful requests).
  void RecordTenantRequest(const std::string& tenant, int priority, absl::StatusCode code,
                           const absl::Duration* queue_wait);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Counter>& requests_;
  prometheus::Family<prometheus::Histogram>& duration_;
  prometheus::Family<prometheus::Histogram>& peak_device_;
  prometheus::Family<prometheus::Histogram>& peak_device_reserved_;
  prometheus::Family<prometheus::Histogram>& peak_rss_;
  prometheus::Family<prometheus::Histogram>& stage_;
  prometheus::Family<prometheus::Gauge>& queue_depth_;
  prometheus::Family<prometheus::Gauge>& running_;
  prometheus::Family<prometheus::Counter>& preemptions_;
  prometheus::Family<prometheus::Counter>& thread_renewals_;
  prometheus::Family<prometheus::Counter>& h2d_;
  prometheus::Family<prometheus::Counter>& d2h_;
  prometheus::Family<prometheus::Histogram>& batch_size_;
  prometheus::Family<prometheus::Histogram>& batch_delay_;
  prometheus::Family<prometheus::Counter>& tenant_requests_;
  prometheus::Family<prometheus::Histogram>& tenant_queue_wait_;
};

// A collectable that reads the process's resident memory at scrape time:
// stowage_process_resident_memory_bytes.
std::shared_ptr<prometheus::Collectable> MakeProcessMemoryCollectable();

// Where the scrape reads placement: the snapshot the device worker published last (never live
// engine state), and each hosted pipeline's lifecycle state ("loading", "ready", ...).
struct PipelineStateView {
  std::string pipeline;
  std::string state;
  std::string device;  // The device the replica is on (DeviceSet sets it).
};
// Every device's snapshot (one per device).
using PlacementSnapshotSource = std::function<std::vector<std::shared_ptr<const PlacementSnapshot>>()>;
using PipelineStateSource = std::function<std::vector<PipelineStateView>()>;

// A collectable that reads, at scrape time, per-component state and device bytes, onloads/offloads
// (count and bytes), evictions by strategy and cause, OOM recoveries, decision time, the
// footprint-over-group-offload warning, and stowage_pipeline_state. The sources must stay callable
// while the collectable is registered.
std::shared_ptr<prometheus::Collectable> MakePlacementCollectable(PlacementSnapshotSource placement,
                                                                  PipelineStateSource pipelines);

// Lower-case gRPC-style name of a status code ("ok", "invalid_argument", ...).
std::string StatusCodeLabel(absl::StatusCode code);

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_METRICS_H_
