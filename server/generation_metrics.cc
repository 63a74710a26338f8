#include "server/generation_metrics.h"

#include <string>

#include "google/protobuf/util/time_util.h"

namespace stowage {

using google::protobuf::util::TimeUtil;

void RecordGeneration(const DeviceSet& core, ServerMetrics* metrics, const v1::GenerateRequest& request,
                      const absl::Status& status, const v1::GenerateResponse* response, absl::Time start) {
  if (metrics == nullptr) return;
  const std::string pipeline = core.PipelineLabel(request);
  metrics->RecordRequest(pipeline, status.code(), absl::Now() - start);
  absl::Duration queue_wait;
  if (response != nullptr) {
    queue_wait = absl::Nanoseconds(TimeUtil::DurationToNanoseconds(response->stats().queue_wait()));
  }
  metrics->RecordTenantRequest(core.TenantLabel(request), DeviceSet::PriorityLabel(request), status.code(),
                               response != nullptr ? &queue_wait : nullptr);
  if (response != nullptr) {
    const v1::RequestStats& stats = response->stats();
    metrics->RecordRequestResources(pipeline, stats.peak_device_memory_bytes(), stats.peak_device_reserved_bytes(),
                                    stats.peak_cpu_rss_bytes());
    metrics->RecordBytesMoved(stats.device(), stats.host_to_device_bytes(), stats.device_to_host_bytes());
  }
}

}  // namespace stowage
