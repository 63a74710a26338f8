// What every front (gRPC, HTTP) records for one finished DeviceRuntime::Generate call, in one
// place so that both count requests the same way: stowage_requests_total{pipeline,code},
// stowage_request_duration_seconds, and for a successful call its per-request resources and the
// bytes it moved.
#ifndef STOWAGE_SERVER_GENERATION_METRICS_H_
#define STOWAGE_SERVER_GENERATION_METRICS_H_

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "runtime/device_set.h"
#include "runtime/metrics.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// `metrics` may be null (nothing is recorded). `response` is the call's result when it succeeded,
// else null. `start` is when the front received the request. The pipeline label comes from
// DeviceRuntime::PipelineLabel, so client input never becomes a label value.
void RecordGeneration(const DeviceSet& core, ServerMetrics* metrics, const v1::GenerateRequest& request,
                      const absl::Status& status, const v1::GenerateResponse* response, absl::Time start);

}  // namespace stowage

#endif  // STOWAGE_SERVER_GENERATION_METRICS_H_
