// What the gRPC benchmark clients (load_bench, batch_equivalence, multi_gpu_bench) share: a channel
// without a reply size limit, the server's default pipeline, the admin call that sets a pipeline's
// batching, lists of client counts, and latency quantiles.
#ifndef STOWAGE_BENCH_BENCH_CLIENT_H_
#define STOWAGE_BENCH_BENCH_CLIENT_H_

#include <algorithm>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"

#include <grpcpp/grpcpp.h>

#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

namespace stowage::bench {

// An insecure channel to `target` that accepts replies of any size (images).
inline std::shared_ptr<grpc::Channel> MakeChannel(const std::string& target) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(-1);
  return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

// "1,2,4" → {1, 2, 4}; nullopt (after printing which entry of `flag` is wrong) for an entry that is
// not an integer >= 1.
inline std::optional<std::vector<int>> PositiveIntList(const std::string& text, const std::string& flag) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      std::cerr << "--" << flag << ": '" << part << "' is not an integer >= 1\n";
      return std::nullopt;
    }
    out.push_back(v);
  }
  return out;
}

// The q-quantile (nearest rank) of `v`; 0 when empty.
inline double Quantile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(q * static_cast<double>(v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

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
