// StowageServer: the assembled server — configuration, DeviceRuntime, the gRPC server (generation
// service, health checking, reflection), the OpenAI-compatible HTTP front (when http_address is
// set) and the Prometheus exporter.
//
//   ASSIGN_OR_RETURN(auto server, StowageServer::Start(config));
//   std::cout << server->grpc_address();
//   server->Wait();  // Until Shutdown() from another thread or a signal handler.
#ifndef STOWAGE_SERVER_SERVER_H_
#define STOWAGE_SERVER_SERVER_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "stowage/v1/config.pb.h"

namespace grpc {
class Server;
}
namespace prometheus {
class Collectable;
class Exposer;
}

namespace stowage {

class AdminServiceImpl;
class DeviceSet;
class GenerationServiceImpl;
class HttpFront;
class ServerMetrics;

class StowageServer {
 public:
  // Validates `config` (FinalizeServerConfig), loads the pipelines, binds both ports.
  static absl::StatusOr<std::unique_ptr<StowageServer>> Start(v1::ServerConfig config);
  ~StowageServer();

  // "127.0.0.1:<bound port>" (port 0 in the config resolves to the bound port).
  const std::string& grpc_address() const { return grpc_address_; }
  // Empty when the exporter is disabled ("none").
  const std::string& metrics_address() const { return metrics_address_; }
  // The OpenAI-compatible HTTP API's "host:<bound port>"; empty when it is disabled (no
  // http_address, or "none").
  const std::string& http_address() const { return http_address_; }
  DeviceSet& devices() { return *devices_; }
  // The (first) device the pipelines run on, e.g. "cuda:0" or "sim:0".
  std::string device_name() const;

  void Wait();
  // Stops accepting requests (gRPC and HTTP), lets in-flight calls finish (up to 5 s), then returns.
  void Shutdown();

 private:
  StowageServer();
  std::unique_ptr<ServerMetrics> metrics_;
  // The exposer holds collectables by weak_ptr: the server owns them.
  std::shared_ptr<prometheus::Collectable> process_memory_;
  std::shared_ptr<prometheus::Collectable> placement_metrics_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  std::unique_ptr<DeviceSet> devices_;
  std::unique_ptr<GenerationServiceImpl> generation_service_;
  std::unique_ptr<AdminServiceImpl> admin_service_;
  std::unique_ptr<grpc::Server> grpc_server_;
  // Declared after the core: destroyed (stopped) before it.
  std::unique_ptr<HttpFront> http_front_;
  std::string grpc_address_;
  std::string metrics_address_;
  std::string http_address_;
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_SERVER_H_
