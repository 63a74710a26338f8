#include "runtime/reply.h"

#include <algorithm>
#include <utility>

#include "google/protobuf/util/time_util.h"
#include "base/status_macros.h"

namespace stowage {

using google::protobuf::util::TimeUtil;

google::protobuf::Duration ToProto(absl::Duration d) {
  return TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(d));
}

absl::Duration FromProto(const google::protobuf::Duration& d) {
  return absl::Nanoseconds(TimeUtil::DurationToNanoseconds(d));
}

v1::GenerateResponse BuildReply(const Image& image, const GenerationParams& params, const ReplyFacts& facts,
                                const std::vector<RunContext::StageTime>& stages,
                                const std::vector<v1::DeviceUsage>& peers) {
  v1::GenerateResponse response;
  response.set_format(v1::IMAGE_FORMAT_PNG);
  response.set_width(image.width);
  response.set_height(image.height);
  response.set_seed(params.seed);
  response.set_pipeline(facts.pipeline);
  response.set_request_id(facts.request_id);
  v1::RequestStats* stats = response.mutable_stats();
  *stats->mutable_queue_wait() = ToProto(facts.queue_wait);
  *stats->mutable_run_time() = ToProto(facts.run_time);
  for (const RunContext::StageTime& stage : stages) {
    v1::StageTiming* timing = stats->add_stages();
    timing->set_stage(stage.stage);
    *timing->mutable_duration() = ToProto(stage.duration);
    timing->set_shared(stage.shared);
  }
  stats->set_peak_device_memory_bytes(std::max(facts.after.peak_allocated_bytes, facts.peak_floor_allocated));
  stats->set_peak_device_reserved_bytes(std::max(facts.after.peak_process_bytes(), facts.peak_floor_reserved));
  if (facts.peak_cpu_rss_bytes > 0) stats->set_peak_cpu_rss_bytes(facts.peak_cpu_rss_bytes);
  stats->set_host_to_device_bytes(facts.after.host_to_device_bytes - facts.before.host_to_device_bytes -
                                  facts.preempted_host_to_device_bytes);
  stats->set_device_to_host_bytes(facts.after.device_to_host_bytes - facts.before.device_to_host_bytes -
                                  facts.preempted_device_to_host_bytes);
  stats->set_allocator_retries(facts.after.allocator_retries - facts.before.allocator_retries -
                               facts.preempted_allocator_retries);
  stats->set_allocator_ooms(facts.after.allocator_ooms - facts.before.allocator_ooms - facts.preempted_allocator_ooms);
  if (facts.preemptions > 0) {
    *stats->mutable_preempted_time() = ToProto(facts.preempted_time);
    stats->set_preemptions(facts.preemptions);
  }
  stats->set_device(facts.device);
  stats->set_batch_size(facts.batch_size);
  *stats->mutable_batch_wait() = ToProto(facts.batch_wait);
  v1::DeviceUsage* home = stats->add_devices();
  home->set_device(facts.device);
  home->set_peak_device_memory_bytes(stats->peak_device_memory_bytes());
  home->set_peak_device_reserved_bytes(stats->peak_device_reserved_bytes());
  home->set_host_to_device_bytes(stats->host_to_device_bytes());
  home->set_device_to_host_bytes(stats->device_to_host_bytes());
  for (const v1::DeviceUsage& peer : peers) *stats->add_devices() = peer;
  return response;
}

absl::Status EncodeReplyImage(const Image& image, v1::ImageFormat format, v1::GenerateResponse& response) {
  const absl::Time encode_start = absl::Now();
  if (format == v1::IMAGE_FORMAT_RGB) {
    response.set_image(std::string(image.rgb.begin(), image.rgb.end()));
    response.set_format(v1::IMAGE_FORMAT_RGB);
  } else {
    ASSIGN_OR_RETURN(std::string png, EncodePng(image, /*fast=*/format == v1::IMAGE_FORMAT_PNG_FAST));
    response.set_image(std::move(png));
    response.set_format(format == v1::IMAGE_FORMAT_PNG_FAST ? v1::IMAGE_FORMAT_PNG_FAST : v1::IMAGE_FORMAT_PNG);
  }
  const absl::Duration encode = absl::Now() - encode_start;
  v1::RequestStats* stats = response.mutable_stats();
  v1::StageTiming* timing = stats->add_stages();
  timing->set_stage("encode_image");
  *timing->mutable_duration() = ToProto(encode);
  *stats->mutable_run_time() = ToProto(FromProto(stats->run_time()) + encode);
  return absl::OkStatus();
}

}  // namespace stowage
