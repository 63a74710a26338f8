// Pipeline: text → image with a set of components, independent of transport and placement.
#ifndef STOWAGE_MODELS_PIPELINES_PIPELINE_H_
#define STOWAGE_MODELS_PIPELINES_PIPELINE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "models/pipelines/component.h"
#include "models/core/image.h"
#include "models/core/lora.h"

namespace stowage {

// What a request may ask of a pipeline; the server validates against it.
struct PipelineLimits {
  int default_width = 256;
  int default_height = 256;
  int min_size = 64;
  int max_size = 1024;
  int size_multiple = 16;
  int default_steps = 8;
  int max_steps = 100;
  float default_guidance_scale = 1.0f;
  int max_prompt_bytes = 126;
  // Takes an input image (image-to-image, inpainting): GenerationParams::input.
  bool accepts_images = false;
  // Runs requests with different LoRA adapters in one batch: its RunBatch installs per-row adapters
  // (ScopedLoraRows, models/core/lora.h) around each batched forward and the member's own around
  // per-member work, under the per-member rows its caller installs.
  bool mixes_adapters = false;
};

// The input of image-to-image and inpainting, decoded and brought to the request's size by the
// server (models/core/image.h: DecodePng, ResizeImage, MaskFromImage).
struct ImageInput {
  Image image;
  // Empty: image-to-image (the whole image is redrawn). Otherwise image.height × image.width bytes,
  // row-major: non-zero where the image is repainted, 0 where it is kept (inpainting).
  std::vector<uint8_t> mask;
};

// A validated request.
struct GenerationParams {
  std::string prompt;
  std::string negative_prompt;
  int width = 0;
  int height = 0;
  int steps = 0;
  float guidance_scale = 1.0f;
  uint64_t seed = 0;
  // LoRA adapters and their scales (models/core/lora.h), installed around the run by its caller.
  LoraScales loras;
  // Image-to-image / inpainting (only where PipelineLimits::accepts_images): the input, and how
  // much of the schedule runs from it — strength s in (0, 1] starts at step
  // StartStep(steps, s), with the input noised to that step's sigma (diffusers' img2img rule).
  std::shared_ptr<const ImageInput> input;
  double strength = 1.0;
};

// The first of `steps` denoising steps an image-to-image run takes at `strength`: diffusers'
// int(max(steps − min(steps · strength, steps), 0)); 0 without an input image.
int StartStep(const GenerationParams& params);

// Progress reports and cancellation for one run. Stage names: "tokenize", "encode_prompt",
// "denoise", "decode".
class RunContext {
 public:
  struct StageTime {
    std::string stage;
    absl::Duration duration;
    bool shared = false;  // Ran once for every member of a batch (see set_shared).
  };
  // `interrupt` returns non-OK (CANCELLED, DEADLINE_EXCEEDED) when the run must stop; `progress` is
  // called with (stage, step, total_steps) at each stage start and after each denoising step.
  RunContext(std::function<absl::Status()> interrupt,
             std::function<void(const std::string&, int, int)> progress);

  absl::Status CheckInterrupt() const { return interrupt_ ? interrupt_() : absl::OkStatus(); }
  void BeginStage(const std::string& stage, int total_steps = 0);
  void EndStage();
  void ReportStep(int step, int total_steps);
  // Preemption between steps: the run pauses after denoising step `step` of `total` while another
  // request runs on its device (a "paused" progress event), then was paused for `paused`, which
  // the stage running now does not count.
  void ReportPaused(int step, int total_steps);
  void ExcludeFromStage(absl::Duration paused);

  // Previews (partial images): after each denoising step in `steps` (1-based) the pipeline decodes
  // its estimate of the final image at that point (the clean latents one Euler step to sigma 0
  // would give) and hands it to `on_preview` with its index (0, 1, ... in step order). Called on
  // the thread that runs the pipeline; a preview that fails to decode is skipped.
  using PreviewFn = std::function<void(int index, int step, const Image& image)>;
  void set_previews(std::vector<int> steps, PreviewFn on_preview);
  bool WantsPreview(int step) const;
  void Preview(int step, const Image& image);
  const std::vector<StageTime>& stage_times() const { return stage_times_; }
  // Stages begun from now on ran for a whole batch at once (their time is the batch's).
  void set_shared(bool shared) { shared_ = shared; }
  // Waits until the device has computed what was queued so far (the runner's compute stream: a
  // CUDA device runs kernels after the host queued them; copies may run on). Called at every stage
  // boundary before the clock is read, so a stage's time is its device work, not the time the host
  // took to queue it (without it the host runs up to a denoising step ahead and the decode's device
  // time lands after the last stage). Unset: the host's time.
  void set_synchronize(std::function<void()> synchronize) { synchronize_ = std::move(synchronize); }

 private:
  std::function<absl::Status()> interrupt_;
  std::function<void(const std::string&, int, int)> progress_;
  std::function<void()> synchronize_;
  std::vector<int> preview_steps_;
  PreviewFn on_preview_;
  int previews_sent_ = 0;
  std::string current_stage_;
  absl::Time stage_start_;
  bool shared_ = false;
  bool current_shared_ = false;
  std::vector<StageTime> stage_times_;
};

// The denoising steps (1-based, ascending, distinct) after which `count` previews of a `steps`-step
// run are taken: evenly spaced before the last step (which is the final image itself); fewer when
// the run has too few steps.
std::vector<int> PreviewSteps(int count, int steps);

// One request of a batch: its validated parameters and its own progress and cancellation.
struct BatchMember {
  const GenerationParams* params = nullptr;
  RunContext* context = nullptr;
};

// After a denoising step (1-based `step`): decodes the clean latents of the members that asked for
// a preview at this step — (member index, latents) pairs — with `decode` inside one run of `vae`,
// and hands each member its image. A preview that fails (the run, the conversion) is skipped: a
// preview never fails its request.
void DeliverPreviews(ComponentRunner& runner, Component& vae, const std::vector<BatchMember>& members, int step,
                     const std::vector<std::pair<size_t, at::Tensor>>& latents,
                     const std::function<at::Tensor(const at::Tensor&)>& decode);


// Requests that may run as one batch: the same image size, step count, start step (StartStep) and,
// unless the pipeline mixes adapters (PipelineLimits::mixes_adapters), LoRA adapters with the same
// scales (prompts, negative prompts, seeds, guidance and input images may differ).
bool BatchCompatible(const GenerationParams& a, const GenerationParams& b, bool mixes_adapters = false);
// The same rule as a string: BatchCompatible(a, b, m) exactly when BatchKey(a, m) == BatchKey(b, m)
// (the device worker groups queued requests by it).
std::string BatchKey(const GenerationParams& params, bool mixes_adapters = false);

// The bookkeeping of one batched run (a pipeline's RunBatch): every member's result, which members
// are still running, and stage reports to those. A member leaves with the first non-OK status a
// Filter check gives it; the others go on.
class BatchRun {
 public:
  explicit BatchRun(const std::vector<BatchMember>& members);
  // False when the members are not BatchCompatible (`mixes_adapters`: the pipeline's); then every
  // result is INVALID_ARGUMENT and nothing should run.
  bool Compatible(bool mixes_adapters = false);
  // Runs `check` for each running member; those it gives a non-OK status leave with it.
  void Filter(const std::function<absl::Status(size_t)>& check);
  void BeginStage(const std::string& stage, int total_steps = 0);
  // Indices (into the members) of those still running, in order.
  const std::vector<size_t>& active() const { return active_; }
  void set_result(size_t i, absl::StatusOr<Image> result) { results_[i] = std::move(result); }
  std::vector<absl::StatusOr<Image>> TakeResults() { return std::move(results_); }

 private:
  const std::vector<BatchMember>& members_;
  std::vector<absl::StatusOr<Image>> results_;
  std::vector<size_t> active_;
};

class Pipeline {
 public:
  virtual ~Pipeline() = default;
  virtual const std::string& name() const = 0;
  virtual std::string description() const = 0;
  virtual const PipelineLimits& limits() const = 0;
  // Components in execution order.
  virtual std::vector<Component*> components() = 0;
  // Runs text → RGB image. Components are called through `runner` only. Returns the interrupt's
  // status if interrupted between steps.
  virtual absl::StatusOr<Image> Run(const GenerationParams& params, ComponentRunner& runner,
                                    RunContext& context) = 0;

  // Runs BatchCompatible requests together and returns one result per member, in order. A member
  // whose context interrupts leaves at the next step boundary with the interrupt's status; the
  // others go on undisturbed. Each member's image equals what Run gives it alone (up to float
  // rounding of the batched arithmetic). Pipelines with a batched forward (batched() true) run
  // one forward per denoising step over all members, so offloaded weights move once per step for
  // the whole batch; the default runs the members one after another.
  virtual std::vector<absl::StatusOr<Image>> RunBatch(const std::vector<BatchMember>& members,
                                                      ComponentRunner& runner);
  // True when RunBatch shares forwards between members (the server only forms batches then).
  virtual bool batched() const { return false; }

  // OK unless one of the files the components' weights are still mapped from changed on disk after
  // the load (see offload/safetensors.h): then FAILED_PRECONDITION naming the file and saying to
  // reload the pipeline. Weights copied to RAM or the device at load are not affected. The server
  // checks before a Run and after it: a file that shrank during the Run made it read zeros, so its
  // result is discarded. Call on the device worker.
  //   RETURN_IF_ERROR(pipeline.CheckSourceFiles());
  //   absl::StatusOr<Image> image = pipeline.Run(params, runner, context);
  //   RETURN_IF_ERROR(pipeline.CheckSourceFiles());
  absl::Status CheckSourceFiles();
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_PIPELINE_H_
