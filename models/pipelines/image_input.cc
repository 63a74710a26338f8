#include "models/pipelines/image_input.h"

#include <ATen/ATen.h>

namespace stowage {
namespace {

// The input image's clean latents, [1, latent_channels, H / f, W / f] float32 on `device`: the
// encoder runs where its weights are (`encoder_device`, `encoder_dtype`), its noise drawn from
// `generator`.
at::Tensor EncodeInputImage(AutoencoderKLEncoder& encoder, const ImageInput& input, at::Generator& generator,
                            c10::Device encoder_device, at::ScalarType encoder_dtype, c10::Device device) {
  const at::Tensor pixels = ImageToTensor(input.image).to(encoder_device).to(encoder_dtype);
  return encoder.SampleLatents(pixels, generator).to(device);
}

}  // namespace

void EncodeMemberInputs(const std::vector<BatchMember>& members, ComponentRunner& runner, Component& vae_encoder,
                        c10::Device default_device, BatchRun& run, std::vector<at::Generator>& generators,
                        c10::Device device, std::vector<InputLatents>* inputs) {
  std::vector<size_t> with_input;
  for (size_t i : run.active()) {
    if (members[i].params->input != nullptr) with_input.push_back(i);
  }
  if (with_input.empty()) return;
  run.BeginStage("encode_input", 0);
  auto& encoder = static_cast<AutoencoderKLEncoder&>(vae_encoder.module());
  const c10::Device encoder_device = runner.DeviceOf(vae_encoder, default_device);
  const absl::Status encoded = runner.Run(vae_encoder, [&] {
    for (size_t i : with_input) {
      (*inputs)[i].image = EncodeInputImage(encoder, *members[i].params->input, generators[i], encoder_device,
                                            vae_encoder.dtype(), device);
    }
  });
  run.Filter([&](size_t i) { return members[i].params->input != nullptr ? encoded : absl::OkStatus(); });
}

at::Tensor LatentRepaintMask(const ImageInput& input, int64_t latent_height, int64_t latent_width, c10::Device device) {
  if (input.mask.empty()) return at::Tensor();
  const std::vector<uint8_t> small = ResizeMask(input.mask, input.image.width, input.image.height,
                                                static_cast<int>(latent_width), static_cast<int>(latent_height));
  const at::Tensor bytes =
      at::from_blob(const_cast<uint8_t*>(small.data()), {1, 1, latent_height, latent_width}, at::kByte);
  return bytes.ne(0).to(at::kFloat).to(device);
}

at::Tensor ScaleNoise(const at::Tensor& sample, const at::Tensor& noise, float sigma) {
  return noise.to(at::kFloat) * sigma + sample.to(at::kFloat) * (1.0f - sigma);
}

at::Tensor KeepUnmasked(const at::Tensor& latents, const InputLatents& input, float sigma_next, bool last) {
  if (!input.repaint.defined()) return latents;
  const at::Tensor kept = last ? input.image : ScaleNoise(input.image, input.noise, sigma_next);
  return (1.0f - input.repaint) * kept + input.repaint * latents.to(at::kFloat);
}

}  // namespace stowage
