// HttpFront: the OpenAI-compatible HTTP/JSON API, in the server's process and on its GenerationCore.
// Transport glue only: it reads a bounded request, authenticates it, translates it with
// server/openai_images.h, calls GenerationCore::Generate (one call per image; n images are
// submitted together, so the core may batch them) and records the same metrics as the gRPC
// GenerationService (server/generation_metrics.h). No placement policy, no pipeline knowledge.
//
// Endpoints:
//   POST /v1/images/generations   OpenAI's images API (README "HTTP API" lists the fields)
//   GET  /v1/models               the pipelines as OpenAI models; GET /v1/models/{id}: one
//   GET  /health                  200 while serving, 503 once shutting down (never authenticated)
// With an API key set, /v1/ requests need "Authorization: Bearer <key>" (compared in constant time).
//
// Hostile clients: the HTTP server is Debian's civetweb. A request head (line and headers) must fit
// in 16 KiB and arrive within options.read_timeout, or the connection is dropped; a body must fit in
// options.max_body_bytes and arrive within options.read_timeout of the head. At most
// options.threads connections are served at once; more wait in civetweb's accept queue.
//
// Lifetime: `core` and `metrics` must outlive the front. Shutdown() (also run by the destructor)
// answers new requests 503, gives running ones until its deadline, then interrupts them (they
// answer 503) and stops the server.
//
//   HttpFrontOptions options;
//   options.address = "127.0.0.1:0";
//   ASSIGN_OR_RETURN(auto front, HttpFront::Start(options, core, metrics));
//   std::cout << front->address();
#ifndef STOWAGE_SERVER_HTTP_FRONT_H_
#define STOWAGE_SERVER_HTTP_FRONT_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/device_set.h"
#include "runtime/metrics.h"

struct mg_connection;
struct mg_context;

namespace stowage {

struct HttpFrontOptions {
  // "host:port" (IPv4 or "[v6]:port"); port 0 picks a free one.
  std::string address;
  // Empty: no key required.
  std::string api_key;
  // Largest request body accepted (413 beyond it).
  int64_t max_body_bytes = int64_t{1} << 20;
  // Time allowed for a request's head, and then separately for its body (408 / dropped beyond it).
  absl::Duration read_timeout = absl::Seconds(10);
  // Connections served at once (civetweb worker threads).
  int threads = 32;
};

class HttpFront {
 public:
  // Binds the address and starts serving. UNAVAILABLE naming the address when it cannot listen.
  static absl::StatusOr<std::unique_ptr<HttpFront>> Start(const HttpFrontOptions& options, DeviceSet* core,
                                                          ServerMetrics* metrics);
  ~HttpFront();
  HttpFront(const HttpFront&) = delete;
  HttpFront& operator=(const HttpFront&) = delete;

  // "host:<bound port>".
  const std::string& address() const { return address_; }

  // New requests get 503 from now on; /health answers 503.
  void BeginShutdown();
  // BeginShutdown, then waits for running requests until `deadline`, interrupts the rest (503) and
  // stops the HTTP server. Idempotent.
  void Shutdown(absl::Time deadline);

 private:
  struct Reply;
  HttpFront(const HttpFrontOptions& options, DeviceSet* core, ServerMetrics* metrics);
  static int HandleThunk(mg_connection* conn, void* self);
  int Handle(mg_connection* conn);
  // `*entered` is set when the request was counted in (Enter): Handle counts it out (Leave) once
  // the reply is written, so that Shutdown never stops the server under a reply being sent.
  Reply Route(mg_connection* conn, bool* entered);
  Reply Generate(mg_connection* conn, bool* entered);
  bool Authorized(mg_connection* conn, Reply* reply) const;
  // Reads the body into *body; false with *reply set when it is too large, too slow or cut short.
  bool ReadBody(mg_connection* conn, std::string* body, Reply* reply) const;
  // Counts a generation request in; false when shutting down.
  bool Enter();
  void Leave();
  absl::Status Interrupted() const;

  const HttpFrontOptions options_;
  DeviceSet* const core_;
  ServerMetrics* const metrics_;
  const int64_t started_unix_;
  std::string address_;
  mg_context* context_ = nullptr;

  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Set once the shutdown deadline passed: running generations stop at their next step.
  std::atomic<bool> interrupting_{false};
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_HTTP_FRONT_H_
