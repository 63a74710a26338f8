// The Flux.1 text-to-image pipeline ([dev] and [schnell]), as diffusers' FluxPipeline runs it: the
// prompt through CLIP-L (pooled output, 77 tokens) and T5-XXL (all 512 hidden states, padded and
// unmasked), 16-channel latents drawn from the seed and packed into 2x2 patches, flow-matching Euler
// over sigmas linspace(1, 1/N, N) shifted by the image's token count (use_dynamic_shifting) or by a
// fixed shift, the transformer called with sigma as its timestep (and, for [dev], the guidance scale
// as an embedded input: distilled guidance, one forward per step), then unpacked and decoded by the
// Flux VAE. [schnell] (guidance_embeds false) ignores the guidance scale. Negative prompts (diffusers'
// true_cfg_scale) are not supported: a request with one is INVALID_ARGUMENT.
//
// Requests of one size and step count batch: one transformer forward per step over every member.
#ifndef STOWAGE_MODELS_PIPELINES_FLUX_PIPELINE_H_
#define STOWAGE_MODELS_PIPELINES_FLUX_PIPELINE_H_

#include <memory>
#include <set>
#include <string>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "models/pipelines/component.h"
#include "models/pipelines/pipeline.h"

namespace stowage {

struct FluxPipelineOptions {
  std::string name = "flux";
  at::ScalarType dtype = at::kBFloat16;
  c10::Device device = c10::Device(c10::kCPU);
  uint64_t weight_seed = 0;          // Random-weights mode only.
  // Random-weights mode: seeds of single components (ComponentSeed), e.g. a fine-tune's transformer.
  std::map<std::string, uint64_t> component_seeds;
  int64_t max_sequence_length = 512; // T5 tokens (diffusers' default).
  std::set<std::string> fp8_components;  // Components converted to FP8 compute at load.
  // Of those, components whose FP8 form is made with their int4 host copy in one pass (group offload
  // with compress int4): declared at load, not converted (MakeComponent's fp8_one_pass).
  std::set<std::string> fp8_one_pass_components;
  std::string host_spill_dir;  // PipelineConfig.host_spill_dir (empty: host copies stay in RAM).
  int64_t default_size = 0;          // Default width and height; 0: 1024 (Flux's), 128 for the tiny built-in.
};

// A diffusers-format Flux directory (model_index.json; transformer/ (FluxTransformer2DModel), vae/,
// text_encoder/ (CLIPTextModel), text_encoder_2/ (T5EncoderModel), sharded safetensors with their
// index; tokenizer/ vocab.json + merges.txt; tokenizer_2/ spiece.model; scheduler/). With
// `random_weights` only the configs and tokenizers are read. With `cache`, components already loaded
// from the same folder (same dtype) are shared.
absl::StatusOr<std::unique_ptr<Pipeline>> LoadFluxPipeline(const std::string& dir, const FluxPipelineOptions& options,
                                                           bool random_weights, ComponentCache* cache = nullptr);

// Flux's architecture ([dev]: guidance embedded) at a tiny size with deterministic random weights
// and byte-level tokenizers: runs anywhere with nothing downloaded (its images are noise).
absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyFluxPipeline(const FluxPipelineOptions& options);

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_FLUX_PIPELINE_H_
