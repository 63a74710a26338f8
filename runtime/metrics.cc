#include "runtime/metrics.h"

#include <dlfcn.h>
#include <pthread.h>

#include <cctype>
#include <cstddef>
#include <vector>

#include "prometheus/client_metric.h"
#include "prometheus/metric_family.h"
#include "placement/placement_manager.h"
#include "base/process_memory.h"

namespace stowage {
namespace {

prometheus::Histogram::BucketBoundaries ExponentialBuckets(double start, double factor, int count) {
  prometheus::Histogram::BucketBoundaries bounds;
  double value = start;
  for (int i = 0; i < count; ++i, value *= factor) bounds.push_back(value);
  return bounds;
}

// 1 MiB .. 256 GiB in powers of two.
const prometheus::Histogram::BucketBoundaries& ByteBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries(
      ExponentialBuckets(1024.0 * 1024.0, 2.0, 19));
  return *buckets;
}

// 10 ms .. ~328 s in powers of two.
const prometheus::Histogram::BucketBoundaries& SecondBuckets() {
  static const auto* buckets =
      new prometheus::Histogram::BucketBoundaries(ExponentialBuckets(0.01, 2.0, 16));
  return *buckets;
}

// From a millisecond (tokenizing a prompt) to ~131 s (a long streamed denoise) in powers of two.
const prometheus::Histogram::BucketBoundaries& StageBuckets() {
  static const auto* buckets = new prometheus::Histogram::BucketBoundaries(ExponentialBuckets(0.001, 2.0, 18));
  return *buckets;
}

class ProcessMemoryCollectable : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override {
    prometheus::MetricFamily family;
    family.name = "stowage_process_resident_memory_bytes";
    family.help = "Resident set size of the server process (VmRSS), read at scrape time.";
    family.type = prometheus::MetricType::Gauge;
    absl::StatusOr<ProcessMemory> memory = ReadProcessMemory();
    if (memory.ok()) {
      prometheus::ClientMetric metric;
      metric.gauge.value = static_cast<double>(memory->rss_bytes);
      family.metric.push_back(metric);
    }
    return {family};
  }
};

prometheus::MetricFamily Family(const std::string& name, const std::string& help,
                                prometheus::MetricType type) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  return family;
}

void Add(prometheus::MetricFamily& family, double value,
         std::vector<std::pair<std::string, std::string>> labels = {}) {
  prometheus::ClientMetric metric;
  for (auto& [k, v] : labels) metric.label.push_back({k, v});
  if (family.type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
}

class PlacementCollectable : public prometheus::Collectable {
 public:
  PlacementCollectable(PlacementSnapshotSource placement, PipelineStateSource pipelines)
      : placement_(std::move(placement)), pipelines_(std::move(pipelines)) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    using prometheus::MetricType;
    auto pipeline_state = Family("stowage_pipeline_state",
                                 "1 for the lifecycle state each hosted pipeline is in, per device it is on.",
                                 MetricType::Gauge);
    for (const PipelineStateView& p : pipelines_()) {
      Add(pipeline_state, 1, {{"pipeline", p.pipeline}, {"state", p.state}, {"device", p.device}});
    }
    auto state = Family("stowage_component_state", "1 for the state each component is in.", MetricType::Gauge);
    auto device = Family("stowage_component_device_bytes",
                         "Device bytes a component holds (weights if resident, working set if group-offloaded).",
                         MetricType::Gauge);
    auto weights = Family("stowage_component_weight_bytes", "Bytes of a component's weights.", MetricType::Gauge);
    auto device_memory = Family("stowage_device_memory_bytes",
                                "Device memory by kind: allocated, reserved (allocator segments), context "
                                "(outside the allocator), budget (0 = none).",
                                MetricType::Gauge);
    auto lifecycle = Family("stowage_component_lifecycle", "1 for the lifecycle state each component is in.",
                            MetricType::Gauge);
    // Group offloading, per group-offloaded component: its device and host bytes by kind, and the
    // engine's counters since the component's group offloading was applied (a disable and enable
    // starts them again at 0, which Prometheus reads as a counter reset).
    auto go_bytes = Family("stowage_group_offload_bytes",
                           "Bytes of a group-offloaded component by kind: working_set (device: slots + "
                           "always_on + resident + scratch), slots, always_on, resident, scratch, streamed "
                           "(copied every forward), per_forward (host-to-device bytes of one forward), "
                           "pinned_host, cache (streamed groups kept on the device by the spare-room cache, "
                           "device.streamed_group_cache).",
                           MetricType::Gauge);
    auto go_forwards = Family("stowage_group_offload_forwards_total",
                              "Forwards of a group-offloaded component.", MetricType::Counter);
    auto go_onloads = Family("stowage_group_offload_onloads_total",
                             "Groups reached by a forward, by how their weights got onto the device: ready "
                             "(prefetched into the slot ring, or still there from the last run), sync (copied "
                             "while the forward waited) or cached (kept by the spare-room cache: no copy).",
                             MetricType::Counter);
    auto go_releases = Family("stowage_group_offload_slot_releases_total",
                              "Times an idle group-offloaded component gave its slot ring back to the device.",
                              MetricType::Counter);
    auto onloads = Family("stowage_placement_onloads_total", "Whole-component onloads.", MetricType::Counter);
    auto onload_bytes = Family("stowage_placement_onload_bytes_total", "Bytes of whole-component onloads.",
                               MetricType::Counter);
    auto offloads = Family("stowage_placement_offloads_total", "Whole-component offloads.", MetricType::Counter);
    auto offload_bytes = Family("stowage_placement_offload_bytes_total",
                                "Device bytes freed by whole-component offloads.", MetricType::Counter);
    auto evictions = Family("stowage_placement_evictions_total", "Evictions by strategy and cause.",
                            MetricType::Counter);
    auto oom = Family("stowage_placement_oom_recoveries_total",
                      "Device out-of-memory errors recovered by eviction or group offloading.",
                      MetricType::Counter);
    auto pipeline_prefetches = Family(
        "stowage_placement_pipeline_prefetches_total",
        "Cross-pipeline prefetches (device.prefetch_next_pipeline): components whose copies started while "
        "another pipeline's request ran (outcome started), then ran before being moved (used) or were moved "
        "off or unloaded first (unused).",
        MetricType::Counter);
    auto pipeline_prefetch_bytes = Family("stowage_placement_pipeline_prefetch_bytes_total",
                                          "Bytes of cross-pipeline prefetches, by outcome (started, used).",
                                          MetricType::Counter);
    auto decision_seconds = Family("stowage_placement_decision_seconds_total",
                                   "Time spent deciding placements (strategy calls).", MetricType::Counter);
    auto decisions = Family("stowage_placement_decisions_total", "Strategy calls.", MetricType::Counter);
    auto allocator = Family("stowage_device_allocator_shortfalls_total",
                            "Times the device's allocator ran short of room under its cap, by kind: retry (an "
                            "allocation that succeeded only after it gave back its cached blocks; on CUDA with a "
                            "device synchronisation) and oom (an out-of-memory error, recovered from or not).",
                            MetricType::Counter);
    auto warning = Family("stowage_placement_group_offload_warning",
                          "1 while a footprint strategy manages group-offloaded components.",
                          MetricType::Gauge);
    // One set of samples per device, each labelled with it (a component id names a replica only
    // together with its device).
    for (const std::shared_ptr<const PlacementSnapshot>& snapshot : placement_()) {
      const std::string& d = snapshot->device;
      for (const auto& [kind, bytes] : std::vector<std::pair<std::string, int64_t>>{
               {"allocated", snapshot->memory.allocated_bytes},
               {"reserved", snapshot->memory.reserved_bytes},
               {"context", snapshot->memory.context_bytes},
               {"budget", snapshot->memory.budget_bytes}}) {
        Add(device_memory, static_cast<double>(bytes), {{"device", d}, {"kind", kind}});
      }
      Add(allocator, static_cast<double>(snapshot->memory.allocator_retries), {{"device", d}, {"kind", "retry"}});
      Add(allocator, static_cast<double>(snapshot->memory.allocator_ooms), {{"device", d}, {"kind", "oom"}});
      for (const ComponentView& v : snapshot->components) {
        Add(state, 1, {{"component", v.id}, {"state", ComponentStateName(v.state)}, {"device", d}});
        Add(lifecycle, 1, {{"component", v.id}, {"lifecycle", ComponentLifecycleName(v.lifecycle)}, {"device", d}});
        Add(device, static_cast<double>(v.device_bytes), {{"component", v.id}, {"device", d}});
        Add(weights, static_cast<double>(v.weight_bytes), {{"component", v.id}, {"device", d}});
        if (!v.group_offload.has_value()) continue;
        const GroupOffloadStats& g = *v.group_offload;
        for (const auto& [kind, bytes] : std::vector<std::pair<std::string, int64_t>>{
                 {"working_set", g.working_set_bytes},
                 {"slots", g.slots * g.slot_bytes},
                 {"always_on", g.always_on_bytes},
                 {"resident", g.resident_bytes},
                 {"scratch", g.scratch_bytes},
                 {"streamed", g.streamed_bytes},
                 {"per_forward", g.bytes_per_forward},
                 {"pinned_host", g.pinned_host_bytes},
                 {"cache", g.cache_bytes}}) {
          Add(go_bytes, static_cast<double>(bytes), {{"component", v.id}, {"kind", kind}, {"device", d}});
        }
        Add(go_forwards, static_cast<double>(g.forwards), {{"component", v.id}, {"device", d}});
        Add(go_onloads, static_cast<double>(g.onloads - g.sync_onloads - g.cache_hits),
            {{"component", v.id}, {"how", "ready"}, {"device", d}});
        Add(go_onloads, static_cast<double>(g.cache_hits), {{"component", v.id}, {"how", "cached"}, {"device", d}});
        Add(go_onloads, static_cast<double>(g.sync_onloads), {{"component", v.id}, {"how", "sync"}, {"device", d}});
        Add(go_releases, static_cast<double>(g.slot_releases), {{"component", v.id}, {"device", d}});
      }
      const PlacementCounters& c = snapshot->counters;
      Add(onloads, static_cast<double>(c.onloads), {{"device", d}});
      Add(onload_bytes, static_cast<double>(c.onload_bytes), {{"device", d}});
      Add(offloads, static_cast<double>(c.offloads), {{"device", d}});
      Add(offload_bytes, static_cast<double>(c.offload_bytes), {{"device", d}});
      for (const auto& [key, n] : c.evictions) {
        Add(evictions, static_cast<double>(n), {{"strategy", key.first}, {"cause", key.second}, {"device", d}});
      }
      Add(oom, static_cast<double>(c.oom_recoveries), {{"device", d}});
      Add(pipeline_prefetches, static_cast<double>(c.pipeline_prefetches), {{"device", d}, {"outcome", "started"}});
      Add(pipeline_prefetches, static_cast<double>(c.pipeline_prefetches_used), {{"device", d}, {"outcome", "used"}});
      Add(pipeline_prefetches, static_cast<double>(c.pipeline_prefetches_unused), {{"device", d}, {"outcome", "unused"}});
      Add(pipeline_prefetch_bytes, static_cast<double>(c.pipeline_prefetch_bytes), {{"device", d}, {"outcome", "started"}});
      Add(pipeline_prefetch_bytes, static_cast<double>(c.pipeline_prefetch_used_bytes), {{"device", d}, {"outcome", "used"}});
      Add(decision_seconds, c.decision_seconds, {{"device", d}});
      Add(decisions, static_cast<double>(c.decisions), {{"device", d}});
      Add(warning, snapshot->warnings.empty() ? 0 : 1, {{"device", d}});
    }
    return {pipeline_state, device_memory, allocator, state, lifecycle, device, weights, onloads, onload_bytes, offloads, offload_bytes, evictions, oom,
            pipeline_prefetches, pipeline_prefetch_bytes, decision_seconds, decisions, warning, go_bytes, go_forwards, go_onloads, go_releases};
  }

 private:
  PlacementSnapshotSource placement_;
  PipelineStateSource pipelines_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> MakePlacementCollectable(PlacementSnapshotSource placement,
                                                                  PipelineStateSource pipelines) {
  return std::make_shared<PlacementCollectable>(std::move(placement), std::move(pipelines));
}

std::string StatusCodeLabel(absl::StatusCode code) {
  std::string name = absl::StatusCodeToString(code);
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name;
}

ServerMetrics::ServerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      requests_(prometheus::BuildCounter()
                    .Name("stowage_requests_total")
                    .Help("Generation requests finished, by pipeline and status code.")
                    .Register(*registry_)),
      duration_(prometheus::BuildHistogram()
                    .Name("stowage_request_duration_seconds")
                    .Help("Wall-clock time of generation requests, queue wait included.")
                    .Register(*registry_)),
      peak_device_(prometheus::BuildHistogram()
                       .Name("stowage_request_peak_device_memory_bytes")
                       .Help("Peak device memory allocated while a request ran.")
                       .Register(*registry_)),
      peak_device_reserved_(prometheus::BuildHistogram()
                                .Name("stowage_request_peak_device_reserved_bytes")
                                .Help("Peak device memory the process held while a request ran, as the GPU "
                                      "sees it: the allocator's reserved bytes plus the CUDA context.")
                                .Register(*registry_)),
      peak_rss_(prometheus::BuildHistogram()
                    .Name("stowage_request_peak_cpu_rss_bytes")
                    .Help("Peak resident set size of the server while a request ran.")
                    .Register(*registry_)),
      stage_(prometheus::BuildHistogram()
                 .Name("stowage_request_stage_seconds")
                 .Help("Time successful generation requests spent in each stage (tokenize, encode_prompt, "
                       "encode_input, denoise, decode, encode_image; a batch's shared stage is each member's).")
                 .Register(*registry_)),
      queue_depth_(prometheus::BuildGauge()
                       .Name("stowage_queue_depth")
                       .Help("Requests waiting in a device's queue (the running one excluded).")
                       .Register(*registry_)),
      running_(prometheus::BuildGauge()
                   .Name("stowage_requests_running")
                   .Help("Requests a device's worker is running now (the members of a batch; 0 when idle).")
                   .Register(*registry_)),
      preemptions_(prometheus::BuildCounter()
                       .Name("stowage_preemptions_total")
                       .Help("Preemptions on a device: a request (or a batch) run between the denoising steps "
                             "of another (scheduler.preemption).")
                       .Register(*registry_)),
      thread_renewals_(prometheus::BuildCounter()
                           .Name("stowage_device_thread_renewals_total")
                           .Help("Times a device's convolutions went on on a fresh thread after allocator "
                                 "out-of-memory errors, once the room was back (LibTorch keeps a cuDNN convolution "
                                 "plan chosen short of memory on its thread).")
                           .Register(*registry_)),
      h2d_(prometheus::BuildCounter()
               .Name("stowage_host_to_device_bytes_total")
               .Help("Bytes copied host to device by requests.")
               .Register(*registry_)),
      d2h_(prometheus::BuildCounter()
               .Name("stowage_device_to_host_bytes_total")
               .Help("Bytes copied device to host by requests.")
               .Register(*registry_)),
      batch_size_(prometheus::BuildHistogram()
                      .Name("stowage_batch_size")
                      .Help("Requests per batch run by pipelines with dynamic batching on (1 = alone).")
                      .Register(*registry_)),
      batch_delay_(prometheus::BuildHistogram()
                       .Name("stowage_batch_queue_delay_seconds")
                       .Help("How long a batch was held open waiting for more requests "
                             "(bounded by batching.max_queue_delay_ms).")
                       .Register(*registry_)),
      tenant_requests_(prometheus::BuildCounter()
                           .Name("stowage_tenant_requests_total")
                           .Help("Generation requests finished, by tenant (those listed in "
                                 "scheduler.tenant_weights; \"default\", \"other\"), priority and status code.")
                           .Register(*registry_)),
      tenant_queue_wait_(prometheus::BuildHistogram()
                             .Name("stowage_tenant_queue_wait_seconds")
                             .Help("Time successful requests waited in a device queue, by tenant and priority.")
                             .Register(*registry_)) {}

void ServerMetrics::RecordTenantRequest(const std::string& tenant, int priority, absl::StatusCode code,
                                        const absl::Duration* queue_wait) {
  const std::string level = std::to_string(priority);
  tenant_requests_.Add({{"tenant", tenant}, {"priority", level}, {"code", StatusCodeLabel(code)}}).Increment();
  if (queue_wait != nullptr) {
    tenant_queue_wait_.Add({{"tenant", tenant}, {"priority", level}}, SecondBuckets())
        .Observe(absl::ToDoubleSeconds(*queue_wait));
  }
}

void ServerMetrics::RecordRequest(const std::string& pipeline, absl::StatusCode code,
                                  absl::Duration duration) {
  requests_.Add({{"pipeline", pipeline}, {"code", StatusCodeLabel(code)}}).Increment();
  duration_.Add({{"pipeline", pipeline}}, SecondBuckets()).Observe(absl::ToDoubleSeconds(duration));
}

void ServerMetrics::RecordRequestResources(const std::string& pipeline, int64_t peak_device_bytes,
                                           int64_t peak_device_reserved_bytes, int64_t peak_rss_bytes) {
  peak_device_.Add({{"pipeline", pipeline}}, ByteBuckets()).Observe(static_cast<double>(peak_device_bytes));
  peak_device_reserved_.Add({{"pipeline", pipeline}}, ByteBuckets())
      .Observe(static_cast<double>(peak_device_reserved_bytes));
  peak_rss_.Add({{"pipeline", pipeline}}, ByteBuckets()).Observe(static_cast<double>(peak_rss_bytes));
}

void ServerMetrics::RecordStage(const std::string& pipeline, const std::string& stage, absl::Duration duration) {
  stage_.Add({{"pipeline", pipeline}, {"stage", stage}}, StageBuckets()).Observe(absl::ToDoubleSeconds(duration));
}

void ServerMetrics::RecordBytesMoved(const std::string& device, int64_t host_to_device,
                                     int64_t device_to_host) {
  h2d_.Add({{"device", device}}).Increment(static_cast<double>(host_to_device));
  d2h_.Add({{"device", device}}).Increment(static_cast<double>(device_to_host));
}

void ServerMetrics::RecordBatch(const std::string& pipeline, int size, absl::Duration held_open) {
  static const auto* sizes = new prometheus::Histogram::BucketBoundaries{1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64};
  static const auto* delays = new prometheus::Histogram::BucketBoundaries(ExponentialBuckets(0.0005, 2.0, 18));
  batch_size_.Add({{"pipeline", pipeline}}, *sizes).Observe(static_cast<double>(size));
  batch_delay_.Add({{"pipeline", pipeline}}, *delays).Observe(absl::ToDoubleSeconds(held_open));
}

void ServerMetrics::InitializeDevice(const std::string& device) {
  h2d_.Add({{"device", device}});
  d2h_.Add({{"device", device}});
  queue_depth_.Add({{"device", device}});
  running_.Add({{"device", device}});
  preemptions_.Add({{"device", device}});
  thread_renewals_.Add({{"device", device}});
}

void ServerMetrics::InitializePipeline(const std::string& pipeline) {
  for (absl::StatusCode code :
       {absl::StatusCode::kOk, absl::StatusCode::kInvalidArgument, absl::StatusCode::kResourceExhausted,
        absl::StatusCode::kUnavailable, absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kCancelled,
        absl::StatusCode::kFailedPrecondition, absl::StatusCode::kInternal}) {
    requests_.Add({{"pipeline", pipeline}, {"code", StatusCodeLabel(code)}});
  }
  duration_.Add({{"pipeline", pipeline}}, SecondBuckets());
  peak_device_.Add({{"pipeline", pipeline}}, ByteBuckets());
  peak_device_reserved_.Add({{"pipeline", pipeline}}, ByteBuckets());
  peak_rss_.Add({{"pipeline", pipeline}}, ByteBuckets());
  tenant_requests_.Add({{"tenant", "default"}, {"priority", "0"}, {"code", StatusCodeLabel(absl::StatusCode::kOk)}});
}

void ServerMetrics::SetQueueDepth(const std::string& device, int64_t depth) {
  queue_depth_.Add({{"device", device}}).Set(static_cast<double>(depth));
}

void ServerMetrics::RecordPreemption(const std::string& device) {
  preemptions_.Add({{"device", device}}).Increment();
}

void ServerMetrics::RecordThreadRenewal(const std::string& device) {
  thread_renewals_.Add({{"device", device}}).Increment();
}

void ServerMetrics::SetRunning(const std::string& device, int64_t requests) {
  running_.Add({{"device", device}}).Set(static_cast<double>(requests));
}

std::shared_ptr<prometheus::Collectable> MakeProcessMemoryCollectable() {
  return std::make_shared<ProcessMemoryCollectable>();
}

}  // namespace stowage

// Minimum thread stack size for threads whose creator asks for a tiny one.
//
// Debian's civetweb (the HTTP server inside prometheus-cpp's Exposer) creates its threads with a
// fixed 100 KiB stack. glibc carves a thread's static TLS out of its stack, and a process that
// links the CUDA LibTorch has more static TLS than that, so civetweb's threads fail to start and
// the exporter reports "null context when constructing CivetServer" (seen on the H200 host with
// torch 2.11+cu130; see deploy/gpu_host/README.md). Defining pthread_attr_setstacksize in this library (linked by the
// server binary and its tests) interposes the C library's (executable symbols come first in the dynamic linker's
// lookup): requests below kMinimumStackBytes are raised to it; larger ones are untouched.
namespace {
constexpr size_t kMinimumStackBytes = size_t{8} << 20;
using SetStackSize = int (*)(pthread_attr_t*, size_t);
}  // namespace

extern "C" int pthread_attr_setstacksize(pthread_attr_t* attr, size_t size) {
  static const SetStackSize real =
      reinterpret_cast<SetStackSize>(dlsym(RTLD_NEXT, "pthread_attr_setstacksize"));
  return real(attr, size < kMinimumStackBytes ? kMinimumStackBytes : size);
}
