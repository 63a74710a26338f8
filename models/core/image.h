// An 8-bit RGB image, its PNG encoding (png_writer.h; libpng for PNG_FAST) and decoding (libpng).
#ifndef STOWAGE_MODELS_CORE_IMAGE_H_
#define STOWAGE_MODELS_CORE_IMAGE_H_

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"

namespace stowage {

struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;  // Row-major, 3 bytes a pixel.
};

// Converts a [3, H, W] or [1, 3, H, W] tensor with values in [-1, 1] to an 8-bit image.
absl::StatusOr<Image> ImageFromTensor(const at::Tensor& chw);

// `fast`: no compression (stored deflate blocks, no filter): a few milliseconds for 1024x1024, a
// file of about width x height x 3 bytes. Otherwise zlib level 1 with the Sub filter, strips of 64
// rows deflated in parallel (png_writer.h: the same bytes on every machine).
absl::StatusOr<std::string> EncodePng(const Image& image, bool fast = false);

// The largest side DecodePng accepts (its pixel buffer is allocated after this check, so a small
// hostile file cannot claim gigabytes).
inline constexpr int kMaxDecodedSide = 4096;

// Decodes any PNG (1 to 16 bits; gray, RGB or palette; with or without alpha or tRNS; interlaced
// or not) to 8-bit RGB. `alpha`, when given, receives width × height alpha bytes, or is cleared
// when the file has no transparency. INVALID_ARGUMENT naming what is wrong: not a PNG, a side over
// `max_side`, a corrupt or truncated file. Never crashes on hostile input.
absl::StatusOr<Image> DecodePng(const std::string& png, std::vector<uint8_t>* alpha = nullptr,
                                int max_side = kMaxDecodedSide);

// `image` scaled to width × height (bilinear, antialiased when shrinking); the image itself when
// the size is already that.
absl::StatusOr<Image> ResizeImage(const Image& image, int width, int height);

// An inpainting mask from a decoded mask file: with `alpha` (non-empty), 255 where alpha < 128
// (transparent: repaint, OpenAI's rule), else 0; without, 255 where the luma (ITU-R 601, as PIL's
// "L" conversion) is >= 128 (white: repaint, diffusers' rule), else 0. width × height bytes.
std::vector<uint8_t> MaskFromImage(const Image& image, const std::vector<uint8_t>& alpha);

// `mask` (width × height bytes) scaled to new_width × new_height by nearest neighbour.
std::vector<uint8_t> ResizeMask(const std::vector<uint8_t>& mask, int width, int height, int new_width,
                                int new_height);

// [1, 3, H, W] float32 in [-1, 1] (2 · byte / 255 − 1), as diffusers' VaeImageProcessor prepares an
// image for the VAE encoder; on the CPU.
at::Tensor ImageToTensor(const Image& image);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_IMAGE_H_
