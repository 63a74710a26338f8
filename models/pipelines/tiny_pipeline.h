// The built-in text-to-image pipeline: ByteTokenizer → TinyTextEncoder → TinyDiT denoiser with a
// flow-matching Euler scheduler and classifier-free guidance → TinyVaeDecoder. Deterministic
// random weights (so its images are structured noise, not pictures); nothing to download.
#ifndef STOWAGE_MODELS_PIPELINES_TINY_PIPELINE_H_
#define STOWAGE_MODELS_PIPELINES_TINY_PIPELINE_H_

#include <memory>
#include <set>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "models/pipelines/pipeline.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/pipelines/tiny_models.h"

namespace stowage {

struct TinyPipelineOptions {
  std::string name = "tiny";
  at::ScalarType dtype = at::kFloat;
  uint64_t weight_seed = 0;
  // Random-weights mode: seeds of single components (ComponentSeed), e.g. a fine-tune's transformer.
  std::map<std::string, uint64_t> component_seeds;
  // Where inputs and latents are created; components' weights are placed by the runner.
  c10::Device device = c10::Device(c10::kCPU);
  std::set<std::string> fp8_components;  // Refused by the registry: the tiny architecture has no FP8.
  std::set<std::string> fp8_one_pass_components;  // Empty whenever fp8_components is.
  std::string host_spill_dir;  // PipelineConfig.host_spill_dir (empty: host copies stay in RAM).
  TinyTextEncoderConfig text_encoder;
  TinyDiTConfig transformer;
  TinyVaeDecoderConfig vae;
  FlowMatchSchedulerConfig scheduler;
};

absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyPipeline(const TinyPipelineOptions& options);

// Writes the pipeline `options` describes (random weights from options.weight_seed) as a
// diffusers-format directory: model_index.json, and text_encoder/, transformer/, vae/ (config.json
// and safetensors; the transformer sharded when max_shard_bytes > 0) and scheduler/.
absl::Status SaveTinyPipeline(const TinyPipelineOptions& options, const std::string& dir,
                              int64_t max_shard_bytes = 0);

// Loads a directory written by SaveTinyPipeline (or by hand in that layout). Architecture sizes come
// from each config.json; weights are mapped, not copied, when their dtype is options.dtype. With
// `random_weights`, only the configs are read and the weights are drawn from options.weight_seed.
// Errors name the file and the tensor or field.
// With `cache`, components another pipeline already loaded from the same folder (same dtype) are
// shared rather than loaded again.
absl::StatusOr<std::unique_ptr<Pipeline>> LoadTinyPipeline(const std::string& dir,
                                                           const TinyPipelineOptions& options,
                                                           bool random_weights,
                                                           ComponentCache* cache = nullptr);

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_TINY_PIPELINE_H_
