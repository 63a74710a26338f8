#include "base/out_of_memory.h"
#include "server/openai_images.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "absl/strings/escaping.h"

namespace stowage {
namespace {

constexpr int64_t kMax = 1 << 20;

// Parses `text` as JSON with protobuf (a second, independent reader of what we wrote).
google::protobuf::Struct ReadJson(const std::string& text) {
  google::protobuf::Struct json;
  const auto status = google::protobuf::util::JsonStringToMessage(text, &json);
  EXPECT_TRUE(status.ok()) << status.ToString() << "\n" << text;
  return json;
}

ImagesRequest ParseOk(const std::string& body) {
  ImagesRequest request;
  std::optional<OpenAiError> error = ParseImagesRequest(body, kMax, &request);
  EXPECT_FALSE(error.has_value()) << body << " -> " << (error ? error->message : "");
  return request;
}

TEST(ParseImagesRequestTest, OpenAiFieldsAndStowageExtrasMapToTheGenerateRequest) {
  const ImagesRequest r = ParseOk(R"({"model": "tiny", "prompt": "a red circle", "n": 3, "size": "512x256",
      "response_format": "b64_json", "negative_prompt": "blue", "num_inference_steps": 4, "guidance_scale": 2.5,
      "seed": 42, "user": "u-1", "quality": "standard", "output_format": "png"})");
  EXPECT_EQ(r.n, 3);
  EXPECT_EQ(r.base.pipeline(), "tiny");
  EXPECT_EQ(r.base.prompt(), "a red circle");
  EXPECT_EQ(r.base.negative_prompt(), "blue");
  EXPECT_EQ(r.base.width(), 512);
  EXPECT_EQ(r.base.height(), 256);
  EXPECT_EQ(r.base.num_inference_steps(), 4);
  EXPECT_FLOAT_EQ(r.base.guidance_scale(), 2.5f);
  ASSERT_TRUE(r.base.has_seed());
  EXPECT_EQ(r.base.seed(), 42u);
  EXPECT_EQ(ImageRequest(r, 0).seed(), 42u);
  EXPECT_EQ(ImageRequest(r, 2).seed(), 44u);
  // OpenAI's `user` is the scheduler's tenant (checked by the core like the gRPC field).
  EXPECT_EQ(r.base.tenant(), "u-1");
  EXPECT_EQ(r.base.priority(), 0);
}

TEST(ParseImagesRequestTest, PriorityIsAStowageExtraInItsRange) {
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "priority": 9})").base.priority(), 9);
  EXPECT_EQ(ParseOk(R"({"prompt": "x", "priority": null})").base.priority(), 0);
  for (const std::string body : {R"({"prompt": "x", "priority": 10})", R"({"prompt": "x", "priority": -1})",
                                 R"({"prompt": "x", "priority": "high"})", R"({"prompt": "x", "priority": 1.5})"}) {
    ImagesRequest request;
    const std::optional<OpenAiError> error = ParseImagesRequest(body, kMax, &request);
    ASSERT_TRUE(error.has_value()) << body;
    EXPECT_EQ(error->param, "priority") << body << ": " << error->message;
  }
  ImagesRequest request;
  const std::optional<OpenAiError> error = ParseImagesRequest(R"({"prompt": "x", "user": 7})", kMax, &request);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->param, "user");
}

TEST(ParseImagesRequestTest, DefaultsLeaveThePipelineToDecide) {
  const ImagesRequest r = ParseOk(R"({"prompt": "x", "size": "auto", "seed": null, "model": null})");
  EXPECT_EQ(r.n, 1);
  EXPECT_EQ(r.base.pipeline(), "");
  EXPECT_EQ(r.base.width(), 0);
  EXPECT_EQ(r.base.height(), 0);
  EXPECT_FALSE(r.base.has_seed());
  EXPECT_FALSE(r.base.has_guidance_scale());
  EXPECT_FALSE(ImageRequest(r, 3).has_seed());  // Unset seeds stay unset: the core draws each.
}

TEST(ParseImagesRequestTest, HostileBodiesAreRefusedNamingTheField) {
  struct Case {
    std::string body;
    int status;
    std::string param;
    std::string needle;
  };
  const std::string deep = std::string(100000, '[') + std::string(100000, ']');
  const std::vector<Case> cases = {
      {"", 400, "", "must be a JSON object"},
      {"   ", 400, "", "must be a JSON object"},
      {"null", 400, "", "must be a JSON object"},
      {"[1, 2]", 400, "", "must be a JSON object"},
      {"\"prompt\"", 400, "", "must be a JSON object"},
      {"{", 400, "", "not valid JSON"},
      {"{\"prompt\": \"x\"} trailing", 400, "", "not valid JSON"},
      {"{\"prompt\": \"x\" \"n\": 1}", 400, "", "not valid JSON"},
      {"{\"a\":" + deep + "}", 400, "", "nests deeper than 8"},
      {"{\"prompt\": \"\xff\xfe\"}", 400, "", "not valid UTF-8"},
      {"{\"prompt\": \"\xc0\xaf\"}", 400, "", "not valid UTF-8"},  // Overlong '/'.
      {"{}", 400, "prompt", "prompt is required"},
      {"{\"prompt\": null}", 400, "prompt", "prompt is required"},
      {"{\"prompt\": 1}", 400, "prompt", "must be a string, not a number"},
      {"{\"prompt\": [\"x\"]}", 400, "prompt", "not an array"},
      // Not JSON, though protobuf's lenient reader took them.
      {"{prompt: 'x',}", 400, "", "not valid JSON"},
      {"{\"prompt\": \"x\",}", 400, "", "not valid JSON"},
      {"{\"prompt\": {\"a\": 1}}", 400, "prompt", "not an object"},
      {"{\"prompt\": true}", 400, "prompt", "not a boolean"},
      {"{\"prompt\": \"x\", \"model\": 7}", 400, "model", "model must be a string"},
      {"{\"prompt\": \"x\", \"negative_prompt\": false}", 400, "negative_prompt", "must be a string"},
      {"{\"prompt\": \"x\", \"n\": 0}", 400, "n", "n is 0; allowed: 1 to 10"},
      {"{\"prompt\": \"x\", \"n\": 11}", 400, "n", "n is 11; allowed: 1 to 10"},
      {"{\"prompt\": \"x\", \"n\": -1}", 400, "n", "n is -1"},
      {"{\"prompt\": \"x\", \"n\": 1.5}", 400, "n", "n must be an integer"},
      {"{\"prompt\": \"x\", \"n\": \"2\"}", 400, "n", "n must be an integer, not a string"},
      {"{\"prompt\": \"x\", \"n\": 1e300}", 400, "n", "n is 1.0000000000000001e+300"},
      {"{\"prompt\": \"x\", \"n\": 1e999}", 400, "", ""},  // Out of double range: the parser's error or n's.
      {"{\"prompt\": \"x\", \"seed\": -1}", 400, "seed", "seed is -1"},
      {"{\"prompt\": \"x\", \"seed\": 9007199254740993}", 400, "seed", "seed is"},
      {"{\"prompt\": \"x\", \"seed\": 0.5}", 400, "seed", "seed must be an integer"},
      {"{\"prompt\": \"x\", \"num_inference_steps\": -3}", 400, "num_inference_steps", "num_inference_steps is -3"},
      {"{\"prompt\": \"x\", \"num_inference_steps\": 4294967296}", 400, "num_inference_steps", "is 4294967296"},
      {"{\"prompt\": \"x\", \"guidance_scale\": \"high\"}", 400, "guidance_scale", "must be a number"},
      {"{\"prompt\": \"x\", \"guidance_scale\": -1}", 400, "guidance_scale", "within [0, 100]"},
      {"{\"prompt\": \"x\", \"guidance_scale\": 1e30}", 400, "guidance_scale", "within [0, 100]"},
      {"{\"prompt\": \"x\", \"response_format\": \"url\"}", 400, "response_format", "\"url\" is not supported"},
      {"{\"prompt\": \"x\", \"response_format\": \"jpeg\"}", 400, "response_format", "allowed: \"b64_json\""},
      {"{\"prompt\": \"x\", \"response_format\": 1}", 400, "response_format", "must be a string"},
      {"{\"prompt\": \"x\", \"output_format\": \"webp\"}", 400, "output_format", "allowed: \"png\""},
      {"{\"prompt\": \"x\", \"steps\": 3}", 400, "steps", "unrecognized request argument \"steps\""},
      {"{\"prompt\": \"x\", \"stream\": 1}", 400, "stream", "stream must be true or false, not a number"},
      {"{\"prompt\": \"x\", \"stream\": true, \"partial_images\": 4}", 400, "partial_images", "allowed: 0 to 3"},
      {"{\"prompt\": \"x\", \"partial_images\": 2}", 400, "partial_images", "needs stream: true"},
      {"{\"prompt\": \"x\", \"" + std::string(5000, 'k') + "\": 1}", 400, "", "(5000 bytes)"},
      {"{\"prompt\": \"x\", \"size\": 512}", 400, "size", "size must be a string"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body.substr(0, 80));
    ImagesRequest request;
    std::optional<OpenAiError> error = ParseImagesRequest(c.body, kMax, &request);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->http_status, c.status);
    EXPECT_EQ(error->type, "invalid_request_error");
    if (!c.param.empty()) EXPECT_EQ(error->param, c.param);
    EXPECT_NE(error->message.find(c.needle), std::string::npos) << error->message;
    EXPECT_LT(error->message.size(), 600u) << "messages must not echo unbounded input";
    ReadJson(ErrorBody(*error));  // Always valid JSON.
  }
}

TEST(ParseImagesRequestTest, SizeStringsAreStrict) {
  for (const std::string bad : {"", "64", "64x", "x64", "-64x64", "64x-64", "64X64", "64x64x64", "064x64", "0x0",
                                "123456x64", " 64x64", "64x64 ", "64 x64", "6.4x64", "+64x64", "0x64", "64\u00d764",
                                "autox", "AUTO", "1e3x64"}) {
    SCOPED_TRACE(bad);
    ImagesRequest request;
    std::optional<OpenAiError> error =
        ParseImagesRequest("{\"prompt\": \"x\", \"size\": \"" + bad + "\"}", kMax, &request);
    ASSERT_TRUE(error.has_value());
    EXPECT_EQ(error->http_status, 400);
    EXPECT_EQ(error->param, "size");
  }
  const ImagesRequest r = ParseOk(R"({"prompt": "x", "size": "99999x1"})");  // Ranges are the core's.
  EXPECT_EQ(r.base.width(), 99999);
  EXPECT_EQ(r.base.height(), 1);
}

TEST(ParseImagesRequestTest, BodiesOverTheLimitAre413) {
  ImagesRequest request;
  const std::string body = "{\"prompt\": \"" + std::string(2000, 'a') + "\"}";
  std::optional<OpenAiError> error = ParseImagesRequest(body, 1000, &request);
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(error->http_status, 413);
  EXPECT_EQ(error->code, "request_too_large");
}

TEST(ErrorFromStatusTest, CoreStatusesBecomeOpenAiErrorsWithTheirHttpStatus) {
  struct Case {
    absl::Status status;
    int http;
    std::string type, param, code;
  };
  const std::vector<Case> cases = {
      {absl::InvalidArgumentError("width is 65; allowed: ..."), 400, "invalid_request_error", "size", ""},
      {absl::InvalidArgumentError("prompt is required"), 400, "invalid_request_error", "prompt", ""},
      {absl::InvalidArgumentError("negative_prompt is 5 bytes"), 400, "invalid_request_error", "negative_prompt", ""},
      {absl::InvalidArgumentError("promptness"), 400, "invalid_request_error", "", ""},
      {absl::NotFoundError("pipeline 'x' not found"), 404, "invalid_request_error", "model", "model_not_found"},
      {absl::ResourceExhaustedError("the device queue is full (1 waiting)"), 429, "rate_limit_error", "", "queue_full"},
      {absl::ResourceExhaustedError("out of device memory"), 429, "rate_limit_error", "", "resource_exhausted"},
      {MakeCannotFitStatus("running 'x/transformer' ran out of device memory"), 400, "invalid_request_error", "",
       "insufficient_device_memory"},
      {absl::UnavailableError("server is shutting down"), 503, "server_error", "", "unavailable"},
      {absl::FailedPreconditionError("pipeline 'x' is being unloaded"), 503, "server_error", "", "unavailable"},
      {absl::DeadlineExceededError("late"), 504, "server_error", "", "timeout"},
      {absl::InternalError("boom"), 500, "server_error", "", ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.status.ToString());
    const OpenAiError e = ErrorFromStatus(c.status);
    EXPECT_EQ(e.http_status, c.http);
    EXPECT_EQ(e.type, c.type);
    EXPECT_EQ(e.param, c.param);
    EXPECT_EQ(e.code, c.code);
    EXPECT_EQ(e.message, c.status.message());
    const google::protobuf::Struct body = ReadJson(ErrorBody(e));
    const auto& error = body.fields().at("error").struct_value().fields();
    EXPECT_EQ(error.at("message").string_value(), std::string(c.status.message()));
    EXPECT_EQ(error.at("type").string_value(), c.type);
    EXPECT_EQ(error.at("param").kind_case(), c.param.empty() ? google::protobuf::Value::kNullValue
                                                             : google::protobuf::Value::kStringValue);
    EXPECT_EQ(error.at("code").kind_case(), c.code.empty() ? google::protobuf::Value::kNullValue
                                                           : google::protobuf::Value::kStringValue);
  }
}

TEST(JsonQuoteTest, EscapesControlsAndNeverEmitsInvalidUtf8) {
  EXPECT_EQ(JsonQuote("a\"b\\c\nd\x01"), "\"a\\\"b\\\\c\\nd\\u0001\"");
  EXPECT_EQ(JsonQuote("caf\xc3\xa9"), "\"caf\xc3\xa9\"");
  EXPECT_EQ(JsonQuote("bad\xff"), "\"bad?\"");
  EXPECT_EQ(ReadJson("{\"k\": " + JsonQuote(std::string("\x00\x1f\x7f\"\\", 5)) + "}").fields().at("k").string_value(),
            std::string("\x00\x1f\x7f\"\\", 5));
}

TEST(ImagesResponseBodyTest, HoldsBase64PngsSeedsAndStats) {
  std::vector<v1::GenerateResponse> images(2);
  for (int i = 0; i < 2; ++i) {
    images[i].set_image(std::string("\x89PNG\r\n\x1a\n", 8) + std::string(1, static_cast<char>(i)));
    images[i].set_width(64);
    images[i].set_height(32);
    images[i].set_seed(7 + i);
    images[i].set_pipeline("tiny");
    images[i].set_request_id("req-" + std::to_string(i));
    images[i].mutable_stats()->set_device("sim:0");
    images[i].mutable_stats()->set_peak_device_memory_bytes(100 * (i + 1));
    images[i].mutable_stats()->set_host_to_device_bytes(10);
    images[i].mutable_stats()->mutable_queue_wait()->set_nanos(500000000 * i);
  }
  const google::protobuf::Struct body = ReadJson(ImagesResponseBody(images, 1700000000));
  EXPECT_EQ(body.fields().at("created").number_value(), 1700000000);
  EXPECT_EQ(body.fields().at("size").string_value(), "64x32");
  EXPECT_EQ(body.fields().at("model").string_value(), "tiny");
  const auto& data = body.fields().at("data").list_value().values();
  ASSERT_EQ(data.size(), 2);
  for (int i = 0; i < 2; ++i) {
    const auto& item = data[i].struct_value().fields();
    std::string png;
    ASSERT_TRUE(absl::Base64Unescape(item.at("b64_json").string_value(), &png));
    EXPECT_EQ(png, images[i].image());
    EXPECT_EQ(item.at("seed").number_value(), 7 + i);
    EXPECT_EQ(item.at("stats").struct_value().fields().at("device").string_value(), "sim:0");
  }
  std::map<std::string, std::string> headers;
  for (const auto& [name, value] : StatsHeaders(images)) headers[name] = value;
  EXPECT_EQ(headers["X-Stowage-Seed"], "7,8");
  EXPECT_EQ(headers["X-Stowage-Request-Id"], "req-0,req-1");
  EXPECT_EQ(headers["X-Stowage-Peak-Device-Memory-Bytes"], "200");  // The largest.
  EXPECT_EQ(headers["X-Stowage-Host-To-Device-Bytes"], "20");       // The sum.
  EXPECT_EQ(headers["X-Stowage-Queue-Wait-Seconds"], "0.500000");
  EXPECT_EQ(headers["X-Stowage-Batch-Size"], "1");
  EXPECT_EQ(headers["X-Stowage-Preempted-Seconds"], "0.000000");
  images[1].mutable_stats()->mutable_preempted_time()->set_seconds(2);
  headers.clear();
  for (const auto& [name, value] : StatsHeaders(images)) headers[name] = value;
  EXPECT_EQ(headers["X-Stowage-Preempted-Seconds"], "2.000000");  // The largest.

  // Members of one batch report the batch's bytes: the request counts each image's share.
  images[0].mutable_stats()->set_batch_size(2);
  images[0].mutable_stats()->set_host_to_device_bytes(30);
  images[1].mutable_stats()->set_batch_size(4);
  images[1].mutable_stats()->set_host_to_device_bytes(40);
  images[1].mutable_stats()->set_device_to_host_bytes(8);
  headers.clear();
  for (const auto& [name, value] : StatsHeaders(images)) headers[name] = value;
  EXPECT_EQ(headers["X-Stowage-Host-To-Device-Bytes"], "25");  // 30 / 2 + 40 / 4.
  EXPECT_EQ(headers["X-Stowage-Device-To-Host-Bytes"], "2");
  EXPECT_EQ(headers["X-Stowage-Batch-Size"], "4");              // The largest.
}

TEST(ModelsBodyTest, ListsEveryPipelineAndFindsOne) {
  v1::ListPipelinesResponse pipelines;
  pipelines.add_pipelines()->set_name("a");
  pipelines.add_pipelines()->set_name("b");
  pipelines.mutable_pipelines(1)->set_state(v1::PIPELINE_LOADING);
  const google::protobuf::Struct list = ReadJson(ModelsBody(pipelines, 5));
  EXPECT_EQ(list.fields().at("object").string_value(), "list");
  const auto& data = list.fields().at("data").list_value().values();
  ASSERT_EQ(data.size(), 2);
  EXPECT_EQ(data[1].struct_value().fields().at("id").string_value(), "b");
  EXPECT_EQ(data[1].struct_value().fields().at("object").string_value(), "model");
  EXPECT_EQ(data[1].struct_value().fields().at("stowage").struct_value().fields().at("state").string_value(),
            "PIPELINE_LOADING");
  ASSERT_TRUE(ModelBody(pipelines, "a", 5).has_value());
  EXPECT_FALSE(ModelBody(pipelines, "c", 5).has_value());
}

}  // namespace
}  // namespace stowage
