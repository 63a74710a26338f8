// The parallel PNG writer: what it writes decodes (libpng, which checks every chunk's CRC and the
// zlib stream's Adler-32) to the pixels it was given, at any size and strip count; the bytes do not
// depend on the thread count; the file is about as small as libpng's at the same settings.
#include "models/core/png_writer.h"

#include <png.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "bench/libpng_level1.h"

namespace stowage {
namespace {

// libpng's simplified API: the RGB pixels of `png`, or a failure naming libpng's message.
::testing::AssertionResult DecodesTo(const std::string& png, int width, int height, const std::vector<uint8_t>& rgb) {
  png_image image{};
  image.version = PNG_IMAGE_VERSION;
  if (!png_image_begin_read_from_memory(&image, png.data(), png.size())) {
    return ::testing::AssertionFailure() << "header: " << image.message;
  }
  if (static_cast<int>(image.width) != width || static_cast<int>(image.height) != height) {
    png_image_free(&image);
    return ::testing::AssertionFailure() << "size " << image.width << "x" << image.height;
  }
  image.format = PNG_FORMAT_RGB;
  std::vector<uint8_t> pixels(PNG_IMAGE_SIZE(image));
  if (!png_image_finish_read(&image, nullptr, pixels.data(), 0, nullptr)) {
    return ::testing::AssertionFailure() << "pixels: " << image.message;
  }
  if (pixels != rgb) return ::testing::AssertionFailure() << "pixels differ";
  return ::testing::AssertionSuccess();
}

std::vector<uint8_t> Noise(int width, int height, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3);
  for (uint8_t& b : rgb) b = static_cast<uint8_t>(rng());
  return rgb;
}

// Smooth gradients with a little noise: what a decoded image looks like to deflate.
std::vector<uint8_t> Smooth(int width, int height) {
  std::mt19937 rng(7);
  std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3);
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      uint8_t* p = &rgb[(static_cast<size_t>(y) * width + x) * 3];
      p[0] = static_cast<uint8_t>(x * 255 / width);
      p[1] = static_cast<uint8_t>(y * 255 / height);
      p[2] = static_cast<uint8_t>((x + y) / 4 + rng() % 3);
    }
  }
  return rgb;
}

TEST(PngWriterTest, DecodesToItsPixelsAtEverySize) {
  // One pixel; one row; one column; a strip and one row more; not a multiple of the strip height;
  // many strips.
  const int sizes[][2] = {{1, 1}, {300, 1}, {1, 200}, {2, kPngStripRows + 1}, {257, 3 * kPngStripRows - 5}, {1024, 1024}};
  for (const auto& size : sizes) {
    const int w = size[0], h = size[1];
    for (const std::vector<uint8_t>& rgb : {Noise(w, h, static_cast<uint32_t>(w * 31 + h)), Smooth(w, h)}) {
      auto png = WriteRgbPng(rgb.data(), w, h);
      ASSERT_TRUE(png.ok()) << png.status();
      EXPECT_TRUE(DecodesTo(*png, w, h, rgb)) << w << "x" << h;
    }
  }
}

TEST(PngWriterTest, TheBytesDoNotDependOnTheThreads) {
  const std::vector<uint8_t> rgb = Noise(640, 480, 3);
  auto one = WriteRgbPng(rgb.data(), 640, 480, 1);
  ASSERT_TRUE(one.ok());
  for (int threads : {2, 3, 8, 64, 0}) {
    auto many = WriteRgbPng(rgb.data(), 640, 480, threads);
    ASSERT_TRUE(many.ok());
    EXPECT_EQ(*many, *one) << threads << " threads";
  }
}

TEST(PngWriterTest, AboutAsSmallAsLibpngAtTheSameSettings) {
  for (const auto& [w, h] : std::vector<std::pair<int, int>>{{1024, 1024}, {512, 768}}) {
    for (const std::vector<uint8_t>& rgb : {Smooth(w, h), Noise(w, h, 9)}) {
      auto ours = WriteRgbPng(rgb.data(), w, h);
      ASSERT_TRUE(ours.ok());
      const std::string reference = LibpngLevel1(rgb, w, h);
      // A strip starts without the previous strip's history: a little larger, never much.
      EXPECT_LE(ours->size(), reference.size() * 102 / 100 + 64) << w << "x" << h;
      EXPECT_GE(ours->size(), reference.size() * 90 / 100) << w << "x" << h;
    }
  }
}

TEST(PngWriterTest, RefusesEmptyAndOversizedImages) {
  const uint8_t pixel[3] = {1, 2, 3};
  EXPECT_EQ(WriteRgbPng(pixel, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteRgbPng(pixel, 1, -1).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(WriteRgbPng(nullptr, 1, 1).status().code(), absl::StatusCode::kInvalidArgument);
  // Checked before any byte is read: no buffer of this size exists.
  auto huge = WriteRgbPng(pixel, 1 << 20, 1 << 12);
  EXPECT_EQ(huge.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(huge.status().message().find("too large"), std::string::npos) << huge.status();
}

}  // namespace
}  // namespace stowage
