// Shared pieces of the end-to-end tests: an in-process server on loopback, authenticated admin
// calls, a gRPC health check without generated health stubs, and raw TCP/HTTP2 writes.
#ifndef STOWAGE_TESTS_E2E_E2E_HARNESS_H_
#define STOWAGE_TESTS_E2E_E2E_HARNESS_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"
#include "server/server.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

namespace stowage {

inline constexpr char kE2eToken[] = "e2e-admin-token";

inline std::chrono::system_clock::time_point In(std::chrono::milliseconds ms) {
  return std::chrono::system_clock::now() + ms;
}

// One unary call of `method` with raw request bytes, through a completion queue driven by this
// thread (gRPC's callback API hands its tag to a gRPC thread, which ThreadSanitizer, blind to the
// uninstrumented libgrpc's own synchronisation, reports as a race with the caller).
inline grpc::Status GenericUnaryCall(const std::shared_ptr<grpc::Channel>& channel, grpc::ClientContext* context,
                                     const std::string& method, const grpc::ByteBuffer& request,
                                     grpc::ByteBuffer* response) {
  grpc::GenericStub stub(channel);
  grpc::CompletionQueue cq;
  grpc::Status status;
  auto call = stub.PrepareUnaryCall(context, method, request, &cq);
  call->StartCall();
  call->Finish(response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  while (cq.Next(&tag, &ok) && tag != reinterpret_cast<void*>(1)) {
  }
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  return status;
}

// One grpc.health.v1.Health/Check call: its status, and the response bytes in `serving`.
inline grpc::Status HealthCheckOnce(const std::shared_ptr<grpc::Channel>& channel,
                                    std::chrono::system_clock::time_point deadline, bool* serving) {
  grpc::ClientContext context;
  context.set_deadline(deadline);
  context.set_wait_for_ready(true);
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;  // Empty HealthCheckRequest: zero bytes.
  const grpc::Status status = GenericUnaryCall(channel, &context, "/grpc.health.v1.Health/Check", request, &response);
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  *serving = bytes == std::string("\x08\x01", 2);  // status: SERVING.
  return status;
}

// True when the server answers SERVING within `timeout`. Like a prober, it tries again when a call
// died with its connection (UNAVAILABLE: the server may close a connection that carried garbage).
inline bool HealthServing(const std::shared_ptr<grpc::Channel>& channel,
                          std::chrono::milliseconds timeout = std::chrono::milliseconds(5000)) {
  const auto deadline = In(timeout);
  for (;;) {
    bool serving = false;
    const grpc::Status status = HealthCheckOnce(channel, deadline, &serving);
    if (status.ok()) return serving;
    if (status.error_code() != grpc::UNAVAILABLE || std::chrono::system_clock::now() > deadline) {
      ADD_FAILURE() << "health check: " << status.error_code() << " " << status.error_message();
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

// Sends raw bytes to `address` ("127.0.0.1:port") and closes the connection.
inline void SendRawBytes(const std::string& address, const std::string& bytes) {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) break;  // The server may hang up on garbage: that is fine.
    sent += static_cast<size_t>(n);
  }
  ::close(fd);
}

// An in-process server on loopback with an admin token.
class E2eServer {
 public:
  explicit E2eServer(v1::ServerConfig config = {}) {
    config.set_grpc_address("127.0.0.1:0");
    if (config.metrics_address().empty()) config.set_metrics_address("none");
    config.mutable_auth()->set_admin_token(kE2eToken);
    auto server = StowageServer::Start(config);
    EXPECT_TRUE(server.ok()) << server.status();
    if (!server.ok()) return;
    server_ = *std::move(server);
    channel_ = grpc::CreateChannel(server_->grpc_address(), grpc::InsecureChannelCredentials());
    admin_ = v1::AdminService::NewStub(channel_);
    generation_ = v1::GenerationService::NewStub(channel_);
  }
  bool ok() const { return server_ != nullptr; }
  StowageServer& server() { return *server_; }
  const std::shared_ptr<grpc::Channel>& channel() { return channel_; }
  v1::AdminService::Stub& admin() { return *admin_; }
  v1::GenerationService::Stub& generation() { return *generation_; }
  // ListPipelines into `list`.
  grpc::Status Pipelines(v1::ListPipelinesResponse* list) {
    grpc::ClientContext context;
    return generation_->ListPipelines(&context, v1::ListPipelinesRequest(), list);
  }

  static std::unique_ptr<grpc::ClientContext> Authed(
      std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) {
    auto context = std::make_unique<grpc::ClientContext>();
    context->AddMetadata("authorization", std::string("Bearer ") + kE2eToken);
    context->set_deadline(In(timeout));
    return context;
  }

  // A small, fast request for `pipeline` ("" = default).
  static v1::GenerateRequest SmallRequest(const std::string& pipeline = "", uint64_t seed = 1) {
    v1::GenerateRequest request;
    request.set_pipeline(pipeline);
    request.set_prompt("a small red square");
    request.set_width(64);
    request.set_height(64);
    request.set_num_inference_steps(2);
    request.set_seed(seed);
    return request;
  }

  grpc::Status Generate(const v1::GenerateRequest& request, v1::GenerateResponse* response = nullptr,
                        std::chrono::milliseconds timeout = std::chrono::milliseconds(60000)) {
    v1::GenerateResponse ignored;
    grpc::ClientContext context;
    context.set_deadline(In(timeout));
    return generation_->Generate(&context, request, response != nullptr ? response : &ignored);
  }

 private:
  std::unique_ptr<StowageServer> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::AdminService::Stub> admin_;
  std::unique_ptr<v1::GenerationService::Stub> generation_;
};

}  // namespace stowage

#endif  // STOWAGE_TESTS_E2E_E2E_HARNESS_H_
