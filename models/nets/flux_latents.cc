#include "models/nets/flux_latents.h"

#include <cmath>

#include <ATen/ATen.h>

namespace stowage {

at::Tensor PackLatents(const at::Tensor& latents) {
  TORCH_CHECK(latents.dim() == 4 && latents.size(2) % 2 == 0 && latents.size(3) % 2 == 0,
              "PackLatents: latents must be [B, C, H, W] with even H and W");
  const int64_t b = latents.size(0), c = latents.size(1), h = latents.size(2), w = latents.size(3);
  return latents.view({b, c, h / 2, 2, w / 2, 2}).permute({0, 2, 4, 1, 3, 5}).reshape({b, (h / 2) * (w / 2), c * 4});
}

at::Tensor UnpackLatents(const at::Tensor& packed, int64_t height, int64_t width) {
  TORCH_CHECK(packed.dim() == 3 && height % 2 == 0 && width % 2 == 0 && packed.size(2) % 4 == 0 &&
                  packed.size(1) == (height / 2) * (width / 2),
              "UnpackLatents: packed must be [B, (H/2)(W/2), 4C] for even H and W");
  const int64_t b = packed.size(0), c = packed.size(2) / 4;
  return packed.view({b, height / 2, width / 2, c, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({b, c, height, width});
}

at::Tensor LatentImageIds(int64_t height, int64_t width) {
  const int64_t h = height / 2, w = width / 2;
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  at::Tensor ids = at::zeros({h, w, 3}, f32);
  ids.select(2, 1).add_(at::arange(h, f32).unsqueeze(1));
  ids.select(2, 2).add_(at::arange(w, f32).unsqueeze(0));
  return ids.reshape({h * w, 3});
}

double FluxShift(int64_t image_tokens, int64_t base_seq_len, int64_t max_seq_len, double base_shift,
                 double max_shift) {
  const double m = (max_shift - base_shift) / static_cast<double>(max_seq_len - base_seq_len);
  const double b = base_shift - m * static_cast<double>(base_seq_len);
  return static_cast<double>(image_tokens) * m + b;
}

std::vector<float> FluxSigmas(int n, double mu) {
  std::vector<float> sigmas;
  const at::Tensor base = at::linspace(1.0, 1.0 / n, n, at::TensorOptions().dtype(at::kFloat));
  const at::Tensor shifted = std::exp(mu) / (std::exp(mu) + (1.0 / base - 1.0));
  const at::Tensor s = shifted.to(at::kFloat).contiguous();
  sigmas.assign(s.data_ptr<float>(), s.data_ptr<float>() + n);
  sigmas.push_back(0.0f);
  return sigmas;
}

}  // namespace stowage
