#include "runtime/image_request.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "models/core/image.h"

namespace stowage {
namespace {

absl::Status Named(const char* field, const absl::Status& status) {
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", status.message()));
}

// The image's size scaled down (keeping its aspect) to fit max_size, rounded down to the multiple,
// at least min_size.
void SizeFromImage(const Image& image, const PipelineLimits& limits, int* width, int* height) {
  const double scale = std::min(1.0, static_cast<double>(limits.max_size) / std::max(image.width, image.height));
  auto fit = [&](int side) {
    const int scaled = static_cast<int>(side * scale);
    return std::max(limits.min_size, scaled / limits.size_multiple * limits.size_multiple);
  };
  *width = fit(image.width);
  *height = fit(image.height);
}

}  // namespace

absl::Status ApplyImageInput(const v1::GenerateRequest& request, const PipelineLimits& limits,
                             const std::string& pipeline_name, GenerationParams* params) {
  if (request.image().empty()) {
    if (!request.mask().empty()) return absl::InvalidArgumentError("mask: a mask needs an image to inpaint");
    if (request.has_strength()) return absl::InvalidArgumentError("strength: only for requests with an image");
    return absl::OkStatus();
  }
  if (!limits.accepts_images) {
    return absl::InvalidArgumentError(absl::StrCat("image: pipeline '", pipeline_name,
                                                   "' takes no input image (image-to-image and inpainting run on "
                                                   "Z-Image and Flux pipelines)"));
  }
  auto input = std::make_shared<ImageInput>();
  absl::StatusOr<Image> image = DecodePng(request.image());
  if (!image.ok()) return Named("image", image.status());
  std::vector<uint8_t> mask;
  if (!request.mask().empty()) {
    std::vector<uint8_t> alpha;
    absl::StatusOr<Image> mask_image = DecodePng(request.mask(), &alpha);
    if (!mask_image.ok()) return Named("mask", mask_image.status());
    if (mask_image->width != image->width || mask_image->height != image->height) {
      return absl::InvalidArgumentError(absl::StrCat("mask is ", mask_image->width, "x", mask_image->height,
                                                     "; the image is ", image->width, "x", image->height,
                                                     ": they must be the same size"));
    }
    mask = MaskFromImage(*mask_image, alpha);
  }
  if (request.width() == 0 && request.height() == 0) SizeFromImage(*image, limits, &params->width, &params->height);
  if (request.has_strength()) {
    const double s = request.strength();
    if (!std::isfinite(s) || s <= 0.0 || s > 1.0) {
      return absl::InvalidArgumentError(absl::StrFormat("strength is %g; allowed: above 0, at most 1", s));
    }
    params->strength = s;
  } else {
    params->strength = mask.empty() ? kDefaultImageStrength : kDefaultInpaintStrength;
  }
  ASSIGN_OR_RETURN(input->image, ResizeImage(*image, params->width, params->height));
  if (!mask.empty()) {
    input->mask = ResizeMask(mask, image->width, image->height, params->width, params->height);
  }
  params->input = std::move(input);
  return absl::OkStatus();
}

}  // namespace stowage
