#include "models/pipelines/pipeline.h"

namespace stowage {

RunContext::RunContext(std::function<absl::Status()> interrupt,
                       std::function<void(const std::string&, int, int)> progress)
    : interrupt_(std::move(interrupt)), progress_(std::move(progress)) {}

void RunContext::BeginStage(const std::string& stage, int total_steps) {
  EndStage();
  current_stage_ = stage;
  current_shared_ = shared_;
  stage_start_ = absl::Now();
  if (progress_) progress_(stage, 0, total_steps);
}

void RunContext::EndStage() {
  if (current_stage_.empty()) return;
  stage_times_.push_back(StageTime{current_stage_, absl::Now() - stage_start_, current_shared_});
  current_stage_.clear();
}

bool BatchCompatible(const GenerationParams& a, const GenerationParams& b) {
  return a.width == b.width && a.height == b.height && a.steps == b.steps;
}

BatchRun::BatchRun(const std::vector<BatchMember>& members)
    : members_(members), results_(members.size(), absl::InternalError("batch member did not run")) {
  for (size_t i = 0; i < members.size(); ++i) active_.push_back(i);
}

bool BatchRun::Compatible() {
  for (const BatchMember& m : members_) {
    if (!BatchCompatible(*m.params, *members_.front().params)) {
      for (auto& r : results_) r = absl::InvalidArgumentError("batch members differ in image size or step count");
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

}  // namespace stowage
