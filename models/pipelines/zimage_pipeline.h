// The Z-Image text-to-image pipeline, as diffusers' ZImagePipeline runs it: the Qwen chat template
// around the prompt, Qwen3 hidden_states[-2] as caption features, flow-matching Euler over
// sigmas = shift(linspace(1, 1/N, N)), the transformer's output negated as the velocity, guidance
// pos + g·(pos − neg) whenever g > 0, and the Flux VAE decode.
#ifndef STOWAGE_MODELS_PIPELINES_ZIMAGE_PIPELINE_H_
#define STOWAGE_MODELS_PIPELINES_ZIMAGE_PIPELINE_H_

#include <memory>
#include <set>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "models/nets/autoencoder_kl.h"
#include "models/pipelines/pipeline.h"
#include "models/nets/qwen3_text_encoder.h"
#include "models/nets/zimage_transformer.h"

namespace stowage {

struct ZImagePipelineOptions {
  std::string name = "zimage";
  at::ScalarType dtype = at::kBFloat16;
  c10::Device device = c10::Device(c10::kCPU);
  uint64_t weight_seed = 0;     // Random-weights mode only.
  // Random-weights mode: seeds of single components (ComponentSeed), e.g. a fine-tune's transformer.
  std::map<std::string, uint64_t> component_seeds;
  double scheduler_shift = 3.0; // Overridden by scheduler/scheduler_config.json when present.
  int64_t max_sequence_length = 512;
  std::set<std::string> fp8_components;  // Components converted to FP8 compute at load.
  // Of those, components whose FP8 form is made with their int4 host copy in one pass (group offload
  // with compress int4): declared at load, not converted (MakeComponent's fp8_one_pass).
  std::set<std::string> fp8_one_pass_components;
  std::string host_spill_dir;  // PipelineConfig.host_spill_dir (empty: host copies stay in RAM).
  int64_t default_size = 0;     // Default width and height; 0: 1024 (Z-Image's), 256 for the tiny built-in.
};

// A diffusers-format Z-Image directory (model_index.json; transformer/, vae/, text_encoder/ with
// config.json and safetensors; tokenizer/tokenizer.json; scheduler/scheduler_config.json). With
// `random_weights` only the configs (and the tokenizer) are read. With `cache`, components already
// loaded from the same folder (same dtype) are shared.
absl::StatusOr<std::unique_ptr<Pipeline>> LoadZImagePipeline(const std::string& dir,
                                                            const ZImagePipelineOptions& options,
                                                            bool random_weights,
                                                            ComponentCache* cache = nullptr);

// Z-Image's architecture at a tiny size with deterministic random weights and a byte-level
// tokenizer: runs anywhere with nothing downloaded (its images are noise).
absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyZImagePipeline(const ZImagePipelineOptions& options);

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_ZIMAGE_PIPELINE_H_
