// Hostile clients against the OpenAI-compatible HTTP front of a real in-process server over
// loopback: malformed JSON, huge bodies and heads, wrong types, invalid UTF-8, unknown models, out-of-
// range fields, garbage that is no HTTP at all, and partial requests left hanging or trickled a byte
// at a time. Every one gets an OpenAI error object or a closed connection within the read timeout;
// afterwards health checks (gRPC and HTTP) and generation still answer.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/e2e/http_client.h"

namespace stowage {
namespace {

// --- Hostile input ------------------------------------------------------------------------------

TEST_F(HttpTest, HostileRequestsGetOpenAiErrorsAndTheServerStaysHealthy) {
  Start();
  struct Case {
    std::string name;
    std::string raw;
    int status;
    std::string param;
    std::string code;
  };
  auto post = [](const std::string& body) { return PostRequest("/v1/images/generations", body); };
  const std::string deep = std::string(200000, '[');
  const std::vector<Case> cases = {
      {"malformed", post("{\"prompt\": "), 400, "", ""},
      {"not an object", post("[\"prompt\"]"), 400, "", ""},
      {"lenient JSON", post("{prompt: 'x',}"), 400, "", ""},
      {"deep nesting", post("{\"a\": " + deep + "}"), 400, "", ""},
      {"binary", post(std::string("\x00\x01\x02\xff\xfe", 5)), 400, "", ""},
      {"invalid UTF-8", post("{\"prompt\": \"\xed\xa0\x80\"}"), 400, "", ""},  // A surrogate.
      {"escaped lone surrogate", post("{\"prompt\": \"\\ud800\"}"), 400, "", ""},
      {"wrong type", post("{\"prompt\": [1, 2]}"), 400, "prompt", ""},
      {"n zero", post("{\"prompt\": \"x\", \"n\": 0}"), 400, "n", ""},
      {"n huge", post("{\"prompt\": \"x\", \"n\": 1000000}"), 400, "n", ""},
      {"n string", post("{\"prompt\": \"x\", \"n\": \"3\"}"), 400, "n", ""},
      {"bad size", post("{\"prompt\": \"x\", \"size\": \"64*64\"}"), 400, "size", ""},
      {"size off the grid", post("{\"prompt\": \"x\", \"size\": \"65x64\"}"), 400, "size", ""},
      {"size huge", post("{\"prompt\": \"x\", \"size\": \"99999x99999\"}"), 400, "size", ""},
      {"url", post("{\"prompt\": \"x\", \"response_format\": \"url\"}"), 400, "response_format",
       "unsupported_response_format"},
      {"unknown model", post("{\"prompt\": \"x\", \"model\": \"nope\"}"), 404, "model", "model_not_found"},
      {"huge model name", post("{\"prompt\": \"x\", \"model\": \"" + std::string(500000, 'm') + "\"}"), 404, "model",
       "model_not_found"},
      {"huge prompt", post("{\"prompt\": \"" + std::string(100000, 'p') + "\"}"), 400, "prompt", ""},
      {"steps huge", post("{\"prompt\": \"x\", \"num_inference_steps\": 100000}"), 400, "num_inference_steps", ""},
      {"NaN-ish guidance", post("{\"prompt\": \"x\", \"guidance_scale\": 1e400}"), 400, "", ""},
      {"unknown field", post("{\"prompt\": \"x\", \"steps\": 2}"), 400, "steps", "unknown_parameter"},
      // The scheduler's fields: OpenAI's `user` (the tenant) and our `priority`.
      {"priority negative", post("{\"prompt\": \"x\", \"priority\": -1}"), 400, "priority", ""},
      {"priority huge", post("{\"prompt\": \"x\", \"priority\": 1e12}"), 400, "priority", ""},
      {"priority string", post("{\"prompt\": \"x\", \"priority\": \"high\"}"), 400, "priority", ""},
      {"user not a string", post("{\"prompt\": \"x\", \"user\": 7}"), 400, "user", ""},
      {"user with spaces", post("{\"prompt\": \"x\", \"user\": \"two words\"}"), 400, "", ""},
      {"user huge", post("{\"prompt\": \"x\", \"user\": \"" + std::string(100000, 'u') + "\"}"), 400, "", ""},
      {"declared huge body", "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n{",
       413, "", "request_too_large"},
      {"sent huge body", post("{\"prompt\": \"" + std::string(17 << 20, 'a') + "\"}"), 413, "", "request_too_large"},
      {"chunked huge body",
       "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" +
           [] {
             std::string chunks;
             for (int i = 0; i < 300; ++i) chunks += "10000\r\n" + std::string(0x10000, 'a') + "\r\n";
             return chunks + "0\r\n\r\n";
           }(),
       413, "", "request_too_large"},
      {"form content type",
       "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\n{}", 400,
       "", ""},
      {"wrong method", "DELETE /v1/images/generations HTTP/1.1\r\nHost: x\r\n\r\n", 405, "", "method_not_allowed"},
      {"unknown path", "GET /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n", 404, "", "unknown_url"},
      {"odd path", "GET /%00%ff%0a HTTP/1.1\r\nHost: x\r\n\r\n", 404, "", ""},
      // Framing two parties could read two ways.
      {"control byte in a header", "GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Odd: a\x01b\r\n\r\n", 400, "", ""},
      {"two content lengths",
       "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n"
       "Content-Length: 15\r\n\r\n{\"prompt\": \"x\"}",
       400, "", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const HttpResponse r = Exchange(http_, c.raw);
    ASSERT_EQ(r.status, c.status) << r.body.substr(0, 300);
    const google::protobuf::Struct error = ErrorOf(r);
    if (!c.param.empty()) {
      EXPECT_EQ(Field(error, "param"), c.param);
    }
    if (!c.code.empty()) {
      EXPECT_EQ(Field(error, "code"), c.code);
    }
  }

  // Requests that never become a request: libmicrohttpd refuses them (a 4xx or a closed connection),
  // within the read timeout, and none of them may crash or wedge the server.
  const std::vector<std::pair<std::string, std::string>> garbage = {
      {"binary noise", std::string("\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03", 11)},
      {"no version", "GET /health\r\n\r\n"},
      {"huge request line", "GET /" + std::string(200000, 'a') + " HTTP/1.1\r\n\r\n"},
      {"header flood", "GET /health HTTP/1.1\r\n" + [] {
         std::string headers;
         for (int i = 0; i < 20000; ++i) headers += "X-Flood-" + std::to_string(i) + ": aaaaaaaaaaaaaaaa\r\n";
         return headers;
       }() + "\r\n"},
      {"huge header", "GET /health HTTP/1.1\r\nX-Big: " + std::string(1 << 20, 'b') + "\r\n\r\n"},
      {"negative length", "POST /v1/images/generations HTTP/1.1\r\nContent-Length: -5\r\n\r\n"},
      {"bad chunking", "POST /v1/images/generations HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"},
  };
  // A NUL ends a header value: libmicrohttpd reads values as C strings, so this is an empty Host
  // (the server answers; what matters is that it neither crashes nor reads past the value).
  {
    const HttpResponse r = Exchange(http_, std::string("GET /v1/models HTTP/1.1\r\nHost: \0\0\0\r\n\r\n", 38));
    EXPECT_TRUE(r.status == 200 || r.closed || (r.status >= 400 && r.status < 500)) << r.status;
  }
  // HEAD: the head of the GET reply, no body.
  {
    const HttpResponse get = Exchange(http_, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n");
    const HttpResponse head = Exchange(http_, "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n");
    EXPECT_EQ(head.status, 200);
    EXPECT_EQ(head.body, "");
    EXPECT_EQ(head.headers.at("content-length"), std::to_string(get.body.size()));
  }
  for (const auto& [name, raw] : garbage) {
    SCOPED_TRACE(name);
    const auto start = steady_clock::now();
    const HttpResponse r = Exchange(http_, raw, milliseconds(20000));
    EXPECT_TRUE(r.closed || r.status >= 400) << "neither answered nor closed";
    EXPECT_TRUE(r.status == 0 || (r.status >= 400 && r.status < 500)) << r.status;
    EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(15));
  }
  ExpectHealthy();
}

TEST_F(HttpTest, SlowAndStalledClientsAreCutWhileOthersAreServed) {
  Start();
  // Heads that stop half-way, and a body that stops after 10 of its 100 bytes.
  std::vector<int> stalled;
  for (int i = 0; i < 6; ++i) {
    const int fd = ConnectTo(http_);
    ASSERT_GE(fd, 0);
    SendAll(fd, i % 2 == 0 ? "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Le" : "GET /heal");
    stalled.push_back(fd);
  }
  const int body_fd = ConnectTo(http_);
  ASSERT_GE(body_fd, 0);
  SendAll(body_fd, "POST /v1/images/generations HTTP/1.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                   "{\"prompt\":");
  stalled.push_back(body_fd);
  // A trickle: one byte of the head every 300 ms, never finishing.
  std::atomic<bool> trickle_cut{false};
  std::thread trickle([&] {
    const int fd = ConnectTo(http_);
    const std::string head = "GET /health HTTP/1.1\r\nX-Slow: " + std::string(1000, 's');
    for (size_t i = 0; i < head.size(); ++i) {
      if (::send(fd, head.data() + i, 1, MSG_NOSIGNAL) != 1) {
        trickle_cut = true;
        break;
      }
      std::this_thread::sleep_for(milliseconds(300));
      if (i > 100) break;  // 30 s: the server should have cut it long before.
    }
    ::close(fd);
  });

  // Meanwhile everybody else is served at once.
  const auto start = steady_clock::now();
  EXPECT_EQ(Get(http_, "/health").status, 200);
  EXPECT_EQ(Post(http_, kSmall).status, 200);
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(5));

  // The server gives each of them the read timeout (10 s), then closes it.
  for (size_t i = 0; i < stalled.size(); ++i) {
    SCOPED_TRACE(i);
    bool closed = false;
    const HttpResponse r = Parse(ReadUntilClosed(stalled[i], milliseconds(20000), &closed));
    EXPECT_TRUE(closed) << "still open 20 s later";
    EXPECT_TRUE(r.status == 0 || r.status == 408 || r.status == 400) << r.status << " " << r.body;
    ::close(stalled[i]);
  }
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(25));
  trickle.join();
  EXPECT_TRUE(trickle_cut) << "a head trickled one byte at a time was never cut";
  ExpectHealthy();
}

// Issue 23 #1: 34 clients that posted a large Content-Length and sent a body byte every 2 s left
// GET /health unanswered for 180 s (every worker thread was blocked reading a body). Here 40
// such clients, a byte every 300 ms each: another client is answered at once, and every trickler
// is cut at its body deadline although it keeps sending.
TEST_F(HttpTest, TrickledBodiesNeitherStarveOthersNorOutliveTheirDeadline) {
  v1::ServerConfig config;
  config.mutable_http()->set_read_timeout_ms(2000);
  Start(config);
  const std::string head =
      "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
      "Content-Length: 1000000\r\n\r\n{";
  std::vector<int> fds;
  for (int i = 0; i < 40; ++i) {
    const int fd = ConnectTo(http_);
    ASSERT_GE(fd, 0);
    SendAll(fd, head);
    fds.push_back(fd);
  }
  const auto start = steady_clock::now();
  std::atomic<bool> stop{false};
  std::vector<steady_clock::duration> cut_after(fds.size(), steady_clock::duration::max());
  std::thread trickle([&] {
    while (!stop.load()) {
      for (size_t i = 0; i < fds.size(); ++i) {
        if (cut_after[i] != steady_clock::duration::max()) continue;
        pollfd p{fds[i], POLLIN, 0};
        char byte;
        const bool hung_up = ::poll(&p, 1, 0) > 0 && ::recv(fds[i], &byte, 1, MSG_DONTWAIT) <= 0;
        if (hung_up || ::send(fds[i], "a", 1, MSG_NOSIGNAL) != 1) cut_after[i] = steady_clock::now() - start;
      }
      std::this_thread::sleep_for(milliseconds(300));
    }
  });
  // Another client (another address: the 40 fill this one's allowance of 32) is served at once.
  const HttpResponse health = Exchange(http_, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", milliseconds(5000), "127.0.0.2");
  EXPECT_EQ(health.status, 200);
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(2));
  std::this_thread::sleep_for(std::chrono::seconds(6));
  stop = true;
  trickle.join();
  for (size_t i = 0; i < fds.size(); ++i) {
    SCOPED_TRACE(i);
    // Cut at the 2 s body deadline (or refused at once: beyond 32 from one address).
    EXPECT_LT(cut_after[i], std::chrono::milliseconds(4000)) << "a trickled body was never cut";
    ::close(fds[i]);
  }
  ExpectHealthy();
}

// A refused body is not read: the 413 comes at once and the connection closes although the client
// keeps sending (it stayed open 20 s, and for as long as the client trickled).
TEST_F(HttpTest, ARefusedBodyClosesItsConnectionAtOnce) {
  Start();
  const int fd = ConnectTo(http_);
  ASSERT_GE(fd, 0);
  SendAll(fd, "POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              "Content-Length: 100000000\r\n\r\n{\"prompt\": ");
  const auto start = steady_clock::now();
  std::string raw;
  bool closed = false;
  while (!closed && steady_clock::now() - start < std::chrono::seconds(8)) {
    ::send(fd, "aaaa", 4, MSG_NOSIGNAL);
    raw += ReadUntilClosed(fd, milliseconds(200), &closed);
  }
  EXPECT_TRUE(closed) << "the connection stayed open while its client kept sending";
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(3));
  EXPECT_EQ(Parse(raw).status, 413) << raw.substr(0, 200);
  ::close(fd);
}

// At most max_connections_per_client connections from one address: the next one is closed at
// once; other addresses are served.
TEST_F(HttpTest, ConnectionsPerClientAreBounded) {
  v1::ServerConfig config;
  config.mutable_http()->set_max_connections_per_client(4);
  Start(config);
  std::vector<int> idle;
  for (int i = 0; i < 4; ++i) {
    idle.push_back(ConnectTo(http_));
    ASSERT_GE(idle.back(), 0);
  }
  std::this_thread::sleep_for(milliseconds(200));  // Accepted (the server counts them at accept).
  const auto start = steady_clock::now();
  const HttpResponse fifth = Exchange(http_, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", milliseconds(5000));
  EXPECT_EQ(fifth.status, 0);
  EXPECT_TRUE(fifth.closed);
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_EQ(Exchange(http_, "GET /health HTTP/1.1\r\nHost: x\r\n\r\n", milliseconds(5000), "127.0.0.2").status, 200);
  for (int fd : idle) ::close(fd);
  std::this_thread::sleep_for(milliseconds(200));
  ExpectHealthy();
}

}  // namespace
}  // namespace stowage
