// stowage_server: serves the configured pipelines over gRPC and, with --http_address, OpenAI's
// images API over HTTP, with Prometheus metrics over HTTP. Without --config it serves the trained
// demo pipeline "shapes" (models/demo, found next to the binary) as the default and the built-in
// random-weights "zimage-tiny".
//
// Exit status: 0 stopped by SIGINT/SIGTERM after a clean shutdown; 1 could not start (a port in use,
// a model that fails to load); 2 bad flags or config; 3 did not finish stopping within
// kStopBound of the signal (the watchdog ended it); 128+N signal N during start-up, or a second
// signal while stopping.
//
// Signals: SIGINT and SIGTERM are blocked in every thread from the first line of main() and taken by
// one thread with sigwait(), so no thread is ever interrupted inside a LibTorch kernel or a
// gRPC call, and no async-signal-safety rules apply to what happens next. During start-up (a load
// can take minutes, or hang on a stuck file system) a signal ends the process at once: nothing has
// been served, nothing needs draining. Once serving, it wakes the main thread, which shuts the gRPC
// server down (in-flight calls get up to 5 s) and destroys it; a watchdog ends the process with
// status 3 if that has not finished within kStopBound, and a second signal ends it at once.
#include <signal.h>
#include <string.h>
#include <unistd.h>

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/command_line.h"
#include "offload/device_backend.h"
#include "runtime/config.h"
#include "server/server.h"

ABSL_FLAG(std::string, config, "",
          "Server config file: protobuf text format, or JSON if it ends in .json "
          "(proto/stowage/v1/config.proto). Without it the trained demo pipeline 'shapes' (see --demo_dir) "
          "is served as the default, beside the built-in random-weights 'zimage-tiny'.");
ABSL_FLAG(std::string, demo_dir, "",
          "Without --config: the folder of the trained demo pipeline (models/demo/shapes). Empty: looked "
          "for beside the binary (Bazel runfiles, <prefix>/share/stowage/demo/shapes, the source tree "
          "of a CMake build); 'none': serve only 'zimage-tiny'.");
ABSL_FLAG(std::string, grpc_address, "",
          "gRPC listening address, overriding the config (default 127.0.0.1:50051; port 0 picks one).");
ABSL_FLAG(std::string, metrics_address, "",
          "Prometheus /metrics address, overriding the config (default 127.0.0.1:9464; 'none' "
          "disables; port 0 picks one).");
ABSL_FLAG(std::string, http_address, "",
          "Address of the OpenAI-compatible HTTP API (POST /v1/images/generations, GET /v1/models), "
          "overriding the config; 'none' disables it (the default); port 0 picks one.");
ABSL_FLAG(std::string, api_key_file, "",
          "File whose first line is the HTTP API's key (clients send 'Authorization: Bearer <key>'), "
          "overriding the environment variable STOWAGE_API_KEY and the config's auth.api_key[_file].");
ABSL_FLAG(std::string, port_file, "",
          "If set, the bound addresses are written there as JSON once the server is serving: "
          "{\"grpc_address\": ..., \"metrics_address\": ..., \"http_address\": ...} (\"\" for a "
          "disabled one).");

namespace {

bool IsModelDir(const std::string& dir) {
  struct stat st;
  return !dir.empty() && ::stat((dir + "/model_index.json").c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

// Where an installed or built server finds models/demo/shapes; "" when nowhere.
std::string FindDemoDir(const char* argv0) {
  std::vector<std::string> candidates;
  const std::string in_runfiles = "/stowage/models/demo/shapes";
  for (const char* env : {"RUNFILES_DIR", "TEST_SRCDIR"}) {
    if (const char* dir = std::getenv(env); dir != nullptr && dir[0] != '\0') candidates.push_back(dir + in_runfiles);
  }
  char exe[PATH_MAX];
  std::vector<std::string> binaries = {argv0 == nullptr ? "" : argv0};
  if (::realpath("/proc/self/exe", exe) != nullptr) binaries.push_back(exe);
  for (const std::string& binary : binaries) {
    if (binary.empty()) continue;
    candidates.push_back(binary + ".runfiles" + in_runfiles);
    const size_t slash = binary.rfind('/');
    if (slash != std::string::npos) candidates.push_back(binary.substr(0, slash) + "/../share/stowage/demo/shapes");
  }
#ifdef STOWAGE_SOURCE_DIR
  candidates.push_back(std::string(STOWAGE_SOURCE_DIR) + "/models/demo/shapes");
#endif
  for (const std::string& c : candidates) {
    if (IsModelDir(c)) return c;
  }
  return "";
}

// From the signal to the end of the process, at most.
constexpr absl::Duration kStopBound = absl::Seconds(10);
constexpr int kExitStopTimeout = 3;

// Written to stderr with one write(2): whole lines even when threads log at the same time, and
// nothing left in a buffer by _exit.
void Log(const std::string& line) {
  const std::string text = absl::StrCat("stowage_server: ", line, "\n");
  (void)!::write(STDERR_FILENO, text.data(), text.size());
}

sigset_t StopSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  return set;
}

std::atomic<bool> g_serving{false};
absl::Notification g_stop_requested;

std::string SignalName(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGTERM ? "SIGTERM" : absl::StrCat("signal ", sig); }

// The only thread that receives SIGINT/SIGTERM (they are blocked everywhere else).
void WatchSignals() {
  const sigset_t set = StopSignals();
  int sig = 0;
  while (sigwait(&set, &sig) != 0) {
  }
  if (!g_serving.load()) {
    Log(absl::StrCat(SignalName(sig), " during start-up; exiting without serving"));
    ::_exit(128 + sig);
  }
  Log(absl::StrCat(SignalName(sig), ": shutting down (at most ", absl::FormatDuration(kStopBound), ")"));
  g_stop_requested.Notify();
  // Watchdog: a second signal, or the bound passing, ends the process whatever the rest is doing.
  const absl::Time deadline = absl::Now() + kStopBound;
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) break;
    const timespec timeout = absl::ToTimespec(left);
    const int again = sigtimedwait(&set, nullptr, &timeout);
    if (again > 0) {
      Log(absl::StrCat("second signal (", SignalName(again), ") while stopping; exiting now"));
      ::_exit(128 + again);
    }
    if (errno == EAGAIN) break;  // Timed out; EINTR: wait again.
  }
  Log(absl::StrCat("did not finish stopping within ", absl::FormatDuration(kStopBound), "; exiting"));
  ::_exit(kExitStopTimeout);
}

}  // namespace

int main(int argc, char** argv) {
  // CUDA loads kernel modules lazily by default: the first request after a warmed-up load still
  // paid 1.2 s for modules its shapes needed (bench/results/throughput_h200/first_request_probe.jsonl:
  // 2.64 s vs 1.38 s warm; with CUDA_MODULE_LOADING=EAGER in the environment from the start: 1.63 s).
  // The CUDA libraries read the variable when they are loaded, before main (a setenv here was
  // measured to change nothing: e2e_random_run4.jsonl), so the server runs itself again with it set,
  // unless the operator chose a value. Before any thread exists.
  if (getenv("CUDA_MODULE_LOADING") == nullptr && setenv("CUDA_MODULE_LOADING", "EAGER", 1) == 0) {
    execv("/proc/self/exe", argv);
    // Not fatal: serving with lazy loading only makes the first request slower.
    fprintf(stderr, "stowage_server: warning: could not re-execute with CUDA_MODULE_LOADING=EAGER: %s\n",
            strerror(errno));
  }
  // First, before any thread exists: every thread inherits the mask.
  const sigset_t stop_signals = StopSignals();
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);
  std::thread(WatchSignals).detach();

  absl::SetProgramUsageMessage("Stowage text-to-image inference server. Flags: --config, "
                               "--grpc_address, --metrics_address, --http_address, --api_key_file, --port_file, --demo_dir.");
  stowage::ParseCommandLine(argc, argv, "server/main.cc");

  stowage::v1::ServerConfig config;
  if (!absl::GetFlag(FLAGS_config).empty()) {
    auto loaded = stowage::LoadServerConfig(absl::GetFlag(FLAGS_config));
    if (!loaded.ok()) {
      Log(absl::StrCat("--config: ", loaded.status().message()));
      return 2;
    }
    config = *std::move(loaded);
  }
  if (absl::GetFlag(FLAGS_config).empty()) {
    std::string demo = absl::GetFlag(FLAGS_demo_dir);
    if (demo.empty()) {
      demo = FindDemoDir(argv[0]);
      if (demo.empty()) Log("the demo pipeline's folder (models/demo/shapes) was not found: serving zimage-tiny only");
    } else if (demo == "none") {
      demo.clear();
    } else if (!IsModelDir(demo)) {
      Log(absl::StrCat("--demo_dir: '", demo, "' has no model_index.json (give the folder models/demo/shapes, or none)"));
      return 2;
    }
    if (!demo.empty()) Log(absl::StrCat("demo pipeline 'shapes' from ", demo));
    stowage::AddDefaultPipelines(config, demo);
  }
  if (!absl::GetFlag(FLAGS_grpc_address).empty()) config.set_grpc_address(absl::GetFlag(FLAGS_grpc_address));
  if (!absl::GetFlag(FLAGS_metrics_address).empty()) {
    config.set_metrics_address(absl::GetFlag(FLAGS_metrics_address));
  }
  if (!absl::GetFlag(FLAGS_http_address).empty()) config.set_http_address(absl::GetFlag(FLAGS_http_address));
  // The HTTP API key: --api_key_file, else $STOWAGE_API_KEY, else the config.
  if (!absl::GetFlag(FLAGS_api_key_file).empty()) {
    config.mutable_auth()->clear_api_key();
    config.mutable_auth()->set_api_key_file(absl::GetFlag(FLAGS_api_key_file));
  } else if (const char* key = std::getenv("STOWAGE_API_KEY"); key != nullptr && key[0] != '\0') {
    config.mutable_auth()->clear_api_key_file();
    config.mutable_auth()->set_api_key(key);
  }

  // A bad config is bad usage (status 2) whatever its status code (a missing model_dir is NOT_FOUND).
  if (auto checked = stowage::FinalizeServerConfig(config); !checked.ok()) {
    Log(absl::StrCat("cannot start: ", checked.status().message()));
    return 2;
  }
  // The allocator's settings: the CUDA libraries may read their variable when they load, before main
  // (as CUDA_MODULE_LOADING above), so after setting it the server runs itself again (no thread runs
  // yet; the new process finds it set and goes on).
  const stowage::CudaAllocatorSettings allocator = stowage::ApplyCudaAllocatorSettings(config);
  if (allocator.changed_environment) {
    execv("/proc/self/exe", argv);
    fprintf(stderr, "stowage_server: warning: could not re-execute with PYTORCH_CUDA_ALLOC_CONF set: %s\n",
            strerror(errno));
  }
  if (!allocator.note.empty()) Log(allocator.note);
  Log(absl::StrCat("starting: loading ", std::max(config.pipelines_size(), 1),
                   " pipeline(s); SIGTERM or SIGINT stops the start-up"));
  auto server = stowage::StowageServer::Start(config);
  if (!server.ok()) {
    Log(absl::StrCat("cannot start: ", server.status().message()));
    return server.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1;
  }
  g_serving.store(true);
  // What LibTorch's CUDA allocator runs with (the setting's effect, not the variable).
  if (!stowage::CudaAllocatorConf(config).empty()) Log(stowage::CudaAllocatorNote());
  std::cout << "stowage_server: serving gRPC on " << (*server)->grpc_address() << ", metrics on "
            << ((*server)->metrics_address().empty() ? std::string("(disabled)")
                                                      : absl::StrCat("http://", (*server)->metrics_address(), "/metrics"))
            << ", OpenAI images API on "
            << ((*server)->http_address().empty() ? std::string("(disabled)")
                                                   : absl::StrCat("http://", (*server)->http_address(), "/v1"))
            << ", device " << (*server)->device_name() << std::endl;
  if (!absl::GetFlag(FLAGS_port_file).empty()) {
    const std::string path = absl::GetFlag(FLAGS_port_file);
    {
      std::ofstream out(path + ".tmp");
      out << "{\"grpc_address\": \"" << (*server)->grpc_address() << "\", \"metrics_address\": \""
          << (*server)->metrics_address() << "\", \"http_address\": \"" << (*server)->http_address() << "\"}\n";
    }
    std::rename((path + ".tmp").c_str(), path.c_str());
  }

  std::thread waiter([&] { (*server)->Wait(); });
  g_stop_requested.WaitForNotification();
  (*server)->Shutdown();
  waiter.join();
  server->reset();
  Log("stopped");
  return 0;
}
