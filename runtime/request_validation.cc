#include "runtime/request_validation.h"

#include <cmath>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "runtime/config.h"
#include "runtime/image_request.h"
#include "runtime/scheduler.h"

namespace stowage {
namespace {

absl::Status CheckSize(const char* field, int value, const PipelineLimits& limits) {
  if (value < limits.min_size || value > limits.max_size || value % limits.size_multiple != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is ", value, "; allowed: ", limits.min_size, " to ", limits.max_size,
        " in multiples of ", limits.size_multiple, ", or 0 for the default"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<GenerationParams> ValidateRequest(const v1::GenerateRequest& request, const Pipeline& pipeline,
                                                 const AdapterTable& adapters, bool split) {
  const PipelineLimits& limits = pipeline.limits();
  GenerationParams params;
  if (request.prompt().empty()) return absl::InvalidArgumentError("prompt is required");
  if (static_cast<int>(request.prompt().size()) > limits.max_prompt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("prompt is ", request.prompt().size(),
                                                   " bytes; at most ", limits.max_prompt_bytes,
                                                   " bytes allowed by pipeline '", pipeline.name(), "'"));
  }
  if (static_cast<int>(request.negative_prompt().size()) > limits.max_prompt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("negative_prompt is ", request.negative_prompt().size(),
                                                   " bytes; at most ", limits.max_prompt_bytes,
                                                   " bytes allowed by pipeline '", pipeline.name(), "'"));
  }
  // Protobuf refuses invalid UTF-8 on the wire; in-process callers (and other fronts) get the
  // same rule here.
  if (!IsValidUtf8(request.prompt())) return absl::InvalidArgumentError("prompt is not valid UTF-8");
  if (!IsValidUtf8(request.negative_prompt())) {
    return absl::InvalidArgumentError("negative_prompt is not valid UTF-8");
  }
  params.prompt = request.prompt();
  params.negative_prompt = request.negative_prompt();
  params.width = request.width() == 0 ? limits.default_width : request.width();
  params.height = request.height() == 0 ? limits.default_height : request.height();
  RETURN_IF_ERROR(CheckSize("width", params.width, limits));
  RETURN_IF_ERROR(CheckSize("height", params.height, limits));
  if (request.num_inference_steps() < 0 || request.num_inference_steps() > limits.max_steps) {
    return absl::InvalidArgumentError(absl::StrCat("num_inference_steps is ", request.num_inference_steps(),
                                                   "; allowed: 1 to ", limits.max_steps,
                                                   ", or 0 for the default (", limits.default_steps, ")"));
  }
  params.steps = request.num_inference_steps() == 0 ? limits.default_steps : request.num_inference_steps();
  // An input image (image to image, inpainting): decoded, sized (it may set width and height).
  RETURN_IF_ERROR(ApplyImageInput(request, limits, pipeline.name(), &params));
  if (request.has_guidance_scale()) {
    const float g = request.guidance_scale();
    if (!std::isfinite(g) || g < 0.0f || g > 100.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("guidance_scale is ", g, "; must be finite and within [0, 100]"));
    }
    params.guidance_scale = g;
  } else {
    params.guidance_scale = limits.default_guidance_scale;
  }
  if (request.output_format() != v1::IMAGE_FORMAT_UNSPECIFIED && request.output_format() != v1::IMAGE_FORMAT_PNG &&
      request.output_format() != v1::IMAGE_FORMAT_PNG_FAST && request.output_format() != v1::IMAGE_FORMAT_RGB) {
    return absl::InvalidArgumentError(absl::StrCat("output_format ", static_cast<int>(request.output_format()),
                                                   " is not supported; allowed: IMAGE_FORMAT_PNG, IMAGE_FORMAT_PNG_FAST, "
                                                   "IMAGE_FORMAT_RGB"));
  }
  if (request.partial_images() < 0 || request.partial_images() > kMaxPartialImages) {
    return absl::InvalidArgumentError(absl::StrCat("partial_images is ", request.partial_images(),
                                                   "; allowed: 0 (the default) ..", kMaxPartialImages));
  }
  if (request.priority() < 0 || request.priority() > kMaxPriority) {
    return absl::InvalidArgumentError(
        absl::StrCat("priority is ", request.priority(), "; allowed: 0 (the default) ..", kMaxPriority));
  }
  if (!IsValidTenant(request.tenant())) {
    return absl::InvalidArgumentError(absl::StrCat("tenant ", Truncated(request.tenant()), " is not at most ",
                                                   kMaxTenantLength, " characters of [A-Za-z0-9._-]"));
  }
  if (request.request_id().size() > 128) {
    return absl::InvalidArgumentError("request_id is longer than 128 characters");
  }
  for (char c : request.request_id()) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("request_id must be printable ASCII");
    }
  }
  if (request.loras_size() > kMaxLorasPerRequest) {
    return absl::InvalidArgumentError(
        absl::StrCat("loras: ", request.loras_size(), " adapters; at most ", kMaxLorasPerRequest, " per request"));
  }
  if (request.loras_size() > 0 && split) {
    return absl::FailedPreconditionError(absl::StrCat("loras: pipeline '", pipeline.name(),
                                                      "' runs on several devices; LoRA adapters need a pipeline on one"));
  }
  for (int i = 0; i < request.loras_size(); ++i) {
    const v1::LoraRef& ref = request.loras(i);
    const std::string field = absl::StrCat("loras[", i, "]");
    if (!std::isfinite(ref.scale()) || ref.scale() < -kMaxLoraScale || ref.scale() > kMaxLoraScale) {
      return absl::InvalidArgumentError(absl::StrFormat("%s.scale is %g; allowed: finite, -%g..%g", field,
                                                        ref.scale(), kMaxLoraScale, kMaxLoraScale));
    }
    RETURN_IF_ERROR(adapters.CheckNamed(pipeline.name(), ref.name(), field));
    for (int j = 0; j < i; ++j) {
      if (request.loras(j).name() == ref.name()) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".name: adapter '", ref.name(), "' named twice"));
      }
    }
    if (ref.scale() != 0.0f) params.loras.emplace_back(AdapterKey(pipeline.name(), ref.name()), ref.scale());
  }
  if (request.has_seed()) {
    params.seed = request.seed();
  } else {
    std::random_device device;
    params.seed = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  return params;
}

}  // namespace stowage
