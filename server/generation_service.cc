#include "server/generation_service.h"

#include <chrono>
#include <deque>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/core/image.h"
#include "server/generation_metrics.h"

namespace stowage {
namespace {

CallControl ControlFor(grpc::ServerContext* context) {
  CallControl control;
  // gRPC's "no deadline" is the clock's far end: beyond a year counts as none.
  const std::chrono::system_clock::time_point deadline = context->deadline();
  if (deadline < std::chrono::system_clock::now() + std::chrono::hours(24 * 365)) {
    control.deadline = absl::FromChrono(deadline);
  }
  control.interrupt = [context]() -> absl::Status {
    if (context->deadline() < std::chrono::system_clock::now()) {
      return absl::DeadlineExceededError("deadline exceeded; the request was stopped");
    }
    if (context->IsCancelled()) return absl::CancelledError("cancelled by the client");
    return absl::OkStatus();
  };
  return control;
}

}  // namespace

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

void GenerationServiceImpl::Record(const v1::GenerateRequest& request, const absl::Status& status,
                                   const v1::GenerateResponse* response, absl::Time start) {
  RecordGeneration(*core_, metrics_, request, status, response, start);
}

grpc::Status GenerationServiceImpl::Generate(grpc::ServerContext* context,
                                             const v1::GenerateRequest* request,
                                             v1::GenerateResponse* response) {
  const absl::Time start = absl::Now();
  if (request->partial_images() != 0) {
    const absl::Status refused = absl::InvalidArgumentError(
        "partial_images: previews are sent by GenerateStream; Generate returns the image only");
    Record(*request, refused, nullptr, start);
    return ToGrpcStatus(refused);
  }
  absl::StatusOr<v1::GenerateResponse> result = core_->Generate(*request, ControlFor(context));
  if (result.ok()) *response = *std::move(result);
  Record(*request, result.status(), result.ok() ? response : nullptr, start);
  return ToGrpcStatus(result.status());
}

grpc::Status GenerationServiceImpl::GenerateStream(
    grpc::ServerContext* context, const v1::GenerateRequest* request,
    grpc::ServerWriter<v1::GenerateStreamResponse>* writer) {
  const absl::Time start = absl::Now();
  // Progress is produced on the device worker and written here, on the handler's thread: the
  // worker never blocks on a slow client, and only this thread touches the writer.
  struct Shared {
    absl::Mutex mu;
    std::deque<v1::GenerateStreamResponse> pending ABSL_GUARDED_BY(mu);
    bool finished ABSL_GUARDED_BY(mu) = false;
    absl::StatusOr<v1::GenerateResponse> result ABSL_GUARDED_BY(mu) = absl::InternalError("not run");
    // Await evaluates the condition with the lock held.
    static bool Ready(Shared* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
      return self->finished || !self->pending.empty();
    }
  };
  Shared shared;

  CallControl control = ControlFor(context);
  control.on_progress = [&shared](const v1::Progress& progress) {
    v1::GenerateStreamResponse message;
    *message.mutable_progress() = progress;
    absl::MutexLock lock(&shared.mu);
    shared.pending.push_back(std::move(message));
  };
  // Previews are encoded on the worker (at most 3 per request); the handler's thread writes them.
  control.on_preview = [&shared](int index, int step, const Image& image) {
    absl::StatusOr<std::string> png = EncodePng(image);
    if (!png.ok()) return;
    v1::GenerateStreamResponse message;
    v1::PartialImage* partial = message.mutable_partial_image();
    partial->set_index(index);
    partial->set_step(step);
    partial->set_image(*std::move(png));
    partial->set_width(image.width);
    partial->set_height(image.height);
    absl::MutexLock lock(&shared.mu);
    shared.pending.push_back(std::move(message));
  };
  std::thread runner([&] {
    absl::StatusOr<v1::GenerateResponse> r = core_->Generate(*request, control);
    absl::MutexLock lock(&shared.mu);
    shared.result = std::move(r);
    shared.finished = true;
  });

  bool writable = true;
  for (;;) {
    std::deque<v1::GenerateStreamResponse> batch;
    bool done = false;
    {
      absl::MutexLock lock(&shared.mu);
      shared.mu.AwaitWithTimeout(absl::Condition(&Shared::Ready, &shared), absl::Milliseconds(200));
      batch.swap(shared.pending);
      done = shared.finished;
    }
    for (const v1::GenerateStreamResponse& message : batch) {
      if (writable && !writer->Write(message)) writable = false;  // Client gone: interrupt stops the run.
    }
    if (done) break;
  }
  runner.join();
  absl::StatusOr<v1::GenerateResponse> result = absl::InternalError("not run");
  {
    absl::MutexLock lock(&shared.mu);
    result = std::move(shared.result);
  }
  if (result.ok()) {
    v1::GenerateStreamResponse message;
    *message.mutable_result() = *result;
    writer->Write(message);
  }
  Record(*request, result.status(), result.ok() ? &*result : nullptr, start);
  return ToGrpcStatus(result.status());
}

grpc::Status GenerationServiceImpl::ListPipelines(grpc::ServerContext* context,
                                                  const v1::ListPipelinesRequest* request,
                                                  v1::ListPipelinesResponse* response) {
  (void)context;
  (void)request;
  *response = core_->ListPipelines();
  return grpc::Status::OK;
}

}  // namespace stowage
