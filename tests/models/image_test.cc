// PNG decoding of what clients send (any layout libpng reads, bounded, never crashing on hostile
// bytes), resizing, and inpainting masks.
#include "models/core/image.h"

#include <png.h>
#include <zlib.h>

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace stowage {
namespace {

void Append(png_structp png, png_bytep data, png_size_t length) {
  static_cast<std::string*>(png_get_io_ptr(png))->append(reinterpret_cast<const char*>(data), length);
}

// A PNG of `color_type` / `bit_depth` whose rows are `rows` (already in that layout); `palette`
// for PNG_COLOR_TYPE_PALETTE; `interlace` Adam7.
std::string WritePng(int width, int height, int color_type, int bit_depth, const std::vector<std::vector<uint8_t>>& rows,
                     const std::vector<png_color>& palette = {}, bool interlace = false) {
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  std::string out;
  png_set_write_fn(png, &out, Append, nullptr);
  png_set_IHDR(png, info, width, height, bit_depth, color_type, interlace ? PNG_INTERLACE_ADAM7 : PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  if (!palette.empty()) png_set_PLTE(png, info, palette.data(), static_cast<int>(palette.size()));
  png_write_info(png, info);
  std::vector<png_bytep> pointers;
  for (const auto& row : rows) pointers.push_back(const_cast<png_bytep>(row.data()));
  png_write_image(png, pointers.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

TEST(ImageTest, DecodesEveryCommonLayoutToRgbAndAlpha) {
  // Gray 8-bit: each value on all three channels, no alpha.
  std::vector<uint8_t> alpha = {1};
  auto gray = DecodePng(WritePng(2, 1, PNG_COLOR_TYPE_GRAY, 8, {{10, 200}}), &alpha);
  ASSERT_TRUE(gray.ok()) << gray.status();
  EXPECT_EQ(gray->rgb, (std::vector<uint8_t>{10, 10, 10, 200, 200, 200}));
  EXPECT_TRUE(alpha.empty());
  // RGBA: the colour and the alpha apart.
  auto rgba = DecodePng(WritePng(2, 1, PNG_COLOR_TYPE_RGBA, 8, {{1, 2, 3, 0, 4, 5, 6, 255}}), &alpha);
  ASSERT_TRUE(rgba.ok());
  EXPECT_EQ(rgba->rgb, (std::vector<uint8_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(alpha, (std::vector<uint8_t>{0, 255}));
  // Gray + alpha.
  auto gray_alpha = DecodePng(WritePng(1, 1, PNG_COLOR_TYPE_GRAY_ALPHA, 8, {{7, 9}}), &alpha);
  ASSERT_TRUE(gray_alpha.ok());
  EXPECT_EQ(gray_alpha->rgb, (std::vector<uint8_t>{7, 7, 7}));
  EXPECT_EQ(alpha, (std::vector<uint8_t>{9}));
  // A palette: indices to colours.
  auto indexed = DecodePng(WritePng(2, 1, PNG_COLOR_TYPE_PALETTE, 8, {{1, 0}}, {{10, 20, 30}, {40, 50, 60}}), &alpha);
  ASSERT_TRUE(indexed.ok()) << indexed.status();
  EXPECT_EQ(indexed->rgb, (std::vector<uint8_t>{40, 50, 60, 10, 20, 30}));
  // 16-bit RGB: the high bytes.
  auto deep = DecodePng(WritePng(1, 1, PNG_COLOR_TYPE_RGB, 16, {{0x12, 0x34, 0x56, 0x78, 0x9a, 0xbc}}));
  ASSERT_TRUE(deep.ok());
  EXPECT_EQ(deep->rgb, (std::vector<uint8_t>{0x12, 0x56, 0x9a}));
  // Interlaced (Adam7) RGB reads the same pixels.
  std::vector<std::vector<uint8_t>> rows;
  for (int y = 0; y < 9; ++y) {
    std::vector<uint8_t> row;
    for (int x = 0; x < 9; ++x) row.insert(row.end(), {uint8_t(x * 20), uint8_t(y * 20), uint8_t(x + y)});
    rows.push_back(row);
  }
  auto plain = DecodePng(WritePng(9, 9, PNG_COLOR_TYPE_RGB, 8, rows));
  auto adam7 = DecodePng(WritePng(9, 9, PNG_COLOR_TYPE_RGB, 8, rows, {}, true));
  ASSERT_TRUE(plain.ok() && adam7.ok());
  EXPECT_EQ(plain->rgb, adam7->rgb);
  EXPECT_EQ(plain->rgb[3 * (9 * 2 + 4)], 80);
}

TEST(ImageTest, HostileFilesGetAClearErrorAndNoCrash) {
  const std::string good = WritePng(4, 4, PNG_COLOR_TYPE_RGB, 8, std::vector<std::vector<uint8_t>>(4, std::vector<uint8_t>(12, 9)));
  auto invalid = [](const absl::StatusOr<Image>& r) { return r.status().code() == absl::StatusCode::kInvalidArgument; };
  EXPECT_TRUE(invalid(DecodePng("")));
  EXPECT_TRUE(invalid(DecodePng("GIF89a not a png")));
  EXPECT_NE(std::string(DecodePng("\xff\xd8\xff\xe0 jpeg").status().message()).find("not a PNG"), std::string::npos);
  // Every truncation of a real file.
  for (size_t n = 0; n < good.size(); ++n) EXPECT_TRUE(invalid(DecodePng(good.substr(0, n)))) << n;
  // Flipped bytes anywhere: an error or an image, never a crash.
  for (size_t i = 8; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x5a);
    auto r = DecodePng(bad);
    EXPECT_TRUE(r.ok() || invalid(r)) << i;
  }
  // A header claiming 100000 x 100000 pixels is refused before anything is allocated.
  std::string huge = good;
  const uint32_t side = 100000;
  for (int k = 0; k < 4; ++k) {
    huge[16 + k] = static_cast<char>((side >> (24 - 8 * k)) & 0xff);
    huge[20 + k] = static_cast<char>((side >> (24 - 8 * k)) & 0xff);
  }
  const uint32_t crc = crc32(0, reinterpret_cast<const Bytef*>(huge.data() + 12), 17);  // Its header's checksum.
  for (int k = 0; k < 4; ++k) huge[29 + k] = static_cast<char>((crc >> (24 - 8 * k)) & 0xff);
  auto r = DecodePng(huge);
  EXPECT_TRUE(invalid(r));
  EXPECT_NE(std::string(r.status().message()).find("100000x100000"), std::string::npos) << r.status();
  // A side over the limit with a valid file.
  auto limited = DecodePng(good, nullptr, /*max_side=*/3);
  EXPECT_TRUE(invalid(limited));
  EXPECT_NE(std::string(limited.status().message()).find("at most 3 pixels a side"), std::string::npos)
      << limited.status();
}

TEST(ImageTest, MasksFollowOpenAisAlphaRuleOrDiffusersLumaRule) {
  Image image;
  image.width = 4;
  image.height = 1;
  image.rgb = {0, 0, 0, 255, 255, 255, 127, 127, 127, 128, 128, 128};
  // Without alpha: light repaints (luma >= 128).
  EXPECT_EQ(MaskFromImage(image, {}), (std::vector<uint8_t>{0, 255, 0, 255}));
  // With alpha: transparent repaints (alpha < 128), whatever the colour.
  EXPECT_EQ(MaskFromImage(image, {0, 255, 127, 128}), (std::vector<uint8_t>{255, 0, 255, 0}));
  // Nearest-neighbour scaling, as PyTorch's "nearest".
  EXPECT_EQ(ResizeMask({1, 2, 3, 4}, 2, 2, 4, 2), (std::vector<uint8_t>{1, 1, 2, 2, 3, 3, 4, 4}));
  EXPECT_EQ(ResizeMask({1, 2, 3, 4, 5, 6, 7, 8}, 4, 2, 2, 1), (std::vector<uint8_t>{1, 3}));
}

TEST(ImageTest, ResizeKeepsAFlatImageFlatAndTheSizeItWasAsked) {
  Image image;
  image.width = 10;
  image.height = 6;
  image.rgb.assign(10 * 6 * 3, 77);
  for (auto [w, h] : std::vector<std::pair<int, int>>{{5, 3}, {20, 12}, {7, 9}, {10, 6}}) {
    auto resized = ResizeImage(image, w, h);
    ASSERT_TRUE(resized.ok()) << resized.status();
    EXPECT_EQ(resized->width, w);
    EXPECT_EQ(resized->height, h);
    EXPECT_EQ(resized->rgb, std::vector<uint8_t>(static_cast<size_t>(w) * h * 3, 77));
  }
  EXPECT_FALSE(ResizeImage(image, 0, 4).ok());
  // [-1, 1] as diffusers' processor: 0 → -1, 255 → 1.
  image.rgb[0] = 0;
  image.rgb[1] = 255;
  const at::Tensor t = ImageToTensor(image);
  EXPECT_EQ(t.sizes(), (at::IntArrayRef{1, 3, 6, 10}));
  EXPECT_FLOAT_EQ(t[0][0][0][0].item<float>(), -1.0f);
  EXPECT_FLOAT_EQ(t[0][1][0][0].item<float>(), 1.0f);
}

}  // namespace
}  // namespace stowage
