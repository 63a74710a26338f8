// Image-to-image and inpainting for the flow-matching pipelines (Z-Image, Flux), as diffusers'
// ZImageImg2ImgPipeline / ZImageInpaintPipeline / FluxImg2ImgPipeline / FluxInpaintPipeline do it:
// the input image's latents (the VAE encoder's sample, drawn first from the request's generator),
// noise drawn next from the same generator, the run started at StartStep with the latents noised
// to that step's sigma, and — inpainting — the kept region put back after every step, noised to the
// next step's sigma (clean after the last).
#ifndef STOWAGE_MODELS_PIPELINES_IMAGE_INPUT_H_
#define STOWAGE_MODELS_PIPELINES_IMAGE_INPUT_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "models/nets/autoencoder_kl.h"
#include "models/pipelines/pipeline.h"

namespace stowage {

// One member's input in latent space, in the layout its pipeline keeps latents in.
struct InputLatents {
  at::Tensor image;   // Clean latents of the input image (model space, float32).
  at::Tensor noise;   // The noise drawn for it (float32).
  at::Tensor repaint;  // Inpainting: 1 where repainted, 0 where kept (float32); undefined otherwise.
};

// The input images of the running members that have one, through `vae_encoder` in one run of it
// (stage "encode_input"), each with its member's generator: (*inputs)[i].image = [1, C, h, w]
// float32 on `device`. Members without an input keep an undefined tensor; a failed encoding fails
// the members that needed it. `default_device`: the pipeline's (ComponentRunner::DeviceOf).
void EncodeMemberInputs(const std::vector<BatchMember>& members, ComponentRunner& runner, Component& vae_encoder,
                        c10::Device default_device, BatchRun& run, std::vector<at::Generator>& generators,
                        c10::Device device, std::vector<InputLatents>* inputs);

// The mask brought to latent resolution (nearest, as diffusers' interpolate), [1, 1, h, w] float32
// on `device`: 1 to repaint, 0 to keep. Undefined when the input has no mask.
at::Tensor LatentRepaintMask(const ImageInput& input, int64_t latent_height, int64_t latent_width, c10::Device device);

// The flow-matching forward process (diffusers' scale_noise): sigma · noise + (1 − sigma) · sample,
// in float32.
at::Tensor ScaleNoise(const at::Tensor& sample, const at::Tensor& noise, float sigma);

// Inpainting after the Euler step into `sigma_next` (the run's last step: `last`, the kept region
// clean): (1 − repaint) · kept + repaint · latents, kept = ScaleNoise(image, noise, sigma_next).
// `latents` unchanged when the input has no mask.
at::Tensor KeepUnmasked(const at::Tensor& latents, const InputLatents& input, float sigma_next, bool last);

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_IMAGE_INPUT_H_
