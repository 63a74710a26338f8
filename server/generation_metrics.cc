#include "server/generation_metrics.h"

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/log.h"
#include "google/protobuf/util/time_util.h"

namespace stowage {

using google::protobuf::util::TimeUtil;

namespace {

absl::Duration ToDuration(const google::protobuf::Duration& d) { return absl::Nanoseconds(TimeUtil::DurationToNanoseconds(d)); }
double Seconds(const google::protobuf::Duration& d) { return absl::ToDoubleSeconds(ToDuration(d)); }

// One line per request: what ran, for whom, how long it waited and ran, what it held, its outcome.
void LogRequest(const DeviceSet& core, const v1::GenerateRequest& request, const absl::Status& status,
                const v1::GenerateResponse* response, absl::Time start) {
  std::string line = absl::StrCat(
      "request id=", LogValue(response != nullptr ? response->request_id() : request.request_id(), 64),
      " pipeline=", LogValue(core.PipelineLabel(request)), " tenant=", LogValue(core.TenantLabel(request)),
      " priority=", DeviceSet::PriorityLabel(request), " status=", absl::StatusCodeToString(status.code()),
      " seconds=", absl::StrFormat("%.3f", absl::ToDoubleSeconds(absl::Now() - start)));
  if (response != nullptr) {
    const v1::RequestStats& stats = response->stats();
    absl::StrAppend(&line, " device=", LogValue(stats.device()), " size=", response->width(), "x", response->height(),
                    " steps=", request.num_inference_steps() > 0 ? absl::StrCat(request.num_inference_steps()) : "default", " seed=", response->seed(),
                    absl::StrFormat(" queue_wait_s=%.3f run_s=%.3f", Seconds(stats.queue_wait()), Seconds(stats.run_time())),
                    " peak_device_bytes=", stats.peak_device_memory_bytes(),
                    " peak_device_reserved_bytes=", stats.peak_device_reserved_bytes(),
                    " peak_cpu_rss_bytes=", stats.peak_cpu_rss_bytes(), " h2d_bytes=", stats.host_to_device_bytes(),
                    " batch_size=", std::max(1, stats.batch_size()), " allocator_retries=", stats.allocator_retries(),
                    " allocator_ooms=", stats.allocator_ooms());
    // Each stage's time (a batch's shared stages are the batch's): where a slower run spent it.
    std::string stages;
    for (const v1::StageTiming& stage : stats.stages()) {
      absl::StrAppend(&stages, stages.empty() ? "" : ",", LogValue(stage.stage(), 32), ":",
                      absl::StrFormat("%.3f", Seconds(stage.duration())));
    }
    absl::StrAppend(&line, " stages=", stages.empty() ? "none" : stages);
    LogInfo(line);
  } else {
    absl::StrAppend(&line, " error=", LogValue(status.message(), 200));
    LogWarning(line);
  }
}

}  // namespace

void RecordGeneration(const DeviceSet& core, ServerMetrics* metrics, const v1::GenerateRequest& request,
                      const absl::Status& status, const v1::GenerateResponse* response, absl::Time start) {
  LogRequest(core, request, status, response, start);
  if (metrics == nullptr) return;
  const std::string pipeline = core.PipelineLabel(request);
  metrics->RecordRequest(pipeline, status.code(), absl::Now() - start);
  absl::Duration queue_wait;
  if (response != nullptr) {
    queue_wait = ToDuration(response->stats().queue_wait());
  }
  metrics->RecordTenantRequest(core.TenantLabel(request), DeviceSet::PriorityLabel(request), status.code(),
                               response != nullptr ? &queue_wait : nullptr);
  if (response != nullptr) {
    const v1::RequestStats& stats = response->stats();
    metrics->RecordRequestResources(pipeline, stats.peak_device_memory_bytes(), stats.peak_device_reserved_bytes(),
                                    stats.peak_cpu_rss_bytes());
    metrics->RecordBytesMoved(stats.device(), stats.host_to_device_bytes(), stats.device_to_host_bytes());
    for (const v1::StageTiming& stage : stats.stages()) {
      metrics->RecordStage(pipeline, stage.stage(), ToDuration(stage.duration()));
    }
  }
}

}  // namespace stowage
