// Ordering requests on a device without sleeps: a long request holds the device (its first progress
// message says it runs there) while the requests under test queue behind it; the queue-depth gauge
// on the metrics page says when they all wait; finishing the long request lets them reach the worker
// together. Used by the batching and scheduling end-to-end tests.
#ifndef STOWAGE_TESTS_E2E_QUEUED_TOGETHER_H_
#define STOWAGE_TESTS_E2E_QUEUED_TOGETHER_H_

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "stowage/v1/generation.grpc.pb.h"
#include "tests/e2e/http_get.h"

namespace stowage {

// True once `depth` requests wait in `device`'s queue (stowage_queue_depth on the metrics page at
// `metrics_address`); false after 60 s.
inline bool WaitForQueueDepth(const std::string& metrics_address, const std::string& device, int depth) {
  const std::string line = absl::StrCat("stowage_queue_depth{device=\"", device, "\"} ", depth, "\n");
  for (const absl::Time give_up = absl::Now() + absl::Seconds(60); absl::Now() < give_up;) {
    if (HttpGet(metrics_address, "/metrics").find(line) != std::string::npos) return true;
    absl::SleepFor(absl::Milliseconds(2));  // Polls a condition; orders nothing.
  }
  return false;
}

// A long request of `pipeline` (128x128, 100 steps: a batch key of its own) streamed until Finish.
// `running()` is true once its first progress message arrived: it is on the device.
class LongRequest {
 public:
  LongRequest(v1::GenerationService::Stub& stub, const std::string& pipeline) {
    v1::GenerateRequest slow;
    slow.set_pipeline(pipeline);
    slow.set_prompt("a long request that holds the device");
    slow.set_width(128);
    slow.set_height(128);
    slow.set_num_inference_steps(100);
    slow.set_seed(99);
    context_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
    reader_ = stub.GenerateStream(&context_, slow);
    v1::GenerateStreamResponse message;
    running_ = reader_->Read(&message);
  }
  bool running() const { return running_; }
  // Reads the rest of the stream; true when the request succeeded.
  bool Finish() {
    v1::GenerateStreamResponse message;
    while (reader_->Read(&message)) {
      if (message.has_result()) result_ = message.result();
      if (message.has_progress()) stages_.push_back(message.progress().stage());
    }
    return reader_->Finish().ok();
  }
  // Its reply, once Finish returned true, and the stages of the progress events Finish read.
  const v1::GenerateResponse& result() const { return result_; }
  const std::vector<std::string>& stages() const { return stages_; }

 private:
  grpc::ClientContext context_;
  std::unique_ptr<grpc::ClientReader<v1::GenerateStreamResponse>> reader_;
  bool running_ = false;
  v1::GenerateResponse result_;
  std::vector<std::string> stages_;
};

}  // namespace stowage

#endif  // STOWAGE_TESTS_E2E_QUEUED_TOGETHER_H_
