// The denoising skeleton the flow-matching families (Z-Image, Flux) share, from the members' initial
// latents to their images: each member's generator (the input image's sample first, then the noise),
// the latents (noise, or the input image noised to the start step), the Euler steps from StartStep
// with inpainting's kept region put back, previews, progress, interrupts, then the VAE decode. A
// family supplies what is its own: the latents' layout, one transformer forward over the running
// members, and the decode of one member's latents.
#ifndef STOWAGE_MODELS_PIPELINES_DENOISE_H_
#define STOWAGE_MODELS_PIPELINES_DENOISE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "models/pipelines/component.h"
#include "models/pipelines/pipeline.h"

namespace stowage {

struct DenoiseFamily {
  Component* transformer = nullptr;
  Component* vae = nullptr;          // Decoder.
  Component* vae_encoder = nullptr;  // For members with an input image.
  c10::Device default_device = c10::Device(c10::kCPU);  // The pipeline's (ComponentRunner::DeviceOf).
  c10::Device device = c10::Device(c10::kCPU);          // Where the denoising loop runs (the transformer's).
  // The dtype latents are kept in between steps (each step computes in float32).
  at::ScalarType latent_dtype = at::kFloat;
  // Latent height and width (pixels / the VAE's factor).
  int64_t latent_height = 0, latent_width = 0;
  // n + 1 sigmas of an n-step schedule (the last 0).
  std::vector<float> sigmas;
  // A member's noise drawn from its generator, in the family's layout, float32 on `device`.
  std::function<at::Tensor(at::Generator&)> draw_noise;
  // [1, C, h, w] (the input image's latents; the repaint mask with C = 1) → the family's layout.
  std::function<at::Tensor(const at::Tensor&)> image_to_layout;
  std::function<at::Tensor(const at::Tensor&)> mask_to_layout;
  // One transformer forward at schedule index `step` over the members in `active` (indices into
  // the batch), their latents in `latents` (by member index): each one's velocity (the latents'
  // layout, any float dtype: the Euler step widens it) into (*velocities)[k] for active[k]. Runs
  // the transformer through the runner.
  std::function<absl::Status(int step, const std::vector<size_t>& active, const std::vector<at::Tensor>& latents,
                             std::vector<at::Tensor>* velocities)>
      forward;
  // One member's latents → pixels [1, 3, H, W] in [-1, 1] (called inside a run of `vae`).
  std::function<at::Tensor(const at::Tensor&)> decode;
};

// Runs the members still active in `run` from their latents to their images (run's results).
// Stages "encode_input" (members with an input), "denoise" (StartStep..n-1, progress counted from
// the start) and "decode".
void Denoise(const std::vector<BatchMember>& members, ComponentRunner& runner, BatchRun& run,
             const DenoiseFamily& family);

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_DENOISE_H_
