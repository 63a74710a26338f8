// The image-to-image and inpainting parity check both families share: a pipeline loaded from
// FIXTURE/pipeline against diffusers' img2img / inpaint pipelines on the same files
// (tests/parity/make_edit_fixtures.py: FIXTURE/edit_image.png, edit_mask.png, edit_cases.json,
// edit_io.safetensors), and the VAE encoder's moments against diffusers' latent distribution.
#ifndef STOWAGE_TESTS_PARITY_EDIT_PARITY_H_
#define STOWAGE_TESTS_PARITY_EDIT_PARITY_H_

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "base/bounded_read.h"
#include "base/status_macros.h"
#include "models/core/diffusers_format.h"
#include "models/core/image.h"
#include "models/nets/autoencoder_kl.h"
#include "models/pipelines/pipeline.h"
#include "tests/parity/parity_common.h"

namespace stowage::parity {

inline absl::StatusOr<std::string> ReadBinary(const std::string& path) { return ReadFileAtMost(path, 64 << 20); }

// The VAE encoder of FIXTURE/pipeline/vae on edit_image.png: mean and log-variance within 1e-5.
inline absl::Status CheckEncoder(const std::string& root) {
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(root + "/pipeline/vae/config.json"));
  ASSIGN_OR_RETURN(AutoencoderKLConfig config, AutoencoderKLConfigFromJson(json));
  ASSIGN_OR_RETURN(auto encoder, Build<AutoencoderKLEncoder>(config, root + "/pipeline/vae", at::kFloat,
                                                             VaeEncoderIgnoredPrefixes(config)));
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/edit_io.safetensors"));
  ASSIGN_OR_RETURN(std::string png, ReadBinary(root + "/edit_image.png"));
  ASSIGN_OR_RETURN(Image image, DecodePng(png));
  const std::vector<at::Tensor> moments = encoder->Moments(ImageToTensor(image)).chunk(2, 1);
  Report("vae encoder mean float32", RelativeError(moments[0], io.at("encoder_mean")), 1e-5);
  Report("vae encoder logvar float32", RelativeError(moments[1], io.at("encoder_logvar")), 1e-5);
  return absl::OkStatus();
}

// Every case of edit_cases.json through `pipeline` (float32, on the CPU): images within one 8-bit
// level of diffusers'.
inline absl::Status CheckEdits(const std::string& root, Pipeline& pipeline) {
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/edit_io.safetensors"));
  ASSIGN_OR_RETURN(auto cases, ReadJsonFile(root + "/edit_cases.json"));
  ASSIGN_OR_RETURN(std::string image_png, ReadBinary(root + "/edit_image.png"));
  ASSIGN_OR_RETURN(std::string mask_png, ReadBinary(root + "/edit_mask.png"));
  ASSIGN_OR_RETURN(Image image, DecodePng(image_png));
  std::vector<uint8_t> alpha;
  ASSIGN_OR_RETURN(Image mask_image, DecodePng(mask_png, &alpha));
  const auto& fields = cases.fields();
  const int width = static_cast<int>(fields.at("width").number_value());
  const int height = static_cast<int>(fields.at("height").number_value());
  HostRunner runner;
  for (const auto& item : fields.at("cases").list_value().values()) {
    const auto& c = item.struct_value().fields();
    const std::string name = c.at("name").string_value();
    auto input = std::make_shared<ImageInput>();
    input->image = image;
    if (c.at("kind").string_value() == "inpaint") input->mask = MaskFromImage(mask_image, alpha);
    GenerationParams p;
    p.prompt = c.at("prompt").string_value();
    p.negative_prompt = c.at("negative_prompt").string_value();
    p.width = width;
    p.height = height;
    p.steps = static_cast<int>(c.at("steps").number_value());
    p.guidance_scale = static_cast<float>(c.at("guidance").number_value());
    p.seed = static_cast<uint64_t>(fields.at("seed").number_value());
    p.strength = c.at("strength").number_value();
    p.input = input;
    RunContext context(nullptr, nullptr);
    ASSIGN_OR_RETURN(Image out, pipeline.Run(p, runner, context));
    const at::Tensor got = ImageAsTensor(out);
    Report("edit " + name + " (max abs)", (got - io.at(name)).abs().max().item<double>(), 1.0 / 255 + 1e-4);
  }
  return absl::OkStatus();
}

}  // namespace stowage::parity

#endif  // STOWAGE_TESTS_PARITY_EDIT_PARITY_H_
