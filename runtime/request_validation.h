// A request checked against its pipeline: every field of a GenerateRequest against the pipeline's
// limits (PipelineLimits) and the server's bounds, turned into the GenerationParams the pipeline
// runs. Transport-free and device-free: both fronts' requests pass here before they queue.
#ifndef STOWAGE_RUNTIME_REQUEST_VALIDATION_H_
#define STOWAGE_RUNTIME_REQUEST_VALIDATION_H_

#include "absl/status/statusor.h"
#include "models/pipelines/pipeline.h"
#include "runtime/adapter_table.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// INVALID_ARGUMENT naming the field and the allowed range for anything out of bounds: an empty or
// too long or non-UTF-8 prompt, a size outside the pipeline's (or not a multiple of its
// size_multiple), a step count, guidance scale, output format, partial_images, priority, tenant or
// request_id out of range, an input image that does not decode or fit (ApplyImageInput), more than
// kMaxLorasPerRequest adapters, an adapter the pipeline has not loaded (`adapters`) or named twice,
// a LoRA scale out of range. FAILED_PRECONDITION for adapters on a `split` pipeline (one whose
// components run on several devices). Fills the defaults (size, steps, guidance) and draws a seed
// when the request has none.
absl::StatusOr<GenerationParams> ValidateRequest(const v1::GenerateRequest& request, const Pipeline& pipeline,
                                                 const AdapterTable& adapters, bool split);

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_REQUEST_VALIDATION_H_
