#include "server/http_front.h"

#include <microhttpd.h>
#include <netdb.h>
#include <sys/socket.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/text.h"
#include "models/core/image.h"
#include "runtime/admin_core.h"
#include "server/admin_service.h"
#include "server/generation_metrics.h"
#include "server/listen_address.h"
#include "server/openai_images.h"
#include "server/placement_page.h"

namespace stowage {
namespace {

constexpr char kGenerationsPath[] = "/v1/images/generations";
constexpr char kEditsPath[] = "/v1/images/edits";
// Parts of an edit's form beyond which the body is refused (a real one has a handful).
constexpr size_t kMaxFormParts = 64;
constexpr char kModelsPath[] = "/v1/models";
constexpr char kModelsPrefix[] = "/v1/models/";
constexpr char kHealthPath[] = "/health";
constexpr char kPlacementPagePath[] = "/placement";
constexpr char kPlacementPath[] = "/v1/placement";
// How often the sweeper looks for connections past their deadline (the precision of every phase
// deadline).
constexpr absl::Duration kSweepPeriod = absl::Milliseconds(100);
// A reply's deadline grows by a second for each MiB it holds.
constexpr int64_t kReplyBytesPerSecond = int64_t{1} << 20;

// libmicrohttpd's messages while it starts (a port in use, a certificate GnuTLS refuses) go into
// the start error; afterwards (a client's malformed request, a client gone) it stays quiet.
struct StartLog {
  absl::Mutex mu;
  bool capturing ABSL_GUARDED_BY(mu) = true;
  std::vector<std::string> lines ABSL_GUARDED_BY(mu);
};

void LogThunk(void* cls, const char* format, va_list args) {
  auto* log = static_cast<StartLog*>(cls);
  absl::MutexLock lock(&log->mu);
  if (!log->capturing || log->lines.size() >= 8) return;
  char line[512];
  vsnprintf(line, sizeof(line), format, args);
  log->lines.push_back(std::string(absl::StripAsciiWhitespace(line)));
}

StartLog* TheStartLog() {
  static StartLog* log = new StartLog;
  return log;
}

}  // namespace

struct HttpFront::Reply {
  int status = 200;
  std::string body;
  std::string content_type = "application/json";
  std::vector<std::pair<std::string, std::string>> headers;

  std::optional<OpenAiError> error;

  static Reply Error(const OpenAiError& error) {
    Reply reply;
    reply.error = error;
    reply.status = error.http_status;
    reply.body = ErrorBody(error);
    if (error.http_status == 401) reply.headers.emplace_back("WWW-Authenticate", "Bearer");
    return reply;
  }
  static Reply Json(std::string body) {
    Reply reply;
    reply.body = std::move(body);
    return reply;
  }
};

// One open TCP (or TLS) connection: its socket and the deadline of the phase it is in.
struct HttpFront::Connection {
  int fd = -1;
  absl::Time deadline = absl::InfiniteFuture();
  bool cut = false;
};

// One request on a connection, from its head to its completion. Shared by libmicrohttpd's request
// slot, the request's thread and a streamed reply's reader: the last to let go counts it out.
struct HttpFront::Request {
  ~Request() {
    if (entered) front->Leave();
  }
  HttpFront* front = nullptr;
  MHD_Connection* mhd = nullptr;
  Connection* connection = nullptr;  // libmicrohttpd's threads only.
  std::string body;
  // POST /v1/images/edits: the body is a form, read into `form` once it is all here.
  bool edit = false;
  std::vector<FormPart> form;
  // The body outgrew max_body_bytes: the rest is not kept and the reply is 413.
  bool too_large = false;
  // Counted in by Enter() (counted out by the destructor), and its thread started.
  bool entered = false;
  bool running = false;

  // Between the request's thread (and the device worker reporting progress) and the connection.
  absl::Mutex mu;
  // The connection is suspended: by Access while the request runs, by the stream's reader while no
  // bytes are pending. Whoever gives it something to send resumes it.
  bool suspended ABSL_GUARDED_BY(mu) = false;
  // The whole reply: a JSON body, or an error before a stream began.
  std::optional<Reply> reply ABSL_GUARDED_BY(mu);
  // Server-sent events began (the reply is the stream), were queued, and have all been pushed.
  bool streaming ABSL_GUARDED_BY(mu) = false;
  bool stream_queued ABSL_GUARDED_BY(mu) = false;
  bool finished ABSL_GUARDED_BY(mu) = false;
  std::string pending ABSL_GUARDED_BY(mu);
  int64_t streamed_bytes ABSL_GUARDED_BY(mu) = 0;
  // The request completed (its reply sent, or its client gone).
  bool gone ABSL_GUARDED_BY(mu) = false;

  void ResumeLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (!suspended) return;
    suspended = false;
    MHD_resume_connection(mhd);
  }
  // Hands the connection its whole reply.
  void SetReply(Reply r) {
    absl::MutexLock lock(&mu);
    reply = std::move(r);
    ResumeLocked();
  }
  // Adds bytes of the stream (the first starts it); false when the client is gone.
  bool Push(const std::string& bytes) {
    absl::MutexLock lock(&mu);
    if (gone || finished) return false;
    pending += bytes;
    streaming = true;
    ResumeLocked();
    return true;
  }
  void FinishStream() {
    absl::MutexLock lock(&mu);
    finished = true;
    ResumeLocked();
  }
  bool Gone() {
    absl::MutexLock lock(&mu);
    return gone;
  }
};

HttpFront::HttpFront(const HttpFrontOptions& options, DeviceSet* core, ServerMetrics* metrics)
    : options_(options), core_(core), metrics_(metrics), started_unix_(absl::ToUnixSeconds(absl::Now())) {}

absl::StatusOr<std::unique_ptr<HttpFront>> HttpFront::Start(const HttpFrontOptions& options, DeviceSet* core,
                                                            ServerMetrics* metrics) {
  if (options.max_body_bytes < 1 || options.read_timeout < absl::Seconds(1) || options.max_connections < 1 ||
      options.max_connections_per_client < 1 || options.io_threads < 1 || options.io_threads > 64) {
    return absl::InvalidArgumentError(
        "http front: max_body_bytes, max_connections and max_connections_per_client must be positive, "
        "read_timeout at least 1 s, io_threads 1..64");
  }
  if (options.tls_cert_pem.empty() != options.tls_key_pem.empty()) {
    return absl::InvalidArgumentError("http front: set both the TLS certificate and its key, or neither");
  }
  // "host:port" or "[v6]:port"; an empty host listens on every address.
  const std::optional<HostPort> split = SplitHostPort(options.address);
  uint32_t port = 0;
  if (!split.has_value() || !absl::SimpleAtoi(split->port, &port) || port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("http_address: '", options.address, "' is not host:port (e.g. 127.0.0.1:8080, [::1]:0)"));
  }
  addrinfo* found = nullptr;
  if (const int error = ResolveForListening(HostPort{split->host, absl::StrCat(port)}, &found);
      error != 0 || found == nullptr) {
    return absl::UnavailableError(
        absl::StrCat("http_address: cannot listen on ", options.address, ": ", gai_strerror(error)));
  }
  sockaddr_storage bind_address{};
  std::memcpy(&bind_address, found->ai_addr, std::min<size_t>(found->ai_addrlen, sizeof(bind_address)));
  const bool ipv6 = found->ai_family == AF_INET6;
  ::freeaddrinfo(found);

  std::unique_ptr<HttpFront> front(new HttpFront(options, core, metrics));
  unsigned int flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
  if (ipv6) flags |= MHD_USE_IPv6;
  const bool tls = !options.tls_cert_pem.empty();
  if (tls) flags |= MHD_USE_TLS;
  const unsigned int idle_seconds =
      static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(absl::Ceil(options.read_timeout, absl::Seconds(1)))));
  StartLog* log = TheStartLog();
  {
    absl::MutexLock lock(&log->mu);
    log->capturing = true;
    log->lines.clear();
  }
  auto access = [](void* self, MHD_Connection* connection, const char* url, const char* method, const char*,
                   const char* upload, size_t* upload_size, void** request_slot) -> MHD_Result {
    return static_cast<HttpFront*>(self)->Access(connection, url, method, upload, upload_size, request_slot) != 0
               ? MHD_YES
               : MHD_NO;
  };
  auto completed = [](void* self, MHD_Connection*, void** request_slot, MHD_RequestTerminationCode) {
    static_cast<HttpFront*>(self)->Completed(request_slot);
  };
  auto notify = [](void* self, MHD_Connection* connection, void** connection_slot,
                   MHD_ConnectionNotificationCode code) {
    static_cast<HttpFront*>(self)->Notify(connection, connection_slot, code == MHD_CONNECTION_NOTIFY_STARTED);
  };
  using AccessFn = MHD_Result (*)(void*, MHD_Connection*, const char*, const char*, const char*, const char*,
                                  size_t*, void**);
  using CompletedFn = void (*)(void*, MHD_Connection*, void**, MHD_RequestTerminationCode);
  using NotifyFn = void (*)(void*, MHD_Connection*, void**, MHD_ConnectionNotificationCode);
  using LogFn = void (*)(void*, const char*, va_list);
  MHD_OptionItem options_list[] = {
      {MHD_OPTION_SOCK_ADDR, 0, &bind_address},
      {MHD_OPTION_THREAD_POOL_SIZE, options.io_threads, nullptr},
      {MHD_OPTION_CONNECTION_LIMIT, options.max_connections, nullptr},
      {MHD_OPTION_PER_IP_CONNECTION_LIMIT, options.max_connections_per_client, nullptr},
      {MHD_OPTION_CONNECTION_TIMEOUT, idle_seconds, nullptr},
      {MHD_OPTION_CONNECTION_MEMORY_LIMIT, 2 * kMaxHeadBytes, nullptr},
      {MHD_OPTION_STRICT_FOR_CLIENT, 1, nullptr},
      {MHD_OPTION_NOTIFY_COMPLETED, reinterpret_cast<intptr_t>(static_cast<CompletedFn>(completed)), front.get()},
      {MHD_OPTION_NOTIFY_CONNECTION, reinterpret_cast<intptr_t>(static_cast<NotifyFn>(notify)), front.get()},
      {MHD_OPTION_EXTERNAL_LOGGER, reinterpret_cast<intptr_t>(static_cast<LogFn>(&LogThunk)), log},
      {tls ? MHD_OPTION_HTTPS_MEM_CERT : MHD_OPTION_END, 0, const_cast<char*>(options.tls_cert_pem.c_str())},
      {MHD_OPTION_HTTPS_MEM_KEY, 0, const_cast<char*>(options.tls_key_pem.c_str())},
      {MHD_OPTION_END, 0, nullptr},
  };
  front->daemon_ = MHD_start_daemon(flags, static_cast<uint16_t>(port), nullptr, nullptr,
                                    static_cast<AccessFn>(access), front.get(), MHD_OPTION_ARRAY, options_list,
                                    MHD_OPTION_END);
  std::string why;
  {
    absl::MutexLock lock(&log->mu);
    log->capturing = false;
    why = absl::StrJoin(log->lines, "; ");
  }
  if (front->daemon_ == nullptr) {
    if (tls && absl::StrContains(absl::AsciiStrToLower(why), "certificate")) {
      return absl::InvalidArgumentError(absl::StrCat("tls: the HTTP API cannot use the certificate and key: ", why));
    }
    return absl::UnavailableError(absl::StrCat("http_address: cannot listen on ", options.address,
                                               " (in use by another process, or not an address of this host)",
                                               why.empty() ? "" : ": ", why));
  }
  const MHD_DaemonInfo* info = MHD_get_daemon_info(front->daemon_, MHD_DAEMON_INFO_BIND_PORT);
  if (info == nullptr || info->port == 0) {
    return absl::UnavailableError(absl::StrCat("http_address: cannot listen on ", options.address));
  }
  front->address_ = absl::StrCat(HostOf(options.address), ":", info->port);
  front->sweeper_ = std::thread([f = front.get()] { f->Sweep(); });
  return front;
}

HttpFront::~HttpFront() {
  Shutdown(absl::Now());
  {
    absl::MutexLock lock(&connections_mu_);
    sweeper_stop_ = true;
  }
  if (sweeper_.joinable()) sweeper_.join();
}

void HttpFront::BeginShutdown() {
  absl::MutexLock lock(&mu_);
  draining_ = true;
}

void HttpFront::Shutdown(absl::Time deadline) {
  {
    absl::MutexLock lock(&mu_);
    if (stopped_) return;
    draining_ = true;
    auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return in_flight_ == 0; };
    mu_.AwaitWithDeadline(absl::Condition(&idle), deadline);
    // Running generations stop at their next step (queued ones leave the queue) and answer 503;
    // their replies are written (each bounded by its reply deadline) before the server stops.
    interrupting_.store(true);
    mu_.Await(absl::Condition(&idle));
    stopped_ = true;
  }
  // Every request has let go of its connection; their threads end now.
  ReapRunners(/*all=*/true);
  // No connection is suspended now (every generation resumed its own); the rest are closed.
  if (daemon_ != nullptr) MHD_stop_daemon(daemon_);
  daemon_ = nullptr;
}

bool HttpFront::Enter() {
  absl::MutexLock lock(&mu_);
  if (draining_) return false;
  ++in_flight_;
  return true;
}

void HttpFront::Leave() {
  absl::MutexLock lock(&mu_);
  --in_flight_;
}

absl::Status HttpFront::Interrupted() const {
  if (interrupting_.load()) return absl::UnavailableError("the server is shutting down; the request was stopped");
  return absl::OkStatus();
}

// --- Connections and their deadlines -------------------------------------------------------------

void HttpFront::Notify(MHD_Connection* connection, void** connection_slot, bool started) {
  if (started) {
    auto* state = new Connection;
    const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_CONNECTION_FD);
    state->fd = info != nullptr ? info->connect_fd : -1;
    // The head must arrive within the read timeout of the accept.
    state->deadline = absl::Now() + options_.read_timeout;
    *connection_slot = state;
    absl::MutexLock lock(&connections_mu_);
    connections_.insert(state);
    return;
  }
  auto* state = static_cast<Connection*>(*connection_slot);
  if (state == nullptr) return;
  {
    absl::MutexLock lock(&connections_mu_);
    connections_.erase(state);
  }
  delete state;
  *connection_slot = nullptr;
}

void HttpFront::SetDeadline(Connection* connection, absl::Time deadline) {
  if (connection == nullptr) return;
  absl::MutexLock lock(&connections_mu_);
  connection->deadline = deadline;
}

void HttpFront::Sweep() {
  absl::MutexLock lock(&connections_mu_);
  while (!sweeper_stop_) {
    connections_mu_.AwaitWithTimeout(absl::Condition(&sweeper_stop_), kSweepPeriod);
    connections_mu_.Unlock();
    ReapRunners(/*all=*/false);
    connections_mu_.Lock();
    const absl::Time now = absl::Now();
    for (Connection* connection : connections_) {
      if (connection->cut || connection->fd < 0 || now <= connection->deadline) continue;
      // libmicrohttpd sees the socket end at its next poll and closes the connection; the
      // descriptor is still its own (it leaves connections_ before it is closed).
      ::shutdown(connection->fd, SHUT_RDWR);
      connection->cut = true;
    }
  }
}

// --- Requests ------------------------------------------------------------------------------------

int HttpFront::Access(MHD_Connection* connection, const char* url, const char* method, const char* upload,
                      size_t* upload_size, void** request_slot) {
  auto* slot = static_cast<std::shared_ptr<Request>*>(*request_slot);
  if (slot == nullptr) {
    // The head has arrived.
    auto request = std::make_shared<Request>();
    request->front = this;
    request->mhd = connection;
    slot = new std::shared_ptr<Request>(request);
    *request_slot = slot;
    const MHD_ConnectionInfo* info = MHD_get_connection_info(connection, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    request->connection = info != nullptr ? static_cast<Connection*>(info->socket_context) : nullptr;
    Reply reply;
    if (Route(connection, method != nullptr ? method : "", url != nullptr ? url : "", &reply)) {
      return Queue(connection, request.get(), reply);
    }
    // A generation: its body is due within the read timeout.
    request->edit = url != nullptr && std::string(url) == kEditsPath;
    SetDeadline(request->connection, absl::Now() + options_.read_timeout);
    return 1;
  }
  const std::shared_ptr<Request>& request = *slot;
  if (*upload_size > 0) {
    if (!request->too_large) {
      if (static_cast<int64_t>(request->body.size() + *upload_size) > options_.max_body_bytes) {
        request->too_large = true;
        std::string().swap(request->body);
      } else {
        request->body.append(upload, *upload_size);
      }
    }
    *upload_size = 0;
    return 1;
  }
  if (request->running) {
    // Resumed by the request's thread: its whole reply, or the first events of its stream.
    std::optional<Reply> done;
    bool stream = false;
    {
      absl::MutexLock lock(&request->mu);
      done.swap(request->reply);
      if (!done.has_value() && request->streaming && !request->stream_queued) {
        request->stream_queued = true;
        stream = true;
      }
    }
    if (done.has_value()) return Queue(connection, request.get(), *done);
    if (stream) return QueueStream(connection, request);
    return 1;
  }
  // The whole body is here.
  if (request->too_large) {
    return Queue(connection, request.get(),
                 Reply::Error(OpenAiError{413, absl::StrCat("request body is more than ", options_.max_body_bytes,
                                                            " bytes; at most ", options_.max_body_bytes,
                                                            " bytes allowed"),
                                          "invalid_request_error", "", "request_too_large"}));
  }
  if (request->edit) {
    if (std::optional<OpenAiError> error = ReadForm(connection, request.get())) {
      return Queue(connection, request.get(), Reply::Error(*error));
    }
  }
  if (!Enter()) {
    return Queue(connection, request.get(),
                 Reply::Error(OpenAiError{503, "the server is shutting down", "server_error", "", "shutting_down"}));
  }
  request->entered = true;
  request->running = true;
  // While it runs the connection is not read and has no deadline of its own.
  SetDeadline(request->connection, absl::InfiniteFuture());
  {
    absl::MutexLock lock(&request->mu);
    request->suspended = true;
    MHD_suspend_connection(connection);
  }
  StartRunner([this, request = request] { RunRequest(request); });
  return 1;
}

void HttpFront::Completed(void** request_slot) {
  auto* slot = static_cast<std::shared_ptr<Request>*>(*request_slot);
  if (slot == nullptr) return;
  {
    absl::MutexLock lock(&(*slot)->mu);
    (*slot)->gone = true;
  }
  delete slot;
  *request_slot = nullptr;
}

void HttpFront::StartRunner(std::function<void()> run) {
  auto done = std::make_shared<std::atomic<bool>>(false);
  std::thread thread([run = std::move(run), done]() mutable {
    run();
    run = nullptr;  // What it holds (the request) is let go before the thread counts as done.
    done->store(true);
  });
  absl::MutexLock lock(&runners_mu_);
  runners_.push_back(Runner{std::move(thread), std::move(done)});
}

void HttpFront::ReapRunners(bool all) {
  std::vector<std::thread> finished;
  {
    absl::MutexLock lock(&runners_mu_);
    auto keep = std::partition(runners_.begin(), runners_.end(),
                               [all](const Runner& r) { return !all && !r.done->load(); });
    for (auto it = keep; it != runners_.end(); ++it) finished.push_back(std::move(it->thread));
    runners_.erase(keep, runners_.end());
  }
  for (std::thread& t : finished) t.join();
}

std::optional<OpenAiError> HttpFront::ReadForm(MHD_Connection* connection, Request* request) {
  // libmicrohttpd's own form parser (multipart/form-data and url-encoded) over the whole body; each
  // part arrives in pieces at increasing offsets.
  auto on_part = [](void* cls, MHD_ValueKind, const char* key, const char*, const char*, const char*,
                    const char* data, uint64_t offset, size_t size) -> MHD_Result {
    auto* parts = static_cast<std::vector<FormPart>*>(cls);
    if (offset == 0 || parts->empty()) {
      if (parts->size() >= kMaxFormParts) return MHD_NO;
      FormPart part;
      part.name = key != nullptr ? key : "";
      parts->push_back(std::move(part));
    }
    if (size > 0) parts->back().data.append(data, size);
    return MHD_YES;
  };
  using PartFn = MHD_Result (*)(void*, MHD_ValueKind, const char*, const char*, const char*, const char*, const char*,
                                uint64_t, size_t);
  MHD_PostProcessor* form = MHD_create_post_processor(connection, 64 * 1024, static_cast<PartFn>(on_part), &request->form);
  if (form == nullptr) {
    return InvalidRequest(absl::StrCat(kEditsPath, " needs a multipart/form-data body with its boundary"));
  }
  const MHD_Result fed = MHD_post_process(form, request->body.data(), request->body.size());
  const MHD_Result ended = MHD_destroy_post_processor(form);
  std::string().swap(request->body);
  if (fed != MHD_YES || ended != MHD_YES) {
    return InvalidRequest(request->form.size() >= kMaxFormParts
                              ? absl::StrCat("the form has more than ", kMaxFormParts, " parts")
                              : "the request body is not a complete multipart/form-data form");
  }
  return std::nullopt;
}

void HttpFront::RunRequest(const std::shared_ptr<Request>& request) {
  ImagesRequest parsed;
  const std::optional<OpenAiError> error = request->edit
                                               ? ParseEditsRequest(request->form, &parsed)
                                               : ParseImagesRequest(request->body, options_.max_body_bytes, &parsed);
  if (error.has_value()) {
    request->SetReply(Reply::Error(*error));
    return;
  }
  std::string().swap(request->body);
  std::vector<FormPart>().swap(request->form);
  if (!parsed.stream) {
    request->SetReply(Generate(parsed, nullptr));
    return;
  }
  Reply reply = Generate(parsed, request.get());
  bool started = false;
  {
    absl::MutexLock lock(&request->mu);
    started = request->streaming;
  }
  if (!started) {
    // Failed before its first event (the request was refused): a plain HTTP error.
    request->SetReply(std::move(reply));
    return;
  }
  if (reply.error.has_value()) request->Push(ErrorEvent(*reply.error));
  request->FinishStream();
}

int HttpFront::QueueStream(MHD_Connection* connection, const std::shared_ptr<Request>& request) {
  MHD_Response* response =
      MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, &HttpFront::ReadStream,
                                        new std::shared_ptr<Request>(request),
                                        [](void* cls) { delete static_cast<std::shared_ptr<Request>*>(cls); });
  if (response == nullptr) return 0;
  MHD_add_response_header(response, "Content-Type", "text/event-stream");
  MHD_add_response_header(response, "Cache-Control", "no-store");
  MHD_add_response_header(response, "Connection", "close");
  // Proxies that buffer replies would hold every event back until the end.
  MHD_add_response_header(response, "X-Accel-Buffering", "no");
  const MHD_Result queued = MHD_queue_response(connection, 200, response);
  MHD_destroy_response(response);
  return queued == MHD_YES ? 1 : 0;
}

ssize_t HttpFront::ReadStream(void* cls, uint64_t, char* buffer, size_t max) {
  Request& request = **static_cast<std::shared_ptr<Request>*>(cls);
  absl::MutexLock lock(&request.mu);
  if (!request.pending.empty()) {
    const size_t n = std::min(max, request.pending.size());
    std::memcpy(buffer, request.pending.data(), n);
    request.pending.erase(0, n);
    request.streamed_bytes += static_cast<int64_t>(n);
    return static_cast<ssize_t>(n);
  }
  if (request.finished) {
    // The last chunk is due within the reply deadline of everything streamed.
    request.front->SetDeadline(request.connection,
                               absl::Now() + request.front->options_.read_timeout +
                                   absl::Seconds(request.streamed_bytes / kReplyBytesPerSecond));
    return MHD_CONTENT_READER_END_OF_STREAM;
  }
  // Nothing to send yet: the connection waits, suspended, for the next event.
  request.suspended = true;
  MHD_suspend_connection(request.mhd);
  return 0;
}

int HttpFront::Queue(MHD_Connection* connection, Request* request, const Reply& reply) {
  MHD_Response* response =
      MHD_create_response_from_buffer(reply.body.size(), const_cast<char*>(reply.body.data()), MHD_RESPMEM_MUST_COPY);
  if (response == nullptr) return 0;
  MHD_add_response_header(response, "Content-Type", reply.content_type.c_str());
  MHD_add_response_header(response, "Cache-Control", "no-store");
  // Every reply closes its connection: a kept-alive one would hold a connection slot for nothing.
  MHD_add_response_header(response, "Connection", "close");
  // Busy (a full queue, a draining server): worth retrying, and the client is told when.
  if (reply.status == 429 || reply.status == 503) MHD_add_response_header(response, "Retry-After", "1");
  for (const auto& [name, value] : reply.headers) MHD_add_response_header(response, name.c_str(), value.c_str());
  const MHD_Result queued = MHD_queue_response(connection, static_cast<unsigned int>(reply.status), response);
  MHD_destroy_response(response);
  SetDeadline(request->connection, absl::Now() + options_.read_timeout +
                                       absl::Seconds(static_cast<int64_t>(reply.body.size()) / kReplyBytesPerSecond));
  return queued == MHD_YES ? 1 : 0;
}

bool HttpFront::Route(MHD_Connection* connection, const std::string& method, const std::string& path,
                      Reply* out) {
  auto wrong_method = [&](const char* allowed) {
    Reply reply = Reply::Error(OpenAiError{405, absl::StrCat(Truncated(method), " is not allowed on ", Truncated(path), "; use ", allowed),
                                           "invalid_request_error", "", "method_not_allowed"});
    reply.headers.emplace_back("Allow", allowed);
    return reply;
  };
  bool draining = false;
  {
    absl::MutexLock lock(&mu_);
    draining = draining_;
  }
  const OpenAiError shutting_down{503, "the server is shutting down", "server_error", "", "shutting_down"};
  // Framing that two parties could read two ways (request smuggling): refused before anything else.
  struct Framing {
    std::optional<std::string> length;
    std::optional<std::string> other_length;
    bool chunked = false;
    std::optional<std::string> control;  // A header holding a NUL or another control byte.
  } framing;
  MHD_get_connection_values_n(
      connection, MHD_HEADER_KIND,
      [](void* cls, MHD_ValueKind, const char* name, size_t name_size, const char* value,
         size_t value_size) -> MHD_Result {
        auto* f = static_cast<Framing*>(cls);
        if (name == nullptr) return MHD_YES;
        const std::string v = value != nullptr ? std::string(value, value_size) : "";
        const std::string n(name, name_size);
        auto is_control = [](char c) { return (static_cast<unsigned char>(c) < 0x20 && c != '\t') || c == 0x7f; };
        if (!f->control.has_value() && (std::any_of(n.begin(), n.end(), is_control) ||
                                        std::any_of(v.begin(), v.end(), is_control))) {
          f->control = n;
        }
        if (absl::EqualsIgnoreCase(name, "Transfer-Encoding")) f->chunked = true;
        if (!absl::EqualsIgnoreCase(name, "Content-Length")) return MHD_YES;
        if (!f->length.has_value()) {
          f->length = v;
        } else if (*f->length != v && !f->other_length.has_value()) {
          f->other_length = v;
        }
        return MHD_YES;
      },
      &framing);
  if (framing.control.has_value()) {
    *out = Reply::Error(InvalidRequest(absl::StrCat("header ", JsonQuote(Truncated(*framing.control)),
                                                    " holds a control character (NUL, CR, LF or another)")));
    return true;
  }
  if (framing.other_length.has_value()) {
    *out = Reply::Error(InvalidRequest(absl::StrCat("two different Content-Length headers (",
                                                    JsonQuote(Truncated(*framing.length)), " and ",
                                                    JsonQuote(Truncated(*framing.other_length)), ")")));
    return true;
  }
  if (framing.length.has_value() && framing.chunked) {
    *out = Reply::Error(InvalidRequest("both Content-Length and Transfer-Encoding: send one framing"));
    return true;
  }

  if (path == kHealthPath) {
    if (method != "GET" && method != "HEAD") {
      *out = wrong_method("GET");
    } else {
      *out = draining ? Reply::Error(shutting_down) : Reply::Json(HealthBody("serving"));
    }
    return true;
  }
  if (path == kPlacementPagePath) {
    // The page itself holds no data (it reads /v1/placement, which the API key guards).
    if (method != "GET" && method != "HEAD") {
      *out = wrong_method("GET");
    } else {
      out->body = kPlacementPage;
      out->content_type = "text/html; charset=utf-8";
      // Its script is its own; nothing else may run in it or frame it.
      out->headers.emplace_back("Content-Security-Policy",
                                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                                "connect-src 'self'; frame-ancestors 'none'");
    }
    return true;
  }
  const bool edits = path == kEditsPath;
  const bool generations = path == kGenerationsPath || edits;
  const bool placement = path == kPlacementPath;
  const bool models = path == kModelsPath || absl::StartsWith(path, kModelsPrefix);
  if (!generations && !models && !placement) {
    *out = Reply::Error(OpenAiError{404,
                                    absl::StrCat("unknown path ", JsonQuote(Truncated(path)), "; this server answers POST ",
                                                 kGenerationsPath, ", POST ", kEditsPath, ", GET ", kModelsPath, ", GET ", kModelsPath,
                                                 "/{model}, GET ", kPlacementPath, ", GET ", kPlacementPagePath,
                                                 " and GET ", kHealthPath),
                                    "invalid_request_error", "", "unknown_url"});
    return true;
  }
  if (generations && method != "POST") {
    *out = wrong_method("POST");
    return true;
  }
  if ((models || placement) && method != "GET" && method != "HEAD") {
    *out = wrong_method("GET");
    return true;
  }
  if (draining) {
    *out = Reply::Error(shutting_down);
    return true;
  }
  if (!Authorized(connection, out)) return true;
  if (generations) {
    // Refused before its body is read: a declared size over the limit, a type that is not JSON.
    const int64_t max = options_.max_body_bytes;
    int64_t declared = 0;
    if (framing.length.has_value() && absl::SimpleAtoi(*framing.length, &declared) && declared > max) {
      *out = Reply::Error(OpenAiError{413, absl::StrCat("request body is ", declared, " bytes; at most ", max, " bytes allowed"),
                                      "invalid_request_error", "", "request_too_large"});
      return true;
    }
    const char* type = MHD_lookup_connection_value(connection, MHD_HEADER_KIND, "Content-Type");
    if (edits) {
      // OpenAI's images.edit: the image and mask as files of a form.
      const absl::string_view t = type != nullptr ? absl::StripLeadingAsciiWhitespace(type) : "";
      if (!absl::StartsWithIgnoreCase(t, "multipart/form-data") &&
          !absl::StartsWithIgnoreCase(t, "application/x-www-form-urlencoded")) {
        *out = Reply::Error(InvalidRequest(absl::StrCat("Content-Type ", JsonQuote(Truncated(type != nullptr ? type : "(none)")),
                                                        " is not supported on ", kEditsPath,
                                                        "; send multipart/form-data with the image as a file field")));
        return true;
      }
      return false;
    }
    if (type != nullptr && !absl::StartsWithIgnoreCase(absl::StripLeadingAsciiWhitespace(type), "application/json")) {
      *out = Reply::Error(InvalidRequest(
          absl::StrCat("Content-Type ", JsonQuote(Truncated(type)), " is not supported; send application/json")));
      return true;
    }
    return false;
  }
  if (placement) {
    const AdminCore admin(core_);
    std::vector<v1::GetPlacementResponse> devices;
    for (const auto& device : core_->devices()) {
      v1::GetPlacementRequest one;
      one.set_device(device->device_name());
      absl::StatusOr<v1::GetPlacementResponse> got = admin.GetPlacement(one);
      if (!got.ok()) {
        *out = Reply::Error(ErrorFromStatus(got.status()));
        return true;
      }
      devices.push_back(*std::move(got));
    }
    *out = Reply::Json(PlacementBody(devices));
    return true;
  }
  const v1::ListPipelinesResponse pipelines = core_->ListPipelines();
  if (path == kModelsPath) {
    *out = Reply::Json(ModelsBody(pipelines, started_unix_));
    return true;
  }
  const std::string id = path.substr(strlen(kModelsPrefix));
  std::optional<std::string> body = ModelBody(pipelines, id, started_unix_);
  *out = body ? Reply::Json(*std::move(body))
              : Reply::Error(OpenAiError{404, absl::StrCat("model ", JsonQuote(Truncated(id)), " not found"),
                                         "invalid_request_error", "model", "model_not_found"});
  return true;
}

bool HttpFront::Authorized(MHD_Connection* connection, Reply* reply) const {
  if (options_.api_key.empty()) return true;
  const char* header = MHD_lookup_connection_value(connection, MHD_HEADER_KIND, "Authorization");
  if (header == nullptr) {
    *reply = Reply::Error(OpenAiError{401, "missing API key: send the header 'Authorization: Bearer <key>'",
                                      "invalid_request_error", "", "invalid_api_key"});
    return false;
  }
  const absl::string_view value(header);
  if (!absl::StartsWith(value, "Bearer ") ||
      !ConstantTimeEquals(std::string(value.substr(7)), options_.api_key)) {
    *reply = Reply::Error(OpenAiError{401, "incorrect API key", "invalid_request_error", "", "invalid_api_key"});
    return false;
  }
  return true;
}

HttpFront::Reply HttpFront::Generate(const ImagesRequest& request, Request* stream) {
  // The n images are submitted together (each its own job on the device queue, so a batching
  // core can run them as one batch). An image that finds the queue full while other images of
  // the same request are still pending waits for one of them to finish and tries again: a
  // request's own images never make it fail; a queue full of other requests does (429). When
  // one image fails the others are stopped: the request fails.
  const int n = request.n;
  std::vector<absl::StatusOr<v1::GenerateResponse>> results(n, absl::InternalError("not run"));
  std::atomic<int> first_failed{-1};
  absl::Mutex progress_mu;
  int finished = 0;  // Images of this request that are done, whatever their outcome.
  auto run = [&](int i) {
    const v1::GenerateRequest image = ImageRequest(request, i);
    CallControl control;
    control.interrupt = [&]() -> absl::Status {
      if (absl::Status stop = Interrupted(); !stop.ok()) return stop;
      if (first_failed.load() >= 0) return absl::CancelledError("another image of the same request failed");
      if (stream != nullptr && stream->Gone()) return absl::CancelledError("the client closed the stream");
      return absl::OkStatus();
    };
    if (stream != nullptr) {
      // Events come from the device worker's thread: appending them is all it does (a preview's
      // PNG is encoded there, at most kMaxPartialImages times per image).
      control.on_progress = [stream, i](const v1::Progress& progress) { stream->Push(ProgressEvent(i, progress)); };
      control.on_preview = [stream, i, edit = request.edit](int index, int, const Image& image) {
        absl::StatusOr<std::string> png = EncodePng(image);
        if (png.ok()) {
          stream->Push(
              PartialImageEvent(i, index, *png, image.width, image.height, absl::ToUnixSeconds(absl::Now()), edit));
        }
      };
    }
    absl::Time start;
    for (;;) {
      int finished_before = 0;
      {
        absl::MutexLock lock(&progress_mu);
        finished_before = finished;
      }
      start = absl::Now();
      results[i] = core_->Generate(image, control);
      const absl::Status& status = results[i].status();
      if (status.code() != absl::StatusCode::kResourceExhausted || !absl::StrContains(status.message(), "queue")) {
        break;
      }
      absl::MutexLock lock(&progress_mu);
      // Every other image is done: the queue is full of other requests.
      if (finished_before == n - 1) break;
      // Wait for one of this request's images to finish (one may have while we were refused).
      // The timeout re-checks the interrupt, which is no state of this mutex.
      auto moved = [&] { return finished != finished_before; };
      while (!moved() && control.interrupt().ok()) {
        progress_mu.AwaitWithTimeout(absl::Condition(&moved), absl::Milliseconds(50));
      }
      if (!control.interrupt().ok()) break;
    }
    RecordGeneration(*core_, metrics_, image, results[i].status(), results[i].ok() ? &*results[i] : nullptr, start);
    if (stream != nullptr && results[i].ok()) {
      stream->Push(CompletedEvent(i, *results[i], absl::ToUnixSeconds(absl::Now()), request.edit));
    }
    if (!results[i].ok()) {
      int none = -1;
      first_failed.compare_exchange_strong(none, i);
    }
    absl::MutexLock lock(&progress_mu);
    ++finished;
  };
  std::vector<std::thread> threads;
  for (int i = 1; i < n; ++i) threads.emplace_back(run, i);
  run(0);
  for (std::thread& t : threads) t.join();
  if (first_failed.load() >= 0) return Reply::Error(ErrorFromStatus(results[first_failed.load()].status()));
  std::vector<v1::GenerateResponse> images;
  images.reserve(n);
  for (auto& result : results) images.push_back(*std::move(result));
  Reply reply = Reply::Json(ImagesResponseBody(images, absl::ToUnixSeconds(absl::Now())));
  reply.headers = StatsHeaders(images);
  return reply;
}

}  // namespace stowage
