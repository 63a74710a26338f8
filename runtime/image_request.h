// The input image of an image-to-image or inpainting request (GenerateRequest.image, mask,
// strength) checked and brought to the request's size: the transport-free rule both fronts share.
#ifndef STOWAGE_RUNTIME_IMAGE_REQUEST_H_
#define STOWAGE_RUNTIME_IMAGE_REQUEST_H_

#include <string>

#include "absl/status/status.h"
#include "models/pipelines/pipeline.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// Strength when a request gives none: diffusers' img2img default, and its inpainting one.
inline constexpr double kDefaultImageStrength = 0.6;
inline constexpr double kDefaultInpaintStrength = 1.0;

// With an image in `request`: decodes it (and the mask), sets params->input (resized to
// params->width × height; when the request gave neither width nor height, these become the
// image's size scaled down to fit `limits`.max_size and rounded down to size_multiple) and
// params->strength. Without one: OK and nothing changes, unless a mask or strength is given (then
// INVALID_ARGUMENT: they need an image). INVALID_ARGUMENT naming the field for a pipeline that
// takes no images, a file that is not a PNG or is corrupt or too large, a mask of another size than
// the image, a strength outside (0, 1]. Runs on the caller's thread (decoding a 1024² PNG: ~10 ms).
absl::Status ApplyImageInput(const v1::GenerateRequest& request, const PipelineLimits& limits,
                             const std::string& pipeline_name, GenerationParams* params);

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_IMAGE_REQUEST_H_
