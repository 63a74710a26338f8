// A request's reply: the GenerateResponse a finished run becomes (its image's size and seed, and
// the statistics every reply carries — stage times, queue and batch waits, peak device memory and
// CPU RSS, bytes moved, the devices it used) and its image encoded in the format asked for.
// Transport-free and device-free: the device's worker measures, these functions only assemble.
#ifndef STOWAGE_RUNTIME_REPLY_H_
#define STOWAGE_RUNTIME_REPLY_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "google/protobuf/duration.pb.h"
#include "models/core/image.h"
#include "models/pipelines/pipeline.h"
#include "offload/device_backend.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

google::protobuf::Duration ToProto(absl::Duration d);
absl::Duration FromProto(const google::protobuf::Duration& d);

// What the worker measured around one run (of one request or a batch: the batch's figures).
struct ReplyFacts {
  std::string pipeline;
  std::string request_id;
  std::string device;
  int batch_size = 1;
  absl::Duration queue_wait;
  absl::Duration batch_wait;
  absl::Duration run_time;
  // The device's memory before and after the run; its peaks are the run's (reset at its start).
  DeviceMemoryStats before;
  DeviceMemoryStats after;
  // Peaks a remote call reset during the run (they count too).
  int64_t peak_floor_allocated = 0;
  int64_t peak_floor_reserved = 0;
  int64_t peak_cpu_rss_bytes = 0;  // 0: unknown (not reported).
  // Preemption between steps: how long the run was paused for other requests, how often, and the
  // bytes those moved (left out of the run's).
  absl::Duration preempted_time;
  int preemptions = 0;
  int64_t preempted_host_to_device_bytes = 0;
  int64_t preempted_device_to_host_bytes = 0;
  int64_t preempted_allocator_retries = 0;
  int64_t preempted_allocator_ooms = 0;
};

// The reply of a run that made `image` (format and image bytes set later by EncodeReplyImage):
// stats with each stage of `stages`, the peaks (the larger of after's and the floors), host↔device
// bytes and the allocator's retries and out-of-memory errors (after − before, less a preemption's),
// this device's usage first, then each peer's (`peers`).
v1::GenerateResponse BuildReply(const Image& image, const GenerationParams& params, const ReplyFacts& facts,
                                const std::vector<RunContext::StageTime>& stages,
                                const std::vector<v1::DeviceUsage>& peers);

// Puts `image` into `response` as `format` asks (IMAGE_FORMAT_UNSPECIFIED: PNG; PNG_FAST:
// uncompressed PNG; RGB: raw rows), adds an "encode_image" stage and its time to the run time.
absl::Status EncodeReplyImage(const Image& image, v1::ImageFormat format, v1::GenerateResponse& response);

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_REPLY_H_
