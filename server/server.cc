#include "server/server.h"

#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <fstream>
#include <sstream>

#include <grpcpp/ext/proto_server_reflection_plugin.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/status_macros.h"
#include "prometheus/exposer.h"
#include "runtime/config.h"
#include "runtime/device_set.h"
#include "runtime/device_runtime.h"
#include "server/admin_service.h"
#include "server/generation_service.h"
#include "server/http_front.h"
#include "runtime/metrics.h"
#include "server/listen_address.h"

namespace stowage {
namespace {

// The largest gRPC request accepted (RESOURCE_EXHAUSTED beyond): room for an input image and a mask.
constexpr int kMaxRequestBytes = 32 << 20;

absl::StatusOr<std::string> ReadFile(const std::string& path, const std::string& field) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::InvalidArgumentError(absl::StrCat(field, ": cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

absl::StatusOr<std::string> AdminToken(const v1::AuthConfig& auth) {
  if (!auth.admin_token().empty() && !auth.admin_token_file().empty()) {
    return absl::InvalidArgumentError("auth: set admin_token or admin_token_file, not both");
  }
  if (auth.admin_token_file().empty()) return auth.admin_token();
  ASSIGN_OR_RETURN(std::string text, ReadFile(auth.admin_token_file(), "auth.admin_token_file"));
  const std::string token = text.substr(0, text.find_first_of("\r\n"));
  if (token.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("auth.admin_token_file: '", auth.admin_token_file(),
                                                   "' holds no token on its first line"));
  }
  return token;
}

// The HTTP API's key: auth.api_key, or the first line of auth.api_key_file; empty for none.
absl::StatusOr<std::string> ApiKey(const v1::AuthConfig& auth) {
  if (auth.api_key_file().empty()) return auth.api_key();
  ASSIGN_OR_RETURN(std::string text, ReadFile(auth.api_key_file(), "auth.api_key_file"));
  const std::string key = text.substr(0, text.find_first_of("\r\n"));
  if (key.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("auth.api_key_file: '", auth.api_key_file(),
                                                   "' holds no key on its first line"));
  }
  return key;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> Credentials(const v1::TlsConfig& tls) {
  if (tls.cert_file().empty() && tls.key_file().empty()) return grpc::InsecureServerCredentials();
  if (tls.cert_file().empty() || tls.key_file().empty()) {
    return absl::InvalidArgumentError("tls: set both cert_file and key_file");
  }
  grpc::SslServerCredentialsOptions options;
  grpc::SslServerCredentialsOptions::PemKeyCertPair pair;
  ASSIGN_OR_RETURN(pair.cert_chain, ReadFile(tls.cert_file(), "tls.cert_file"));
  ASSIGN_OR_RETURN(pair.private_key, ReadFile(tls.key_file(), "tls.key_file"));
  options.pem_key_cert_pairs.push_back(std::move(pair));
  return grpc::SslServerCredentials(options);
}

// Fails fast, before any pipeline loads, when `address` ("host:port", "[v6]:port") names a TCP port
// that something else already holds: gRPC binds only once the services exist, after the loads,
// which can take minutes. A probe socket with gRPC's own options (SO_REUSEADDR, no SO_REUSEPORT) is
// bound and closed at once. Port 0 and addresses that are not host:port (unix:...) are left to gRPC.
absl::Status CheckPortFree(const std::string& address, const std::string& field) {
  const std::optional<HostPort> split = SplitHostPort(address);
  if (!split.has_value() || absl::StartsWith(address, "unix:")) return absl::OkStatus();
  if (split->port.empty() || split->port == "0") return absl::OkStatus();
  addrinfo* found = nullptr;
  if (ResolveForListening(*split, &found) != 0) {
    return absl::OkStatus();  // Not resolvable here: gRPC reports it.
  }
  absl::Status status;
  for (addrinfo* a = found; a != nullptr && status.ok(); a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 && errno == EADDRINUSE) {
      status = absl::UnavailableError(absl::StrCat(field, ": cannot listen on ", address,
                                                   " (in use by another process)"));
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return status;
}


}  // namespace

StowageServer::StowageServer() = default;

StowageServer::~StowageServer() {
  Shutdown();
  // The exporter may scrape placement state until it stops: stop it before the core goes.
  exposer_.reset();
}

absl::StatusOr<std::unique_ptr<StowageServer>> StowageServer::Start(v1::ServerConfig raw_config) {
  ASSIGN_OR_RETURN(v1::ServerConfig config, FinalizeServerConfig(std::move(raw_config)));
  std::unique_ptr<StowageServer> server(new StowageServer());
  server->metrics_ = std::make_unique<ServerMetrics>();

  if (config.metrics_address() != "none") {
    // civetweb refuses a port in use (it sets SO_REUSEADDR, not SO_REUSEPORT): the constructor throws.
    RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("metrics_address: cannot listen on ", config.metrics_address()), [&] {
      server->exposer_ = std::make_unique<prometheus::Exposer>(config.metrics_address());
    }));
    server->exposer_->RegisterCollectable(server->metrics_->registry());
    server->process_memory_ = MakeProcessMemoryCollectable();
    server->exposer_->RegisterCollectable(server->process_memory_);
    const std::vector<int> ports = server->exposer_->GetListeningPorts();
    if (ports.empty()) {
      return absl::UnavailableError(absl::StrCat("metrics_address: cannot listen on ", config.metrics_address()));
    }
    server->metrics_address_ = absl::StrCat(HostOf(config.metrics_address()), ":", ports.front());
  }

  RETURN_IF_ERROR(CheckPortFree(config.grpc_address(), "grpc_address"));
  if (!config.http_address().empty()) RETURN_IF_ERROR(CheckPortFree(config.http_address(), "http_address"));
  ASSIGN_OR_RETURN(std::string api_key, ApiKey(config.auth()));
  ASSIGN_OR_RETURN(server->devices_, DeviceSet::Create(config, server->metrics_.get()));
  if (server->exposer_ != nullptr) {
    DeviceSet* devices = server->devices_.get();
    server->placement_metrics_ = MakePlacementCollectable([devices] { return devices->PlacementSnapshots(); },
                                                          [devices] { return devices->PipelineStates(); });
    server->exposer_->RegisterCollectable(server->placement_metrics_);
  }
  server->generation_service_ =
      std::make_unique<GenerationServiceImpl>(server->devices_.get(), server->metrics_.get());
  ASSIGN_OR_RETURN(std::string token, AdminToken(config.auth()));
  server->admin_service_ = std::make_unique<AdminServiceImpl>(server->devices_.get(), std::move(token));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials, Credentials(config.tls()));

  grpc::EnableDefaultHealthCheckService(true);
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int bound_port = 0;
  builder.AddListeningPort(config.grpc_address(), credentials, &bound_port);
  // gRPC sets SO_REUSEPORT by default: a second server on the same port would start and share it.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  builder.RegisterService(server->generation_service_.get());
  builder.RegisterService(server->admin_service_.get());
  // A request may carry an input image and its mask (PNGs: a few MiB each at 1024², up to ~16 at 2048²).
  builder.SetMaxReceiveMessageSize(kMaxRequestBytes);
  builder.SetMaxSendMessageSize(-1);
  server->grpc_server_ = builder.BuildAndStart();
  if (server->grpc_server_ == nullptr || bound_port == 0) {
    return absl::UnavailableError(absl::StrCat("grpc_address: cannot listen on ", config.grpc_address(),
                                               " (in use by another process, or not an address of this host)"));
  }
  server->grpc_address_ = absl::StrCat(HostOf(config.grpc_address()), ":", bound_port);
  if (!config.http_address().empty()) {
    HttpFrontOptions http;
    http.address = config.http_address();
    http.api_key = std::move(api_key);
    http.read_timeout = absl::Milliseconds(config.http().read_timeout_ms());
    http.max_connections = config.http().max_connections();
    http.max_connections_per_client = config.http().max_connections_per_client();
    http.max_body_bytes = config.http().max_body_bytes();
    if (!config.tls().cert_file().empty()) {
      // The HTTP API speaks HTTPS with the gRPC port's certificate (both files checked above).
      ASSIGN_OR_RETURN(http.tls_cert_pem, ReadFile(config.tls().cert_file(), "tls.cert_file"));
      ASSIGN_OR_RETURN(http.tls_key_pem, ReadFile(config.tls().key_file(), "tls.key_file"));
    }
    ASSIGN_OR_RETURN(server->http_front_, HttpFront::Start(http, server->devices_.get(), server->metrics_.get()));
    server->http_address_ = server->http_front_->address();
  }
  server->grpc_server_->GetHealthCheckService()->SetServingStatus(true);
  return server;
}

std::string StowageServer::device_name() const { return devices_->devices().front()->device_name(); }

void StowageServer::Wait() {
  if (grpc_server_ != nullptr) grpc_server_->Wait();
}

void StowageServer::Shutdown() {
  // Both fronts drain at once, against one deadline.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  if (http_front_ != nullptr) http_front_->BeginShutdown();
  if (grpc_server_ != nullptr) {
    grpc_server_->GetHealthCheckService()->SetServingStatus(false);
    grpc_server_->Shutdown(absl::ToChronoTime(deadline));
  }
  if (http_front_ != nullptr) http_front_->Shutdown(deadline);
}

}  // namespace stowage
