// Shared pieces of the HTTP front's end-to-end tests: a raw HTTP/1.1 client (every byte sent is the
// test's own, so malformed and partial requests are as easy to send as good ones), OpenAI error
// objects checked for shape, a PNG's size from its IHDR chunk, and a fixture that starts an
// in-process server with its HTTP front on loopback.
#ifndef STOWAGE_TESTS_E2E_HTTP_CLIENT_H_
#define STOWAGE_TESTS_E2E_HTTP_CLIENT_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <map>
#include <string>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/text_format.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "tests/e2e/e2e_harness.h"

namespace stowage {

using std::chrono::milliseconds;
using std::chrono::steady_clock;

// A TCP connection to "ipv4:port"; with `source` (e.g. "127.0.0.2", any loopback address) the
// connection comes from that address: another client as far as per-client limits go.
inline int ConnectTo(const std::string& address, const std::string& source = "") {
  const size_t colon = address.rfind(':');
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(std::stoi(address.substr(colon + 1))));
  inet_pton(AF_INET, address.substr(0, colon).c_str(), &addr.sin_addr);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  if (!source.empty()) {
    sockaddr_in from{};
    from.sin_family = AF_INET;
    inet_pton(AF_INET, source.c_str(), &from.sin_addr);
    if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof(from)) != 0) {
      ::close(fd);
      return -1;
    }
  }
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

inline void SendAll(int fd, const std::string& bytes) {
  size_t sent = 0;
  while (sent < bytes.size()) {
    const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
    if (n <= 0) return;  // The server may hang up on garbage: that is fine.
    sent += static_cast<size_t>(n);
  }
}

// True once `raw` holds a whole response with a Content-Length.
inline bool Complete(const std::string& raw) {
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos) return false;
  const std::string head = absl::AsciiStrToLower(raw.substr(0, end));
  const size_t at = head.find("\r\ncontent-length:");
  if (at == std::string::npos) return false;
  size_t length = 0;
  const size_t eol = head.find("\r\n", at + 2);
  if (!absl::SimpleAtoi(absl::StripAsciiWhitespace(head.substr(at + 17, eol - at - 17)), &length)) return false;
  return raw.size() >= end + 4 + length;
}

// Reads until the server closes the connection, `timeout` passes, or (with `until_complete`) a
// whole response arrived, as a client that has its answer stops reading. `closed` says whether the
// server closed.
inline std::string ReadUntilClosed(int fd, milliseconds timeout, bool* closed, bool until_complete = false) {
  std::string out;
  const auto deadline = steady_clock::now() + timeout;
  *closed = false;
  char buffer[16384];
  for (;;) {
    if (until_complete && Complete(out)) return out;
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - steady_clock::now()).count();
    if (left <= 0) return out;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) {
      *closed = true;
      return out;
    }
    out.append(buffer, static_cast<size_t>(n));
  }
}

struct HttpResponse {
  int status = 0;  // 0: no response (connection closed or timed out without one).
  std::map<std::string, std::string> headers;  // Lower-case names.
  std::string body;
  bool closed = false;
};

inline HttpResponse Parse(const std::string& raw) {
  HttpResponse r;
  const size_t end = raw.find("\r\n\r\n");
  if (end == std::string::npos || raw.compare(0, 9, "HTTP/1.1 ") != 0) return r;
  if (!absl::SimpleAtoi(raw.substr(9, 3), &r.status)) return r;
  size_t line = raw.find("\r\n") + 2;
  while (line < end) {
    const size_t next = raw.find("\r\n", line);
    const std::string header = raw.substr(line, next - line);
    const size_t colon = header.find(':');
    if (colon != std::string::npos) {
      r.headers[absl::AsciiStrToLower(header.substr(0, colon))] =
          std::string(absl::StripAsciiWhitespace(header.substr(colon + 1)));
    }
    line = next + 2;
  }
  r.body = raw.substr(end + 4);
  return r;
}

// One request: `raw` bytes, then the response, read until it is complete or the server closes the
// connection.
inline HttpResponse Exchange(const std::string& address, const std::string& raw, milliseconds timeout = milliseconds(30000),
                             const std::string& source = "") {
  const int fd = ConnectTo(address, source);
  EXPECT_GE(fd, 0) << address;
  if (fd < 0) return {};
  SendAll(fd, raw);
  bool closed = false;
  HttpResponse r = Parse(ReadUntilClosed(fd, timeout, &closed, /*until_complete=*/true));
  r.closed = closed;
  ::close(fd);
  return r;
}

inline std::string PostRequest(const std::string& path, const std::string& body, const std::string& extra_headers = "") {
  return absl::StrCat("POST ", path, " HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n",
                      extra_headers, "Content-Length: ", body.size(), "\r\n\r\n", body);
}

inline HttpResponse Post(const std::string& address, const std::string& body, const std::string& extra_headers = "",
                  milliseconds timeout = milliseconds(30000)) {
  return Exchange(address, PostRequest("/v1/images/generations", body, extra_headers), timeout);
}

inline HttpResponse Get(const std::string& address, const std::string& path, const std::string& extra_headers = "") {
  return Exchange(address, absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: localhost\r\n", extra_headers, "\r\n"));
}

inline google::protobuf::Struct Json(const std::string& text) {
  google::protobuf::Struct json;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &json);
  EXPECT_TRUE(status.ok()) << status.ToString() << ": " << text.substr(0, 300);
  return json;
}

// The error object of an OpenAI error reply, checked for shape.
inline google::protobuf::Struct ErrorOf(const HttpResponse& r) {
  const google::protobuf::Struct body = Json(r.body);
  auto it = body.fields().find("error");
  if (it == body.fields().end()) {
    ADD_FAILURE() << "no error object: " << r.body.substr(0, 300);
    return {};
  }
  const google::protobuf::Struct error = it->second.struct_value();
  for (const char* field : {"message", "type", "param", "code"}) {
    EXPECT_TRUE(error.fields().count(field)) << field << " missing: " << r.body;
  }
  EXPECT_LT(error.fields().at("message").string_value().size(), 600u) << "messages must not echo unbounded input";
  return error;
}

inline std::string Field(const google::protobuf::Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? "<absent>" : it->second.string_value();
}

// Width and height from a PNG's IHDR chunk, after checking its signature.
inline bool PngSize(const std::string& png, int* width, int* height) {
  if (png.size() < 24 || png.compare(0, 8, std::string("\x89PNG\r\n\x1a\n", 8)) != 0 || png.compare(12, 4, "IHDR") != 0) {
    return false;
  }
  auto be32 = [&](size_t at) {
    return (static_cast<uint32_t>(static_cast<uint8_t>(png[at])) << 24) |
           (static_cast<uint32_t>(static_cast<uint8_t>(png[at + 1])) << 16) |
           (static_cast<uint32_t>(static_cast<uint8_t>(png[at + 2])) << 8) | static_cast<uint8_t>(png[at + 3]);
  };
  *width = static_cast<int>(be32(16));
  *height = static_cast<int>(be32(20));
  return true;
}

// --- An in-process server with its HTTP front on loopback ----------------------------------------

inline constexpr char kSmall[] = R"({"prompt": "a small red square", "size": "64x64", "num_inference_steps": 2, "seed": 7})";

class HttpTest : public ::testing::Test {
 protected:
  void Start(v1::ServerConfig config = {}) {
    config.set_http_address("127.0.0.1:0");
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
    http_ = server_->server().http_address();
    ASSERT_FALSE(http_.empty());
  }
  void ExpectHealthy() {
    EXPECT_TRUE(HealthServing(server_->channel()));
    const HttpResponse health = Get(http_, "/health");
    EXPECT_EQ(health.status, 200) << health.body;
    const HttpResponse ok = Post(http_, kSmall);
    EXPECT_EQ(ok.status, 200) << ok.body.substr(0, 300);
  }
  std::unique_ptr<E2eServer> server_;
  std::string http_;
};

// A simulated device whose copies are slow (tests/e2e/adversarial_e2e_test.cc LifecycleTest): the
// "tiny" pipeline's transformer is streamed every step, about 0.1 s per step whatever the machine.
inline v1::ServerConfig SlowConfig(int queue_depth) {
  v1::ServerConfig config;
  config.set_queue_depth(queue_depth);
  EXPECT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
    device { kind: KIND_SIMULATED simulated_bandwidth_bytes_per_second: 56000000 }
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true }
    pipelines {
      name: "tiny" builtin: "tiny"
      group_offload { enabled: true exclude: "text_encoder" exclude: "vae" defaults { use_stream: true } }
    })pb", &config));
  return config;
}

inline std::string SlowBody(int steps, int n = 1) {
  return absl::StrCat(R"({"model": "tiny", "prompt": "slow", "size": "64x64", "seed": 1, "num_inference_steps": )",
                      steps, ", \"n\": ", n, "}");
}

}  // namespace stowage

#endif  // STOWAGE_TESTS_E2E_HTTP_CLIENT_H_
