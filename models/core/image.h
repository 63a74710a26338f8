// An 8-bit RGB image and its PNG encoding (libpng).
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
// file of about width x height x 3 bytes. Otherwise zlib level 1 with the Sub filter.
absl::StatusOr<std::string> EncodePng(const Image& image, bool fast = false);

// Decodes a PNG written by EncodePng (8-bit RGB); used by tests and clients to check replies.
absl::StatusOr<Image> DecodePng(const std::string& png);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_IMAGE_H_
