// Streaming over the OpenAI-compatible HTTP front (`stream: true`): server-sent events of progress,
// previews (partial_images) and the completed images from a real in-process server over loopback,
// read with a raw HTTP/1.1 client (chunked transfer decoded here). The completed image equals the
// unstreamed one of the same seed; a client that leaves stops its generation; a request refused
// before it starts is a plain HTTP error.
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <vector>

#include <google/protobuf/struct.pb.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "tests/e2e/http_client.h"

namespace stowage {
namespace {

// The body of a chunked reply (RFC 9112 7.1); what arrived of it when it was cut.
std::string Dechunk(const std::string& body) {
  std::string out;
  size_t at = 0;
  while (at < body.size()) {
    const size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) break;
    size_t size = 0;
    if (!absl::SimpleHexAtoi(body.substr(at, eol - at), &size) || size == 0) break;
    out += body.substr(eol + 2, size);
    at = eol + 2 + size + 2;
  }
  return out;
}

struct Event {
  std::string type;
  google::protobuf::Struct data;
};

// "event: T\ndata: JSON\n\n" blocks; the data's "type" must repeat the event's.
std::vector<Event> ParseEvents(const std::string& text) {
  std::vector<Event> events;
  for (absl::string_view block : absl::StrSplit(text, "\n\n", absl::SkipEmpty())) {
    Event event;
    std::string data;
    for (absl::string_view line : absl::StrSplit(block, '\n')) {
      if (absl::ConsumePrefix(&line, "event: ")) event.type = std::string(line);
      if (absl::ConsumePrefix(&line, "data: ")) data = std::string(line);
    }
    event.data = Json(data);
    if (event.type != "error") EXPECT_EQ(Field(event.data, "type"), event.type);
    events.push_back(std::move(event));
  }
  return events;
}

double Number(const google::protobuf::Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? -1 : it->second.number_value();
}

std::string PngOf(const Event& event) {
  std::string png;
  EXPECT_TRUE(absl::Base64Unescape(Field(event.data, "b64_json"), &png));
  return png;
}

// Reads a whole streamed reply (until the server closes).
HttpResponse Stream(const std::string& address, const std::string& body) {
  const int fd = ConnectTo(address);
  EXPECT_GE(fd, 0);
  SendAll(fd, PostRequest("/v1/images/generations", body));
  bool closed = false;
  HttpResponse r = Parse(ReadUntilClosed(fd, milliseconds(60000), &closed));
  r.closed = closed;
  ::close(fd);
  return r;
}

TEST_F(HttpTest, StreamSendsProgressPreviewsAndTheImageAsServerSentEvents) {
  Start();
  const std::string request = R"({"prompt": "a small red square", "size": "64x64", "num_inference_steps": 6,
                                  "seed": 11, "n": 2, "stream": true, "partial_images": 2})";
  const HttpResponse r = Stream(http_, request);
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 300);
  EXPECT_EQ(r.headers.at("content-type"), "text/event-stream");
  EXPECT_EQ(r.headers.at("transfer-encoding"), "chunked");
  ASSERT_TRUE(r.closed);
  const std::vector<Event> events = ParseEvents(Dechunk(r.body));

  for (int image = 0; image < 2; ++image) {
    SCOPED_TRACE(image);
    std::vector<int> denoise_steps, partial_indices;
    int completed = 0;
    for (const Event& e : events) {
      if (Number(e.data, "image_index") != image) continue;
      if (e.type == "stowage.progress" && Field(e.data, "stage") == "denoise" && Number(e.data, "step") > 0) {
        denoise_steps.push_back(static_cast<int>(Number(e.data, "step")));
        EXPECT_EQ(Number(e.data, "total_steps"), 6);
      }
      if (e.type == "image_generation.partial_image") {
        partial_indices.push_back(static_cast<int>(Number(e.data, "partial_image_index")));
        int width = 0, height = 0;
        ASSERT_TRUE(PngSize(PngOf(e), &width, &height)) << "a preview that is no PNG";
        EXPECT_EQ(width, 64);
        EXPECT_EQ(Field(e.data, "size"), "64x64");
        EXPECT_EQ(completed, 0) << "a preview after its image";
      }
      if (e.type == "image_generation.completed") {
        ++completed;
        EXPECT_EQ(Number(e.data, "seed"), 11 + image);
        EXPECT_EQ(Field(e.data, "output_format"), "png");
      }
    }
    EXPECT_EQ(denoise_steps, (std::vector<int>{1, 2, 3, 4, 5, 6}));
    EXPECT_EQ(partial_indices, (std::vector<int>{0, 1}));
    EXPECT_EQ(completed, 1);
  }
  EXPECT_EQ(events.back().type, "image_generation.completed");

  // The streamed image is the image: the same as the same request unstreamed.
  const HttpResponse plain = Post(http_, R"({"prompt": "a small red square", "size": "64x64",
                                             "num_inference_steps": 6, "seed": 11})");
  ASSERT_EQ(plain.status, 200);
  std::string plain_png;
  ASSERT_TRUE(absl::Base64Unescape(
      Field(Json(plain.body).fields().at("data").list_value().values(0).struct_value(), "b64_json"), &plain_png));
  for (const Event& e : events) {
    if (e.type == "image_generation.completed" && Number(e.data, "image_index") == 0) {
      EXPECT_EQ(PngOf(e), plain_png);
    }
  }
}

TEST_F(HttpTest, AStreamRefusedBeforeItStartsIsAPlainHttpError) {
  Start();
  const HttpResponse r = Stream(http_, R"({"prompt": "x", "model": "nope", "stream": true})");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(r.headers.at("content-type"), "application/json");
  EXPECT_EQ(Field(ErrorOf(r), "code"), "model_not_found");
  for (const auto& [body, param] : std::vector<std::pair<std::string, std::string>>{
           {R"({"prompt": "x", "stream": "yes"})", "stream"},
           {R"({"prompt": "x", "stream": true, "partial_images": 4})", "partial_images"},
           {R"({"prompt": "x", "partial_images": 1})", "partial_images"}}) {
    SCOPED_TRACE(body);
    const HttpResponse bad = Post(http_, body);
    EXPECT_EQ(bad.status, 400);
    EXPECT_EQ(Field(ErrorOf(bad), "param"), param);
  }
  ExpectHealthy();
}

// A streamed request whose client goes away is stopped (the device is not kept busy for nobody):
// on a slow device a 60-step request (~6 s) is cut after its first steps, and the next request
// runs at once.
TEST_F(HttpTest, AStreamWhoseClientLeavesStopsItsGeneration) {
  Start(SlowConfig(4));
  const int fd = ConnectTo(http_);
  ASSERT_GE(fd, 0);
  SendAll(fd, PostRequest("/v1/images/generations", absl::StrCat(R"({"model": "tiny", "prompt": "slow", "size": "64x64",
      "seed": 1, "num_inference_steps": 60, "stream": true})")));
  // Wait for the first denoising step's event, then leave.
  std::string seen;
  const auto deadline = steady_clock::now() + std::chrono::seconds(30);
  char buffer[4096];
  while (seen.find("\"stage\":\"denoise\",\"step\":1") == std::string::npos && steady_clock::now() < deadline) {
    const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
    if (n <= 0) break;
    seen.append(buffer, static_cast<size_t>(n));
  }
  ASSERT_NE(seen.find("\"step\":1"), std::string::npos) << seen.substr(0, 300);
  ::shutdown(fd, SHUT_RDWR);
  ::close(fd);
  const auto start = steady_clock::now();
  const HttpResponse next = Post(http_, SlowBody(2));
  EXPECT_EQ(next.status, 200) << next.body.substr(0, 300);
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(3)) << "the abandoned stream kept the device";
}

}  // namespace
}  // namespace stowage
