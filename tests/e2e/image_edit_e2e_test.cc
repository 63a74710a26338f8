// Images in over gRPC: GenerateRequest.image / mask / strength on Z-Image and Flux (their tiny
// built-ins), the size taken from the image, inpainting that keeps what the mask keeps, and every
// hostile input refused with INVALID_ARGUMENT naming the field while the server keeps serving.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>
#include <zlib.h>

#include "absl/strings/match.h"
#include "models/core/image.h"
#include "tests/e2e/e2e_harness.h"

namespace stowage {
namespace {

std::string Png(int width, int height, int seed) {
  Image image;
  image.width = width;
  image.height = height;
  image.rgb.resize(static_cast<size_t>(width) * height * 3);
  for (size_t i = 0; i < image.rgb.size(); ++i) image.rgb[i] = static_cast<uint8_t>((i * 7 + seed * 31 + i / 97) % 251);
  return *EncodePng(image);
}

// A gray mask PNG (EncodePng writes RGB: the three channels equal).
std::string MaskPng(int width, int height, uint8_t value) {
  Image image;
  image.width = width;
  image.height = height;
  image.rgb.assign(static_cast<size_t>(width) * height * 3, value);
  return *EncodePng(image);
}

// `png` with its header saying width x height (the header's checksum made right again).
std::string WithSize(std::string png, uint32_t width, uint32_t height) {
  for (int k = 0; k < 4; ++k) {
    png[16 + k] = static_cast<char>((width >> (24 - 8 * k)) & 0xff);
    png[20 + k] = static_cast<char>((height >> (24 - 8 * k)) & 0xff);
  }
  const uint32_t crc = crc32(0, reinterpret_cast<const Bytef*>(png.data() + 12), 17);  // "IHDR" and its 13 bytes.
  for (int k = 0; k < 4; ++k) png[29 + k] = static_cast<char>((crc >> (24 - 8 * k)) & 0xff);
  return png;
}

class ImageEditE2ETest : public ::testing::Test {
 protected:
  void SetUp() override {
    v1::ServerConfig config;
    ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(
        R"pb(
          pipelines { name: "z" builtin: "zimage-tiny" }
          pipelines { name: "f" builtin: "flux-tiny" }
          pipelines { name: "t" builtin: "tiny" }
        )pb",
        &config));
    server_ = std::make_unique<E2eServer>(config);
    ASSERT_TRUE(server_->ok());
  }
  v1::GenerateRequest Edit(const std::string& pipeline, const std::string& prompt, double strength) {
    v1::GenerateRequest r;
    r.set_pipeline(pipeline);
    r.set_prompt(prompt);
    r.set_num_inference_steps(4);
    r.set_seed(3);
    r.set_image(Png(80, 64, 1));
    r.set_strength(strength);
    return r;
  }
  std::unique_ptr<E2eServer> server_;
};

TEST_F(ImageEditE2ETest, ImageToImageAndInpaintingOnBothFamilies) {
  v1::ListPipelinesResponse list;
  ASSERT_TRUE(server_->Pipelines(&list).ok());
  for (const auto& p : list.pipelines()) EXPECT_EQ(p.accepts_images(), p.name() != "t") << p.name();
  for (const std::string pipeline : {"z", "f"}) {
    v1::GenerateResponse a, b, other;
    ASSERT_TRUE(server_->Generate(Edit(pipeline, "a red lantern", 0.5), &a).ok()) << pipeline;
    // The size is the image's when the request gives none.
    EXPECT_EQ(a.width(), 80);
    EXPECT_EQ(a.height(), 64);
    std::vector<std::string> stages;
    for (const auto& s : a.stats().stages()) stages.push_back(s.stage());
    // The input image went through the VAE's encoder before denoising (its own stage: "encode_image"
    // is the reply's image into its format, at the end).
    const auto input = std::find(stages.begin(), stages.end(), "encode_input");
    ASSERT_NE(input, stages.end()) << pipeline;
    const auto denoise = std::find(stages.begin(), stages.end(), "denoise");
    ASSERT_NE(denoise, stages.end()) << pipeline;
    EXPECT_LT(input, denoise) << pipeline;
    EXPECT_EQ(std::count(stages.begin(), stages.end(), "encode_image"), 1) << pipeline;
    ASSERT_TRUE(server_->Generate(Edit(pipeline, "a red lantern", 0.5), &b).ok());
    EXPECT_EQ(a.image(), b.image()) << pipeline;  // Deterministic for a seed.
    ASSERT_TRUE(server_->Generate(Edit(pipeline, "a red lantern", 1.0), &other).ok());
    EXPECT_NE(a.image(), other.image()) << pipeline;
    // Inpainting with nothing to repaint returns the input through the VAE, whatever the prompt.
    v1::GenerateRequest keep = Edit(pipeline, "a red lantern", 1.0);
    keep.set_mask(MaskPng(80, 64, 0));
    v1::GenerateRequest keep_other = keep;
    keep_other.set_prompt("a blue boat");
    v1::GenerateResponse k1, k2;
    ASSERT_TRUE(server_->Generate(keep, &k1).ok());
    ASSERT_TRUE(server_->Generate(keep_other, &k2).ok());
    EXPECT_EQ(k1.image(), k2.image()) << pipeline;
    // A larger image is scaled to the asked size.
    v1::GenerateRequest scaled = Edit(pipeline, "a red lantern", 0.6);
    scaled.set_image(Png(200, 150, 2));
    scaled.set_width(64);
    scaled.set_height(64);
    v1::GenerateResponse s;
    ASSERT_TRUE(server_->Generate(scaled, &s).ok());
    EXPECT_EQ(s.width(), 64);
  }
  // Width and height 0: the image's size rounded down to the size multiple (16 for Z-Image).
  v1::GenerateRequest odd = Edit("z", "a red lantern", 0.6);
  odd.set_image(Png(100, 70, 3));
  v1::GenerateResponse o;
  ASSERT_TRUE(server_->Generate(odd, &o).ok());
  EXPECT_EQ(o.width(), 96);
  EXPECT_EQ(o.height(), 64);
}

TEST_F(ImageEditE2ETest, HostileInputsAreRefusedNamingTheFieldAndServingContinues) {
  struct Case {
    std::string what;
    std::function<void(v1::GenerateRequest&)> change;
    std::string message;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const std::string huge = WithSize(Png(16, 16, 4), 65536, 65536);
  const std::vector<Case> cases = {
      {"mask without image", [](v1::GenerateRequest& r) { r.clear_image(); r.clear_strength(); r.set_mask(MaskPng(80, 64, 255)); },
       "mask: a mask needs an image"},
      {"strength without image", [](v1::GenerateRequest& r) { r.clear_image(); }, "strength: only for requests with an image"},
      {"strength 0", [](v1::GenerateRequest& r) { r.set_strength(0); }, "strength is 0"},
      {"strength above 1", [](v1::GenerateRequest& r) { r.set_strength(1.5); }, "strength is 1.5"},
      {"strength NaN", [nan](v1::GenerateRequest& r) { r.set_strength(nan); }, "strength is nan"},
      {"not a PNG", [](v1::GenerateRequest& r) { r.set_image("\xff\xd8\xff\xe0 a jpeg"); }, "image: not a PNG file"},
      {"truncated PNG", [](v1::GenerateRequest& r) { r.set_image(r.image().substr(0, r.image().size() / 2)); },
       "image: corrupt PNG"},
      {"huge PNG", [huge](v1::GenerateRequest& r) { r.set_image(huge); }, "at most 4096 pixels a side"},
      {"corrupt mask", [](v1::GenerateRequest& r) { r.set_mask("\x89PNG\r\n\x1a\n garbage"); }, "mask: corrupt PNG"},
      {"mask of another size", [](v1::GenerateRequest& r) { r.set_mask(MaskPng(32, 64, 255)); },
       "mask is 32x64; the image is 80x64"},
      {"a pipeline without images", [](v1::GenerateRequest& r) { r.set_pipeline("t"); },
       "image: pipeline 't' takes no input image"},
  };
  for (const Case& c : cases) {
    v1::GenerateRequest r = Edit("z", "a red lantern", 0.5);
    c.change(r);
    const grpc::Status status = server_->Generate(r);
    EXPECT_EQ(status.error_code(), grpc::INVALID_ARGUMENT) << c.what << ": " << status.error_message();
    EXPECT_TRUE(absl::StrContains(status.error_message(), c.message)) << c.what << ": " << status.error_message();
  }
  // Every byte of a real PNG flipped in turn: an error or an image, and the server still serves.
  const std::string good = Png(80, 64, 5);
  for (size_t i = 8; i < good.size(); i += 97) {
    v1::GenerateRequest r = Edit("z", "a red lantern", 0.5);
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    r.set_image(bad);
    const grpc::Status status = server_->Generate(r);
    EXPECT_TRUE(status.ok() || status.error_code() == grpc::INVALID_ARGUMENT) << i << ": " << status.error_message();
  }
  EXPECT_TRUE(HealthServing(server_->channel()));
  EXPECT_TRUE(server_->Generate(Edit("z", "a red lantern", 0.5)).ok());
}

}  // namespace
}  // namespace stowage
