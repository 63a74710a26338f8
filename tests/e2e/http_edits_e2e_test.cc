// POST /v1/images/edits over real HTTP on loopback: multipart/form-data bodies as OpenAI's
// images.edit sends them (the image and mask as file parts, the other fields as text), read by
// libmicrohttpd's form parser; the same images as the gRPC request with those fields; streaming
// with image_edit.* events; and hostile forms refused with a 4xx naming what was wrong while the
// server keeps serving.
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "models/core/image.h"
#include "tests/e2e/http_client.h"

namespace stowage {
namespace {

std::string Png(int width, int height, int seed, bool flat = false) {
  Image image;
  image.width = width;
  image.height = height;
  image.rgb.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < image.rgb.size(); ++i) {
    image.rgb[i] = flat ? static_cast<uint8_t>(seed) : static_cast<uint8_t>((i * 7 + seed * 31 + i / 97) % 251);
  }
  return *EncodePng(image);
}

struct Part {
  std::string name;
  std::string value;
  std::string filename;  // Non-empty: a file part.
};

constexpr char kBoundary[] = "stowage-test-boundary-7f3a";

std::string Form(const std::vector<Part>& parts) {
  std::string body;
  for (const Part& p : parts) {
    absl::StrAppend(&body, "--", kBoundary, "\r\nContent-Disposition: form-data; name=\"", p.name, "\"");
    if (!p.filename.empty()) {
      absl::StrAppend(&body, "; filename=\"", p.filename, "\"\r\nContent-Type: image/png");
    }
    absl::StrAppend(&body, "\r\n\r\n", p.value, "\r\n");
  }
  absl::StrAppend(&body, "--", kBoundary, "--\r\n");
  return body;
}

HttpResponse PostForm(const std::string& address, const std::string& body,
                      const std::string& type = absl::StrCat("multipart/form-data; boundary=", kBoundary)) {
  return Exchange(address, absl::StrCat("POST /v1/images/edits HTTP/1.1\r\nHost: localhost\r\nContent-Type: ", type,
                                        "\r\nContent-Length: ", body.size(), "\r\n\r\n", body));
}

std::vector<Part> EditParts(const std::string& image) {
  return {{"image", image, "in.png"}, {"prompt", "a red lantern", ""}, {"model", "zimage-tiny", ""},
          {"num_inference_steps", "4", ""}, {"seed", "3", ""}, {"strength", "0.5", ""}};
}

std::string ImageOf(const HttpResponse& r) {
  const google::protobuf::Struct body = Json(r.body);
  const auto& data = body.fields().at("data").list_value();
  std::string png;
  EXPECT_TRUE(absl::Base64Unescape(data.values(0).struct_value().fields().at("b64_json").string_value(), &png));
  return png;
}

TEST_F(HttpTest, EditsTakeTheFormOpenAiSendsAndDrawWhatGrpcDraws) {
  Start();
  const std::string input = Png(80, 64, 1);
  const HttpResponse r = PostForm(http_, Form(EditParts(input)));
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 400);
  EXPECT_EQ(Field(Json(r.body), "size"), "80x64");  // The image's size.
  // The same request over gRPC gives the same PNG.
  v1::GenerateRequest same;
  same.set_prompt("a red lantern");
  same.set_pipeline("zimage-tiny");
  same.set_num_inference_steps(4);
  same.set_seed(3);
  same.set_strength(0.5);
  same.set_image(input);
  v1::GenerateResponse grpc_response;
  ASSERT_TRUE(server_->Generate(same, &grpc_response).ok());
  EXPECT_EQ(ImageOf(r), grpc_response.image());
  // With a mask that keeps everything, the prompt does not matter; "image[]" names the image too.
  std::vector<Part> keep = EditParts(input);
  keep[0].name = "image[]";
  keep.push_back({"mask", Png(80, 64, 0, /*flat=*/true), "mask.png"});
  keep.push_back({"size", "80x64", ""});
  keep.push_back({"n", "2", ""});
  const HttpResponse k1 = PostForm(http_, Form(keep));
  keep[1].value = "a blue boat";
  const HttpResponse k2 = PostForm(http_, Form(keep));
  ASSERT_EQ(k1.status, 200) << k1.body.substr(0, 400);
  ASSERT_EQ(k2.status, 200);
  EXPECT_EQ(ImageOf(k1), ImageOf(k2));
  EXPECT_EQ(Json(k1.body).fields().at("data").list_value().values_size(), 2);
  ExpectHealthy();
}

TEST_F(HttpTest, EditsStreamImageEditEvents) {
  Start();
  std::vector<Part> parts = EditParts(Png(64, 64, 2));
  parts.push_back({"stream", "true", ""});
  parts.push_back({"partial_images", "1", ""});
  const HttpResponse r = PostForm(http_, Form(parts));
  ASSERT_EQ(r.status, 200) << r.body.substr(0, 400);
  EXPECT_TRUE(absl::StrContains(r.body, "event: image_edit.partial_image")) << r.body.substr(0, 400);
  EXPECT_TRUE(absl::StrContains(r.body, "event: image_edit.completed"));
  EXPECT_FALSE(absl::StrContains(r.body, "image_generation."));
  // Progress counts the steps that run: 2 of the 4 at strength 0.5.
  EXPECT_TRUE(absl::StrContains(r.body, "\"total_steps\":2")) << r.body.substr(0, 600);
}

TEST_F(HttpTest, HostileEditFormsGetA4xxNamingWhatIsWrong) {
  v1::ServerConfig config;
  ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true }
    pipelines { name: "tiny" builtin: "tiny" })pb", &config));
  Start(config);
  const std::string png = Png(64, 64, 3);
  struct Case {
    std::string what;
    std::string body;
    std::string type;
    int status;
    std::string message;
  };
  std::vector<Part> two_images = EditParts(png);
  two_images.push_back({"image", png, "b.png"});
  std::vector<Part> twice = EditParts(png);
  twice.push_back({"prompt", "again", ""});
  std::vector<Part> no_image = EditParts(png);
  no_image.erase(no_image.begin());
  std::vector<Part> bad_n = EditParts(png);
  bad_n.push_back({"n", "two", ""});
  std::vector<Part> bad_strength = EditParts(png);
  bad_strength[5].value = "1.5";
  std::vector<Part> nan_strength = EditParts(png);
  nan_strength[5].value = "nan";
  std::vector<Part> unknown = EditParts(png);
  unknown.push_back({"colour", "red", ""});
  std::vector<Part> bad_stream = EditParts(png);
  bad_stream.push_back({"stream", "yes", ""});
  std::vector<Part> bad_loras = EditParts(png);
  bad_loras.push_back({"loras", "[{name: x}", ""});
  std::vector<Part> not_png = EditParts("GIF89a....");
  std::vector<Part> bad_mask = EditParts(png);
  bad_mask.push_back({"mask", Png(32, 32, 1), "m.png"});
  std::vector<Part> on_demo = EditParts(png);
  on_demo[2].value = "tiny";
  std::string many;
  for (int i = 0; i < 80; ++i) many += absl::StrCat("--", kBoundary, "\r\nContent-Disposition: form-data; name=\"f", i, "\"\r\n\r\nx\r\n");
  many += absl::StrCat("--", kBoundary, "--\r\n");
  const std::string form_type = absl::StrCat("multipart/form-data; boundary=", kBoundary);
  const std::vector<Case> cases = {
      {"JSON body", R"({"prompt": "x"})", "application/json", 400, "send multipart/form-data"},
      {"no boundary", Form(EditParts(png)), "multipart/form-data", 400, "multipart/form-data"},
      {"cut off form", Form(EditParts(png)).substr(0, 200), form_type, 400, ""},
      {"two images", Form(two_images), form_type, 400, "one input image per request"},
      {"a field twice", Form(twice), form_type, 400, "given more than once"},
      {"no image", Form(no_image), form_type, 400, "image is required"},
      {"n not a number", Form(bad_n), form_type, 400, "n must be an integer"},
      {"strength out of range", Form(bad_strength), form_type, 400, "strength must be a number above 0"},
      {"strength nan", Form(nan_strength), form_type, 400, "strength must be a finite number"},
      {"unknown field", Form(unknown), form_type, 400, "unrecognized request argument"},
      {"stream not a boolean", Form(bad_stream), form_type, 400, "stream must be true or false"},
      {"loras not JSON", Form(bad_loras), form_type, 400, "loras must be a JSON array"},
      {"not a PNG", Form(not_png), form_type, 400, "not a PNG file"},
      {"mask of another size", Form(bad_mask), form_type, 400, "mask is 32x32; the image is 64x64"},
      {"a pipeline without images", Form(on_demo), form_type, 400, "takes no input image"},
      {"80 parts", many, form_type, 400, "more than 64 parts"},
  };
  for (const Case& c : cases) {
    const HttpResponse r = PostForm(http_, c.body, c.type);
    EXPECT_EQ(r.status, c.status) << c.what << ": " << r.body.substr(0, 300);
    if (r.status >= 400) {
      const google::protobuf::Struct error = ErrorOf(r);
      EXPECT_TRUE(absl::StrContains(Field(error, "message"), c.message)) << c.what << ": " << r.body.substr(0, 300);
    }
  }
  // GET on the path: 405 naming POST.
  const HttpResponse get = Get(http_, "/v1/images/edits");
  EXPECT_EQ(get.status, 405);
  ExpectHealthy();
}

}  // namespace
}  // namespace stowage
