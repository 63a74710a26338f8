// What the gRPC benchmark clients (load_bench, batch_equivalence) share: the server's default
// pipeline and the admin call that sets a pipeline's batching.
#ifndef STOWAGE_BENCH_BENCH_CLIENT_H_
#define STOWAGE_BENCH_BENCH_CLIENT_H_

#include <iostream>
#include <string>

#include <grpcpp/grpcpp.h>

#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

namespace stowage::bench {

// The server's default pipeline, or "" (after printing why) when ListPipelines fails.
inline std::string DefaultPipeline(v1::GenerationService::Stub& stub) {
  v1::ListPipelinesResponse list;
  grpc::ClientContext context;
  const grpc::Status status = stub.ListPipelines(&context, {}, &list);
  if (!status.ok()) std::cerr << "ListPipelines: " << status.error_message() << "\n";
  for (const auto& p : list.pipelines()) {
    if (p.is_default()) return p.name();
  }
  return "";
}

// SetBatching(max_batch_size = size, max_queue_delay_ms = delay_ms, 0 when size is 1) with `token`;
// false (after printing why) when the server refuses.
inline bool SetBatching(v1::AdminService::Stub& admin, const std::string& token, const std::string& pipeline,
                        int size, int delay_ms) {
  v1::SetBatchingRequest request;
  request.set_pipeline(pipeline);
  request.mutable_batching()->set_max_batch_size(size);
  request.mutable_batching()->set_max_queue_delay_ms(size > 1 ? delay_ms : 0);
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer " + token);
  v1::SetBatchingResponse response;
  const grpc::Status status = admin.SetBatching(&context, request, &response);
  if (!status.ok()) std::cerr << "SetBatching: " << status.error_message() << "\n";
  return status.ok();
}

}  // namespace stowage::bench

#endif  // STOWAGE_BENCH_BENCH_CLIENT_H_
