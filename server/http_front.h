// HttpFront: the OpenAI-compatible HTTP/JSON API, in the server's process and on its DeviceSet.
// Transport glue only: it reads a bounded request, authenticates it, translates it with
// server/openai_images.h, calls DeviceSet::Generate (one call per image; n images are submitted
// together, so the core may batch them) and records the same metrics as the gRPC
// GenerationService (server/generation_metrics.h). No placement policy, no pipeline knowledge.
//
// Endpoints:
//   POST /v1/images/generations   OpenAI's images API (README "HTTP API" lists the fields); with
//                                 `stream: true`, server-sent events (progress, previews, images)
//   POST /v1/images/edits         OpenAI's images.edit (multipart/form-data: the image and mask as
//                                 PNG files, the generations fields as text, plus `strength`):
//                                 image-to-image, and inpainting with a mask; streams too
//   GET  /v1/models               the pipelines as OpenAI models; GET /v1/models/{id}: one
//   GET  /health                  200 while serving, 503 once shutting down (never authenticated)
// With an API key set, /v1/ requests need "Authorization: Bearer <key>" (compared in constant time).
// With a certificate and key set, the port speaks HTTPS only (GnuTLS through libmicrohttpd).
//
// Hostile clients. The HTTP server is Debian's libmicrohttpd on an event loop (epoll, a few I/O
// threads), so a connection that sends slowly holds no thread. Every phase of a connection has a
// deadline, enforced by a sweeper that cuts the socket when it passes:
//   - the head (request line and headers, at most kMaxHeadBytes) within read_timeout of accept;
//   - the body (at most max_body_bytes) within read_timeout of the head;
//   - the reply within read_timeout plus one second per MiB of it (a reader that stops or
//     trickles is cut);
//   - while its generation runs the connection is suspended: not read, no deadline of its own
//     (the request's own deadline and the server's shutdown bound it); a streamed reply is written
//     as its events come, and a streamed request whose client has gone is stopped.
// A reply closes its connection (no keep-alive) and the unread rest of a refused body is not
// read. At most max_connections are open at once and at most max_connections_per_client per
// client address; beyond either a new connection is closed at once.
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

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/device_set.h"
#include "runtime/metrics.h"

struct MHD_Connection;
struct MHD_Daemon;

namespace stowage {

struct ImagesRequest;
struct OpenAiError;

struct HttpFrontOptions {
  // "host:port" (an IPv4 or IPv6 address or a host name; "[v6]:port"); port 0 picks a free one.
  std::string address;
  // Empty: no key required.
  std::string api_key;
  // Largest request body accepted (413 beyond it).
  int64_t max_body_bytes = int64_t{16} << 20;
  // Time allowed for a request's head, then separately for its body, then for its reply (plus a
  // second per MiB); a connection idle that long is closed too.
  absl::Duration read_timeout = absl::Seconds(10);
  // Connections open at once, over all clients and per client address.
  int max_connections = 1024;
  int max_connections_per_client = 32;
  // Event-loop threads (they only move bytes; generations run on threads of their own).
  int io_threads = 2;
  // PEM certificate chain and private key: both set serves HTTPS only; both empty, plain HTTP.
  std::string tls_cert_pem;
  std::string tls_key_pem;
};

// A request head (request line and headers) larger than this is refused (431 or a closed
// connection): libmicrohttpd's per-connection buffer is twice it.
inline constexpr int kMaxHeadBytes = 16 * 1024;

class HttpFront {
 public:
  // Binds the address and starts serving. UNAVAILABLE naming the address when it cannot listen;
  // INVALID_ARGUMENT for options out of range or TLS material the TLS library refuses.
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
  struct Connection;
  struct Request;
  HttpFront(const HttpFrontOptions& options, DeviceSet* core, ServerMetrics* metrics);

  // libmicrohttpd's callbacks (run on its I/O threads).
  int Access(MHD_Connection* connection, const char* url, const char* method, const char* upload,
             size_t* upload_size, void** request_slot);
  void Completed(void** request_slot);
  void Notify(MHD_Connection* connection, void** connection_slot, bool started);

  // The reply to a request whose head just arrived, or nothing when its body is to be read.
  bool Route(MHD_Connection* connection, const std::string& method, const std::string& path, Reply* reply);
  bool Authorized(MHD_Connection* connection, Reply* reply) const;
  // Queues `reply` (it closes the connection) and gives the connection its reply deadline.
  int Queue(MHD_Connection* connection, Request* request, const Reply& reply);
  // Queues the server-sent events of a streamed request (text/event-stream, chunked).
  int QueueStream(MHD_Connection* connection, const std::shared_ptr<Request>& request);
  // libmicrohttpd's content reader of a streamed reply.
  static ssize_t ReadStream(void* cls, uint64_t position, char* buffer, size_t max);
  // A generation request's own thread: parses the body, runs its images, and hands the connection
  // its reply (a JSON body, or server-sent events as they come).
  void RunRequest(const std::shared_ptr<Request>& request);
  // An edit's whole body (request->body) read as a form into request->form by libmicrohttpd's form
  // parser, on its thread (the body is let go); the error to answer with when it is no form.
  std::optional<OpenAiError> ReadForm(MHD_Connection* connection, Request* request);
  // Runs the images of `parsed`; with `stream`, pushes progress, previews and each completed image
  // to it as they come. The JSON reply (or the error) when everything is done.
  Reply Generate(const ImagesRequest& parsed, Request* stream);

  // Threads of running requests: started by Access, joined by the sweeper once done and by Shutdown.
  void StartRunner(std::function<void()> run);
  void ReapRunners(bool all);

  // The sweeper: cuts connections past their phase deadline.
  void SetDeadline(Connection* connection, absl::Time deadline);
  void Sweep();

  // Counts a generation request in; false when shutting down.
  bool Enter();
  void Leave();
  absl::Status Interrupted() const;

  const HttpFrontOptions options_;
  DeviceSet* const core_;
  ServerMetrics* const metrics_;
  const int64_t started_unix_;
  std::string address_;
  MHD_Daemon* daemon_ = nullptr;

  absl::Mutex mu_;
  bool draining_ ABSL_GUARDED_BY(mu_) = false;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  int in_flight_ ABSL_GUARDED_BY(mu_) = 0;
  // Set once the shutdown deadline passed: running generations stop at their next step.
  std::atomic<bool> interrupting_{false};

  // Open connections and their deadlines. A connection leaves the set (in Notify) before
  // libmicrohttpd closes its socket, so the sweeper never cuts a reused descriptor.
  absl::Mutex connections_mu_;
  absl::flat_hash_set<Connection*> connections_ ABSL_GUARDED_BY(connections_mu_);
  bool sweeper_stop_ ABSL_GUARDED_BY(connections_mu_) = false;
  std::thread sweeper_;

  struct Runner {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  absl::Mutex runners_mu_;
  std::vector<Runner> runners_ ABSL_GUARDED_BY(runners_mu_);
};

}  // namespace stowage

#endif  // STOWAGE_SERVER_HTTP_FRONT_H_
