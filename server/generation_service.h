// GenerationService over gRPC: a thin adapter. Each method converts the deadline and cancellation
// into a CallControl, calls DeviceRuntime, converts the status once, and records metrics.
#ifndef STOWAGE_SERVER_GENERATION_SERVICE_H_
#define STOWAGE_SERVER_GENERATION_SERVICE_H_

#include "runtime/device_set.h"
#include "runtime/metrics.h"
#include "stowage/v1/generation.grpc.pb.h"

namespace stowage {

class GenerationServiceImpl final : public v1::GenerationService::Service {
 public:
  // Both must outlive the service. `metrics` may be null.
  GenerationServiceImpl(DeviceSet* core, ServerMetrics* metrics)
      : core_(core), metrics_(metrics) {}

  grpc::Status Generate(grpc::ServerContext* context, const v1::GenerateRequest* request,
                        v1::GenerateResponse* response) override;
  grpc::Status GenerateStream(grpc::ServerContext* context, const v1::GenerateRequest* request,
                              grpc::ServerWriter<v1::GenerateStreamResponse>* writer) override;
  grpc::Status ListPipelines(grpc::ServerContext* context, const v1::ListPipelinesRequest* request,
                             v1::ListPipelinesResponse* response) override;

 private:
  void Record(const v1::GenerateRequest& request, const absl::Status& status,
              const v1::GenerateResponse* response, absl::Time start);

  DeviceSet* core_;
  ServerMetrics* metrics_;
};

// absl::Status → grpc::Status (same code numbers, same message).
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace stowage

#endif  // STOWAGE_SERVER_GENERATION_SERVICE_H_
