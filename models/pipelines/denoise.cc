#include "models/pipelines/denoise.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <utility>

#include "models/core/image.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/pipelines/image_input.h"

namespace stowage {

void Denoise(const std::vector<BatchMember>& members, ComponentRunner& runner, BatchRun& run,
             const DenoiseFamily& f) {
  const std::vector<size_t>& active = run.active();  // Shrinks as members leave (run.Filter).
  if (members.empty()) return;
  const GenerationParams& shape = *members.front().params;
  const int n = shape.steps;
  const int start = StartStep(shape);  // The same for every member (BatchKey).
  const std::vector<float>& sigmas = f.sigmas;

  // Each member's generator: the input image's sample first (image to image), then the noise.
  std::vector<at::Generator> generators;
  for (const BatchMember& m : members) generators.push_back(at::detail::createCPUGenerator(m.params->seed));
  std::vector<InputLatents> inputs(members.size());
  EncodeMemberInputs(members, runner, *f.vae_encoder, f.default_device, run, generators, f.device, &inputs);
  std::vector<at::Tensor> latents(members.size());
  for (size_t i : active) {
    const at::Tensor noise = f.draw_noise(generators[i]);
    if (!inputs[i].image.defined()) {
      latents[i] = noise.to(f.latent_dtype);
      continue;
    }
    inputs[i].image = f.image_to_layout(inputs[i].image);
    inputs[i].noise = noise;
    const at::Tensor repaint =
        LatentRepaintMask(*members[i].params->input, f.latent_height, f.latent_width, f.device);
    if (repaint.defined()) inputs[i].repaint = f.mask_to_layout(repaint);
    latents[i] = ScaleNoise(inputs[i].image, noise, sigmas[start]).to(f.latent_dtype);
  }

  run.BeginStage("denoise", n - start);
  for (int step = start; step < n && !active.empty(); ++step) {
    std::vector<at::Tensor> velocities(active.size());
    if (step == n - 1) {
      runner.Prefetch(*f.vae);  // The decoder's first groups copy during the last step.
      if (f.transformer != nullptr) runner.LastRunNext(*f.transformer);  // And none of a next step's groups.
    }
    const absl::Status ran = f.forward(step, active, latents, &velocities);
    if (!ran.ok()) {
      run.Filter([&](size_t) { return ran; });
      break;
    }
    std::vector<std::pair<size_t, at::Tensor>> previews;
    // Steps are counted from the run's start (image to image runs n - start of them).
    const int done = step - start + 1;
    for (size_t k = 0; k < active.size(); ++k) {
      const size_t i = active[k];
      const at::Tensor& velocity = velocities[k];
      if (members[i].context->WantsPreview(done)) {
        previews.emplace_back(i, EulerStep(latents[i], velocity, -sigmas[step]).to(f.latent_dtype));
      }
      latents[i] = EulerStep(latents[i], velocity, sigmas[step + 1] - sigmas[step]).to(f.latent_dtype);
      latents[i] = KeepUnmasked(latents[i], inputs[i], sigmas[step + 1], step == n - 1).to(f.latent_dtype);
      members[i].context->ReportStep(done, n - start);
    }
    DeliverPreviews(runner, *f.vae, members, done, previews, f.decode);
    if (step < n - 1) runner.BetweenSteps(done, n - start);
    run.Filter([&](size_t i) { return members[i].context->CheckInterrupt(); });
  }

  run.BeginStage("decode", 0);
  std::vector<at::Tensor> pixels(members.size());
  if (!active.empty()) {
    const absl::Status decoded = runner.Run(*f.vae, [&] {
      for (size_t i : active) pixels[i] = f.decode(latents[i]);
    });
    run.Filter([&](size_t) { return decoded; });
  }
  for (size_t i : active) {
    // The image's bytes copied to the host count in the decode.
    run.set_result(i, ImageFromTensor(pixels[i]));
    members[i].context->EndStage();
  }
}

}  // namespace stowage
