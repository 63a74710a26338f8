#include "server/http_front.h"

#include <civetweb.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/text.h"
#include "server/admin_service.h"
#include "server/generation_metrics.h"
#include "server/openai_images.h"

namespace stowage {
namespace {

constexpr char kGenerationsPath[] = "/v1/images/generations";
constexpr char kModelsPath[] = "/v1/models";
constexpr char kModelsPrefix[] = "/v1/models/";
constexpr char kHealthPath[] = "/health";
// civetweb's buffer for a request line and its headers; a longer head is refused and the
// connection closed (civetweb answers 413 or 400).
constexpr char kMaxRequestHeadBytes[] = "16384";

std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

// civetweb's worker threads have small fixed stacks (100 KiB in Debian's build); JSON parsing,
// protobuf printing and waiting for the core run on a thread of our own with the default stack.
template <typename F>
void OnOwnThread(F&& f) {
  std::thread thread(std::forward<F>(f));
  thread.join();
}

}  // namespace

struct HttpFront::Reply {
  int status = 200;
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;

  static Reply Error(const OpenAiError& error) {
    Reply reply;
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

HttpFront::HttpFront(const HttpFrontOptions& options, DeviceSet* core, ServerMetrics* metrics)
    : options_(options), core_(core), metrics_(metrics), started_unix_(absl::ToUnixSeconds(absl::Now())) {}

absl::StatusOr<std::unique_ptr<HttpFront>> HttpFront::Start(const HttpFrontOptions& options, DeviceSet* core,
                                                            ServerMetrics* metrics) {
  if (options.threads < 1 || options.max_body_bytes < 1 || options.read_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("http front: threads, max_body_bytes and read_timeout must be positive");
  }
  std::unique_ptr<HttpFront> front(new HttpFront(options, core, metrics));
  mg_init_library(0);  // Reference-counted; paired with mg_exit_library in the destructor.
  const std::string threads = absl::StrCat(options.threads);
  const std::string timeout_ms = absl::StrCat(absl::ToInt64Milliseconds(options.read_timeout));
  // Every response closes its connection: an idle keep-alive connection would hold one of the
  // `threads` workers, and image generation takes far longer than a TCP handshake.
  const char* civet_options[] = {"listening_ports", options.address.c_str(),
                                 "num_threads", threads.c_str(),
                                 "request_timeout_ms", timeout_ms.c_str(),
                                 "max_request_size", kMaxRequestHeadBytes,
                                 "enable_keep_alive", "no",
                                 "linger_timeout_ms", "1000",
                                 nullptr};
  mg_callbacks callbacks{};
  // civetweb's own messages (a malformed request, a client gone) are answered to the client; the
  // server log stays quiet about them.
  callbacks.log_message = [](const mg_connection*, const char*) { return 1; };
  front->context_ = mg_start(&callbacks, front.get(), civet_options);
  if (front->context_ == nullptr) {
    mg_exit_library();
    return absl::UnavailableError(absl::StrCat("http_address: cannot listen on ", options.address,
                                               " (in use by another process, or not an address of this host)"));
  }
  mg_set_request_handler(front->context_, "/", &HttpFront::HandleThunk, front.get());
  mg_server_port ports[4] = {};
  const int found = mg_get_server_ports(front->context_, 4, ports);
  if (found < 1 || ports[0].port <= 0) {
    return absl::UnavailableError(absl::StrCat("http_address: cannot listen on ", options.address));
  }
  front->address_ = absl::StrCat(HostOf(options.address), ":", ports[0].port);
  return front;
}

HttpFront::~HttpFront() {
  const bool started = context_ != nullptr;
  Shutdown(absl::Now());
  if (started) mg_exit_library();
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
    // Running generations stop at their next step (queued ones leave the queue) and answer 503.
    interrupting_.store(true);
    mu_.Await(absl::Condition(&idle));
    stopped_ = true;
  }
  // Joins civetweb's threads; a connection still sending its request is cut (civetweb polls its
  // stop flag while it waits for bytes).
  if (context_ != nullptr) mg_stop(context_);
  context_ = nullptr;
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

int HttpFront::HandleThunk(mg_connection* conn, void* self) { return static_cast<HttpFront*>(self)->Handle(conn); }

int HttpFront::Handle(mg_connection* conn) {
  bool entered = false;
  Reply reply = Route(conn, &entered);
  // A HEAD reply has a GET reply's head and no body (RFC 9110 9.3.2).
  const char* method = mg_get_request_info(conn)->request_method;
  const bool head_only = method != nullptr && std::string(method) == "HEAD";
  std::string head = absl::StrCat("HTTP/1.1 ", reply.status, " ", mg_get_response_code_text(conn, reply.status),
                                  "\r\nContent-Type: application/json\r\nContent-Length: ", reply.body.size(),
                                  "\r\nCache-Control: no-store\r\nConnection: close\r\n");
  // Busy (a full queue, a draining server): worth retrying, and the client is told when.
  if (reply.status == 429 || reply.status == 503) absl::StrAppend(&head, "Retry-After: 1\r\n");
  for (const auto& [name, value] : reply.headers) absl::StrAppend(&head, name, ": ", value, "\r\n");
  head += "\r\n";
  // A client that has gone makes these fail; there is nobody left to tell.
  if (mg_write(conn, head.data(), head.size()) > 0 && !reply.body.empty() && !head_only) {
    mg_write(conn, reply.body.data(), reply.body.size());
  }
  if (entered) Leave();
  return reply.status;
}

HttpFront::Reply HttpFront::Route(mg_connection* conn, bool* entered) {
  const mg_request_info* info = mg_get_request_info(conn);
  const std::string method = info->request_method != nullptr ? info->request_method : "";
  const std::string path = info->local_uri != nullptr ? info->local_uri : "";
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
  const char* length = nullptr;
  bool chunked = false;
  for (int i = 0; i < info->num_headers; ++i) {
    const char* name = info->http_headers[i].name;
    const char* value = info->http_headers[i].value != nullptr ? info->http_headers[i].value : "";
    if (name == nullptr) continue;
    if (absl::EqualsIgnoreCase(name, "Transfer-Encoding")) chunked = true;
    if (!absl::EqualsIgnoreCase(name, "Content-Length")) continue;
    if (length != nullptr && std::string(length) != value) {
      return Reply::Error(InvalidRequest(absl::StrCat("two different Content-Length headers (", JsonQuote(Truncated(length)),
                                                      " and ", JsonQuote(Truncated(value)), ")")));
    }
    length = value;
  }
  if (length != nullptr && chunked) {
    return Reply::Error(InvalidRequest("both Content-Length and Transfer-Encoding: send one framing"));
  }

  if (path == kHealthPath) {
    if (method != "GET" && method != "HEAD") return wrong_method("GET");
    return draining ? Reply::Error(shutting_down) : Reply::Json(HealthBody("serving"));
  }
  const bool generations = path == kGenerationsPath;
  const bool models = path == kModelsPath || absl::StartsWith(path, kModelsPrefix);
  if (!generations && !models) {
    return Reply::Error(OpenAiError{404,
                                    absl::StrCat("unknown path ", JsonQuote(Truncated(path)), "; this server answers POST ",
                                                 kGenerationsPath, ", GET ", kModelsPath, ", GET ", kModelsPath,
                                                 "/{model} and GET ", kHealthPath),
                                    "invalid_request_error", "", "unknown_url"});
  }
  if (generations && method != "POST") return wrong_method("POST");
  if (models && method != "GET") return wrong_method("GET");
  if (draining) return Reply::Error(shutting_down);
  Reply reply;
  if (!Authorized(conn, &reply)) return reply;
  if (generations) return Generate(conn, entered);

  OnOwnThread([&] {
    const v1::ListPipelinesResponse pipelines = core_->ListPipelines();
    if (path == kModelsPath) {
      reply = Reply::Json(ModelsBody(pipelines, started_unix_));
      return;
    }
    const std::string id = path.substr(strlen(kModelsPrefix));
    std::optional<std::string> body = ModelBody(pipelines, id, started_unix_);
    reply = body ? Reply::Json(*std::move(body))
                 : Reply::Error(OpenAiError{404, absl::StrCat("model ", JsonQuote(Truncated(id)), " not found"),
                                            "invalid_request_error", "model", "model_not_found"});
  });
  return reply;
}

bool HttpFront::Authorized(mg_connection* conn, Reply* reply) const {
  if (options_.api_key.empty()) return true;
  const char* header = mg_get_header(conn, "Authorization");
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

bool HttpFront::ReadBody(mg_connection* conn, std::string* body, Reply* reply) const {
  const mg_request_info* info = mg_get_request_info(conn);
  const int64_t max = options_.max_body_bytes;
  const long long declared = info->content_length;  // -1: none given (chunked, or no body).
  auto too_large = [&](const std::string& size) {
    *reply = Reply::Error(OpenAiError{413, absl::StrCat("request body is ", size, "; at most ", max, " bytes allowed"),
                                      "invalid_request_error", "", "request_too_large"});
    return false;
  };
  if (declared > max) return too_large(absl::StrCat(declared, " bytes"));
  const char* type = mg_get_header(conn, "Content-Type");
  if (type != nullptr && !absl::StartsWithIgnoreCase(absl::StripLeadingAsciiWhitespace(type), "application/json")) {
    *reply = Reply::Error(InvalidRequest(
        absl::StrCat("Content-Type ", JsonQuote(Truncated(type)), " is not supported; send application/json")));
    return false;
  }
  const absl::Time deadline = absl::Now() + options_.read_timeout;
  std::string chunk(64 * 1024, '\0');
  for (;;) {
    if (declared >= 0 && static_cast<long long>(body->size()) == declared) break;
    if (absl::Now() > deadline) {
      *reply = Reply::Error(OpenAiError{408,
                                        absl::StrCat("request body not received within ",
                                                     absl::FormatDuration(options_.read_timeout)),
                                        "invalid_request_error", "", "request_timeout"});
      return false;
    }
    const int n = mg_read(conn, chunk.data(), chunk.size());
    if (n == 0) break;
    if (n < 0) {
      *reply = Reply::Error(InvalidRequest("request body could not be read (connection error or malformed chunking)"));
      return false;
    }
    body->append(chunk.data(), static_cast<size_t>(n));
    if (static_cast<int64_t>(body->size()) > max) return too_large(absl::StrCat("more than ", max, " bytes"));
  }
  if (declared >= 0 && static_cast<long long>(body->size()) < declared) {
    *reply = Reply::Error(InvalidRequest(absl::StrCat("request body ended after ", body->size(),
                                                      " of its Content-Length ", declared, " bytes")));
    return false;
  }
  return true;
}

HttpFront::Reply HttpFront::Generate(mg_connection* conn, bool* entered) {
  Reply reply;
  std::string body;
  if (!ReadBody(conn, &body, &reply)) return reply;
  if (!Enter()) {
    return Reply::Error(OpenAiError{503, "the server is shutting down", "server_error", "", "shutting_down"});
  }
  *entered = true;
  OnOwnThread([&] {
    ImagesRequest request;
    if (std::optional<OpenAiError> error = ParseImagesRequest(body, options_.max_body_bytes, &request)) {
      reply = Reply::Error(*error);
      return;
    }
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
        return absl::OkStatus();
      };
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
    if (first_failed.load() >= 0) {
      reply = Reply::Error(ErrorFromStatus(results[first_failed.load()].status()));
      return;
    }
    std::vector<v1::GenerateResponse> images;
    images.reserve(n);
    for (auto& result : results) images.push_back(*std::move(result));
    reply = Reply::Json(ImagesResponseBody(images, absl::ToUnixSeconds(absl::Now())));
    reply.headers = StatsHeaders(images);
  });
  return reply;
}

}  // namespace stowage
