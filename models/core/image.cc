#include "models/core/image.h"

#include <png.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "models/core/png_writer.h"

namespace stowage {

absl::StatusOr<Image> ImageFromTensor(const at::Tensor& input) {
  at::Tensor t = input;
  if (t.dim() == 4 && t.size(0) == 1) t = t.squeeze(0);
  if (t.dim() != 3 || t.size(0) != 3) {
    return absl::InvalidArgumentError(absl::StrCat("expected a [3, H, W] image tensor, got ",
                                                   t.dim(), " dimensions"));
  }
  // Quantised where the tensor is (on a GPU: a few microseconds), then 1 byte per value copied.
  const at::Tensor bytes = ((t.to(at::kFloat).clamp(-1.0, 1.0) + 1.0) * 127.5)
                               .round()
                               .to(at::kByte)
                               .permute({1, 2, 0})
                               .contiguous()
                               .to(at::kCPU);
  Image image;
  image.height = static_cast<int>(bytes.size(0));
  image.width = static_cast<int>(bytes.size(1));
  image.rgb.resize(static_cast<size_t>(bytes.numel()));
  std::memcpy(image.rgb.data(), bytes.data_ptr<uint8_t>(), image.rgb.size());
  return image;
}

namespace {

void AppendToString(png_structp png, png_bytep data, png_size_t length) {
  auto* out = static_cast<std::string*>(png_get_io_ptr(png));
  out->append(reinterpret_cast<const char*>(data), length);
}

struct ReadCursor {
  const std::string* data;
  size_t offset;
};

void ReadFromString(png_structp png, png_bytep data, png_size_t length) {
  auto* cursor = static_cast<ReadCursor*>(png_get_io_ptr(png));
  if (cursor->offset + length > cursor->data->size()) png_error(png, "truncated PNG");
  std::memcpy(data, cursor->data->data() + cursor->offset, length);
  cursor->offset += length;
}

}  // namespace

namespace {

// Everything a decode writes lives here, on the heap, so a libpng error (a longjmp back into
// DecodePng) leaves no half-updated local behind.
struct PngDecode {
  png_structp png = nullptr;
  png_infop info = nullptr;
  ReadCursor cursor;
  std::string error;
  std::vector<uint8_t> rgba;
  std::vector<png_bytep> rows;
  uint32_t width = 0, height = 0;
  bool has_alpha = false;
  ~PngDecode() {
    if (png != nullptr) png_destroy_read_struct(&png, info != nullptr ? &info : nullptr, nullptr);
  }
};

void PngErrorToString(png_structp png, png_const_charp message) {
  auto* state = static_cast<PngDecode*>(png_get_error_ptr(png));
  state->error = message != nullptr ? message : "unknown error";
  png_longjmp(png, 1);
}

void PngWarningIgnored(png_structp, png_const_charp) {}

}  // namespace

absl::StatusOr<Image> DecodePng(const std::string& data, std::vector<uint8_t>* alpha, int max_side) {
  if (data.size() < 8 || png_sig_cmp(reinterpret_cast<png_const_bytep>(data.data()), 0, 8) != 0) {
    return absl::InvalidArgumentError("not a PNG file (only PNG images are accepted)");
  }
  auto state = std::make_unique<PngDecode>();
  PngDecode* const s = state.get();
  s->cursor = ReadCursor{&data, 0};
  s->png = png_create_read_struct(PNG_LIBPNG_VER_STRING, s, PngErrorToString, PngWarningIgnored);
  if (s->png == nullptr) return absl::InternalError("png_create_read_struct failed");
  s->info = png_create_info_struct(s->png);
  if (s->info == nullptr) return absl::InternalError("png_create_info_struct failed");
  if (setjmp(png_jmpbuf(s->png))) {
    return absl::InvalidArgumentError(absl::StrCat("corrupt PNG: ", s->error));
  }
  png_set_read_fn(s->png, &s->cursor, ReadFromString);
  png_set_chunk_malloc_max(s->png, 8 << 20);  // Ancillary chunks (text, ICC) cannot claim more.
  png_read_info(s->png, s->info);
  s->width = png_get_image_width(s->png, s->info);
  s->height = png_get_image_height(s->png, s->info);
  if (s->width == 0 || s->height == 0 || s->width > static_cast<uint32_t>(max_side) ||
      s->height > static_cast<uint32_t>(max_side)) {
    return absl::InvalidArgumentError(absl::StrCat("PNG is ", s->width, "x", s->height, "; at most ", max_side,
                                                   " pixels a side"));
  }
  const int color = png_get_color_type(s->png, s->info);
  s->has_alpha = (color & PNG_COLOR_MASK_ALPHA) != 0 || png_get_valid(s->png, s->info, PNG_INFO_tRNS) != 0;
  // Every layout to 8-bit RGBA: palettes and low-depth gray expanded, tRNS to alpha, 16 bits
  // stripped, gray to RGB, an opaque alpha added where there is none.
  png_set_expand(s->png);
  png_set_strip_16(s->png);
  png_set_gray_to_rgb(s->png);
  png_set_add_alpha(s->png, 0xff, PNG_FILLER_AFTER);
  png_set_interlace_handling(s->png);
  png_read_update_info(s->png, s->info);
  if (png_get_rowbytes(s->png, s->info) != static_cast<size_t>(s->width) * 4) {
    return absl::InvalidArgumentError("PNG layout could not be converted to RGBA");
  }
  s->rgba.resize(static_cast<size_t>(s->width) * s->height * 4);
  s->rows.resize(s->height);
  for (uint32_t y = 0; y < s->height; ++y) s->rows[y] = s->rgba.data() + static_cast<size_t>(y) * s->width * 4;
  png_read_image(s->png, s->rows.data());
  png_read_end(s->png, nullptr);
  Image image;
  image.width = static_cast<int>(s->width);
  image.height = static_cast<int>(s->height);
  const size_t pixels = static_cast<size_t>(s->width) * s->height;
  image.rgb.resize(pixels * 3);
  if (alpha != nullptr) alpha->assign(s->has_alpha ? pixels : 0, 0);
  for (size_t i = 0; i < pixels; ++i) {
    std::memcpy(&image.rgb[i * 3], &s->rgba[i * 4], 3);
    if (alpha != nullptr && s->has_alpha) (*alpha)[i] = s->rgba[i * 4 + 3];
  }
  return image;
}

absl::StatusOr<Image> ResizeImage(const Image& image, int width, int height) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<size_t>(image.width) * image.height * 3) {
    return absl::InvalidArgumentError("image buffer does not match its dimensions");
  }
  if (width <= 0 || height <= 0) return absl::InvalidArgumentError("resize to an empty size");
  if (width == image.width && height == image.height) return image;
  const at::Tensor in = at::from_blob(const_cast<uint8_t*>(image.rgb.data()), {1, image.height, image.width, 3}, at::kByte)
                            .permute({0, 3, 1, 2})
                            .to(at::kFloat);
  const bool shrink = width < image.width || height < image.height;
  const at::Tensor out =
      shrink ? at::_upsample_bilinear2d_aa(in, {height, width}, /*align_corners=*/false, c10::nullopt, c10::nullopt)
             : at::upsample_bilinear2d(in, {height, width}, /*align_corners=*/false, c10::nullopt, c10::nullopt);
  const at::Tensor bytes = out.round().clamp(0, 255).to(at::kByte).permute({0, 2, 3, 1}).contiguous();
  Image resized;
  resized.width = width;
  resized.height = height;
  resized.rgb.assign(bytes.data_ptr<uint8_t>(), bytes.data_ptr<uint8_t>() + bytes.numel());
  return resized;
}

std::vector<uint8_t> MaskFromImage(const Image& image, const std::vector<uint8_t>& alpha) {
  const size_t pixels = static_cast<size_t>(image.width) * image.height;
  std::vector<uint8_t> mask(pixels, 0);
  for (size_t i = 0; i < pixels; ++i) {
    if (!alpha.empty()) {
      mask[i] = alpha[i] < 128 ? 255 : 0;
    } else {
      const uint32_t r = image.rgb[i * 3], g = image.rgb[i * 3 + 1], b = image.rgb[i * 3 + 2];
      const uint32_t luma = (r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16;  // PIL's "L".
      mask[i] = luma >= 128 ? 255 : 0;
    }
  }
  return mask;
}

std::vector<uint8_t> ResizeMask(const std::vector<uint8_t>& mask, int width, int height, int new_width,
                                int new_height) {
  std::vector<uint8_t> out(static_cast<size_t>(new_width) * new_height);
  for (int y = 0; y < new_height; ++y) {
    // PyTorch's "nearest": source index floor(dst · in / out).
    const int sy = std::min(height - 1, static_cast<int>(static_cast<int64_t>(y) * height / new_height));
    for (int x = 0; x < new_width; ++x) {
      const int sx = std::min(width - 1, static_cast<int>(static_cast<int64_t>(x) * width / new_width));
      out[static_cast<size_t>(y) * new_width + x] = mask[static_cast<size_t>(sy) * width + sx];
    }
  }
  return out;
}

at::Tensor ImageToTensor(const Image& image) {
  const at::Tensor bytes =
      at::from_blob(const_cast<uint8_t*>(image.rgb.data()), {1, image.height, image.width, 3}, at::kByte);
  const at::Tensor unit = bytes.permute({0, 3, 1, 2}).to(at::kFloat) / 255.0f;
  return (2.0f * unit - 1.0f).contiguous();
}

absl::StatusOr<std::string> EncodePng(const Image& image, bool fast) {
  if (image.width <= 0 || image.height <= 0 ||
      image.rgb.size() != static_cast<size_t>(image.width) * image.height * 3) {
    return absl::InvalidArgumentError("image buffer does not match its dimensions");
  }
  // zlib level 1 with the Sub filter, its strips deflated in parallel (png_writer.h): a 1024x1024
  // image several times faster than libpng's defaults (level 6, adaptive filters), for files some
  // 10-30 % larger.
  if (!fast) return WriteRgbPng(image.rgb.data(), image.width, image.height);
  // `fast`: level 0 (stored) and no filter, for clients that value latency over bytes.
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  if (png == nullptr) return absl::InternalError("png_create_write_struct failed");
  png_infop info = png_create_info_struct(png);
  std::string out;
  std::vector<png_bytep> rows(static_cast<size_t>(image.height));
  if (setjmp(png_jmpbuf(png))) {
    png_destroy_write_struct(&png, &info);
    return absl::InternalError("PNG encoding failed");
  }
  png_set_write_fn(png, &out, AppendToString, nullptr);
  png_set_IHDR(png, info, image.width, image.height, 8, PNG_COLOR_TYPE_RGB, PNG_INTERLACE_NONE,
               PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  png_set_compression_level(png, 0);
  png_set_filter(png, PNG_FILTER_TYPE_BASE, PNG_FILTER_NONE);
  png_write_info(png, info);
  for (int y = 0; y < image.height; ++y) {
    rows[y] = const_cast<png_bytep>(image.rgb.data() + static_cast<size_t>(y) * image.width * 3);
  }
  png_write_image(png, rows.data());
  png_write_end(png, nullptr);
  png_destroy_write_struct(&png, &info);
  return out;
}

}  // namespace stowage
