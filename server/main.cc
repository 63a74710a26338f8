// stowage_server: serves the configured pipelines (or the built-in "zimage-tiny" one) over gRPC, with
// Prometheus metrics over HTTP.
#include <csignal>
#include <fstream>
#include <iostream>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "server/config.h"
#include "server/server.h"

ABSL_FLAG(std::string, config, "",
          "Server config file: protobuf text format, or JSON if it ends in .json "
          "(proto/stowage/v1/config.proto). Without it the built-in 'tiny' pipeline is served.");
ABSL_FLAG(std::string, grpc_address, "",
          "gRPC listening address, overriding the config (default 127.0.0.1:50051; port 0 picks one).");
ABSL_FLAG(std::string, metrics_address, "",
          "Prometheus /metrics address, overriding the config (default 127.0.0.1:9464; 'none' "
          "disables; port 0 picks one).");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound addresses are written there as JSON once the server is serving: "
          "{\"grpc_address\": ..., \"metrics_address\": ...}.");

namespace {

volatile std::sig_atomic_t g_stop = 0;
void OnSignal(int) { g_stop = 1; }

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage("Stowage text-to-image inference server. Flags: --config, "
                               "--grpc_address, --metrics_address, --port_file.");
  absl::ParseCommandLine(argc, argv);

  stowage::v1::ServerConfig config;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    auto loaded = stowage::LoadServerConfig(absl::GetFlag(FLAGS_config));
    if (!loaded.ok()) {
      std::cerr << "stowage_server: " << loaded.status().message() << "\n";
      return 2;
    }
    config = *std::move(loaded);
  }
  if (!absl::GetFlag(FLAGS_grpc_address).empty()) config.set_grpc_address(absl::GetFlag(FLAGS_grpc_address));
  if (!absl::GetFlag(FLAGS_metrics_address).empty()) {
    config.set_metrics_address(absl::GetFlag(FLAGS_metrics_address));
  }

  auto server = stowage::StowageServer::Start(config);
  if (!server.ok()) {
    std::cerr << "stowage_server: cannot start: " << server.status().message() << "\n";
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  std::cout << "stowage_server: serving gRPC on " << (*server)->grpc_address() << ", metrics on "
            << ((*server)->metrics_address().empty() ? std::string("(disabled)")
                                                      : absl::StrCat("http://", (*server)->metrics_address(), "/metrics"))
            << ", device " << (*server)->device_name() << std::endl;
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    {
      std::ofstream out(path + ".tmp");
      out << "{\"grpc_address\": \"" << (*server)->grpc_address() << "\", \"metrics_address\": \""
          << (*server)->metrics_address() << "\"}\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
  }

  std::signal(SIGINT, OnSignal);
  std::signal(SIGTERM, OnSignal);
  std::thread waiter([&] { (*server)->Wait(); });
  while (!g_stop) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::cout << "stowage_server: shutting down" << std::endl;
  (*server)->Shutdown();
  waiter.join();
  return 0;
}
