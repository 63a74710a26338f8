#include "models/pipelines/pipeline.h"

#include <algorithm>

#include "absl/base/casts.h"
#include "absl/strings/str_cat.h"

namespace stowage {

RunContext::RunContext(std::function<absl::Status()> interrupt,
                       std::function<void(const std::string&, int, int)> progress)
    : interrupt_(std::move(interrupt)), progress_(std::move(progress)) {}

void RunContext::ReportPaused(int step, int total_steps) {
  if (progress_) progress_("paused", step, total_steps);
}

void RunContext::ExcludeFromStage(absl::Duration paused) {
  if (!current_stage_.empty()) stage_start_ += paused;
}

void RunContext::BeginStage(const std::string& stage, int total_steps) {
  EndStage();
  if (synchronize_) synchronize_();  // The work queued before this stage is not its time.
  current_stage_ = stage;
  current_shared_ = shared_;
  stage_start_ = absl::Now();
  if (progress_) progress_(stage, 0, total_steps);
}

void RunContext::EndStage() {
  if (current_stage_.empty()) return;
  if (synchronize_) synchronize_();
  stage_times_.push_back(StageTime{current_stage_, absl::Now() - stage_start_, current_shared_});
  current_stage_.clear();
}

bool BatchCompatible(const GenerationParams& a, const GenerationParams& b, bool mixes_adapters) {
  return BatchKey(a, mixes_adapters) == BatchKey(b, mixes_adapters);
}

int StartStep(const GenerationParams& params) {
  if (params.input == nullptr) return 0;
  const double steps = params.steps;
  return static_cast<int>(std::max(steps - std::min(steps * params.strength, steps), 0.0));
}

std::string BatchKey(const GenerationParams& params, bool mixes_adapters) {
  std::string key = absl::StrCat(params.width, "x", params.height, "/", params.steps);
  if (const int start = StartStep(params); start > 0) absl::StrAppend(&key, "/from", start);
  // Adapter names are [A-Za-z0-9._-] (checked where requests are validated); the scale's exact bits.
  if (mixes_adapters) return key;
  for (const auto& [name, scale] : params.loras) absl::StrAppend(&key, "/", name, "=", absl::bit_cast<uint32_t>(scale));
  return key;
}

BatchRun::BatchRun(const std::vector<BatchMember>& members)
    : members_(members), results_(members.size(), absl::InternalError("batch member did not run")) {
  for (size_t i = 0; i < members.size(); ++i) active_.push_back(i);
}

bool BatchRun::Compatible(bool mixes_adapters) {
  for (const BatchMember& m : members_) {
    if (!BatchCompatible(*m.params, *members_.front().params, mixes_adapters)) {
      for (auto& r : results_) {
        r = absl::InvalidArgumentError(mixes_adapters ? "batch members differ in image size or step count"
                                                      : "batch members differ in image size, step count or adapters");
      }
      active_.clear();
      return false;
    }
  }
  return true;
}

void BatchRun::Filter(const std::function<absl::Status(size_t)>& check) {
  std::vector<size_t> still;
  for (size_t i : active_) {
    absl::Status status = check(i);
    if (status.ok()) {
      still.push_back(i);
    } else {
      results_[i] = std::move(status);
    }
  }
  active_ = std::move(still);
}

void BatchRun::BeginStage(const std::string& stage, int total_steps) {
  for (size_t i : active_) members_[i].context->BeginStage(stage, total_steps);
}

std::vector<absl::StatusOr<Image>> Pipeline::RunBatch(const std::vector<BatchMember>& members,
                                                      ComponentRunner& runner) {
  std::vector<absl::StatusOr<Image>> results;
  results.reserve(members.size());
  for (const BatchMember& member : members) {
    absl::Status interrupted = member.context->CheckInterrupt();
    if (!interrupted.ok()) {
      results.push_back(interrupted);
      continue;
    }
    results.push_back(Run(*member.params, runner, *member.context));
  }
  return results;
}

absl::Status Pipeline::CheckSourceFiles() {
  for (Component* component : components()) {
    absl::Status status = component->CheckSourceFiles();
    if (!status.ok()) return status;
  }
  return absl::OkStatus();
}

void RunContext::ReportStep(int step, int total_steps) {
  if (progress_) progress_(current_stage_, step, total_steps);
}

void RunContext::set_previews(std::vector<int> steps, PreviewFn on_preview) {
  preview_steps_ = std::move(steps);
  on_preview_ = std::move(on_preview);
}

bool RunContext::WantsPreview(int step) const {
  return on_preview_ && std::find(preview_steps_.begin(), preview_steps_.end(), step) != preview_steps_.end();
}

void RunContext::Preview(int step, const Image& image) {
  if (on_preview_) on_preview_(previews_sent_++, step, image);
}

std::vector<int> PreviewSteps(int count, int steps) {
  std::vector<int> out;
  for (int j = 1; j <= count; ++j) {
    const int step = static_cast<int>((static_cast<int64_t>(steps) * j) / (count + 1));
    if (step >= 1 && step < steps && (out.empty() || step > out.back())) out.push_back(step);
  }
  return out;
}

void DeliverPreviews(ComponentRunner& runner, Component& vae, const std::vector<BatchMember>& members, int step,
                     const std::vector<std::pair<size_t, at::Tensor>>& latents,
                     const std::function<at::Tensor(const at::Tensor&)>& decode) {
  if (latents.empty()) return;
  std::vector<at::Tensor> pixels(latents.size());
  const absl::Status ran = runner.Run(vae, [&] {
    for (size_t k = 0; k < latents.size(); ++k) pixels[k] = decode(latents[k].second);
  });
  if (!ran.ok()) return;
  for (size_t k = 0; k < latents.size(); ++k) {
    absl::StatusOr<Image> image = ImageFromTensor(pixels[k]);
    if (image.ok()) members[latents[k].first].context->Preview(step, *image);
  }
}

}  // namespace stowage
