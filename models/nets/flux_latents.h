// Flux's latent layout and timestep schedule, as diffusers' FluxPipeline has them: 16-channel VAE
// latents are packed into 2x2 patches (a sequence of 64-channel tokens) with three-axis position ids,
// and the sigmas of the flow-matching schedule are shifted by an amount that grows with the number
// of image tokens (use_dynamic_shifting, exponential time shift).
//
// Thread-safety: reentrant.
#ifndef STOWAGE_MODELS_NETS_FLUX_LATENTS_H_
#define STOWAGE_MODELS_NETS_FLUX_LATENTS_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace stowage {

// [B, C, H, W] (H, W even) → [B, (H/2)(W/2), 4C]: each token is one 2x2 patch, channel-major within
// it (c, dy, dx), tokens in row-major patch order.
at::Tensor PackLatents(const at::Tensor& latents);
// The inverse: [B, (H/2)(W/2), 4C] → [B, C, H, W].
at::Tensor UnpackLatents(const at::Tensor& packed, int64_t height, int64_t width);
// Position ids of the packed tokens of an H x W latent: [(H/2)(W/2), 3] = (0, row, column), float32.
at::Tensor LatentImageIds(int64_t height, int64_t width);

// diffusers' calculate_shift: mu grows linearly from base_shift at base_seq_len image tokens to
// max_shift at max_seq_len (and beyond, linearly).
double FluxShift(int64_t image_tokens, int64_t base_seq_len = 256, int64_t max_seq_len = 4096,
                 double base_shift = 0.5, double max_shift = 1.15);

// The schedule FluxPipeline runs: sigmas linspace(1, 1/n, n), each shifted by
// exp(mu) / (exp(mu) + (1/sigma − 1)), then a final 0. n + 1 values, float32 arithmetic.
std::vector<float> FluxSigmas(int n, double mu);

}  // namespace stowage

#endif  // STOWAGE_MODELS_NETS_FLUX_LATENTS_H_
