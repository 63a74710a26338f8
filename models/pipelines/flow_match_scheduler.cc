#include "models/pipelines/flow_match_scheduler.h"

#include <ATen/ATen.h>

#include "base/status_macros.h"
#include "models/core/config_checks.h"
#include "models/core/diffusers_format.h"

namespace stowage {

absl::StatusOr<FlowMatchSchedulerConfig> FlowMatchSchedulerConfigFromJson(const google::protobuf::Struct& json,
                                                                          const FlowMatchSchedulerConfig& defaults,
                                                                          const std::string& file) {
  FlowMatchSchedulerConfig c = defaults;
  ASSIGN_OR_RETURN(const int64_t steps, ConfigInt(json, "num_train_timesteps", c.num_train_timesteps, file));
  ConfigCheck check(file);
  check.Range("num_train_timesteps", steps, 1, kMaxConfigDim);  // Before narrowing to int.
  RETURN_IF_ERROR(check.status());
  c.num_train_timesteps = static_cast<int>(steps);
  ASSIGN_OR_RETURN(c.shift, ConfigDouble(json, "shift", c.shift, file));
  RETURN_IF_ERROR(Validate(c, file));
  return c;
}

absl::Status Validate(const FlowMatchSchedulerConfig& c, const std::string& file) {
  ConfigCheck check(file);
  check.Range("num_train_timesteps", c.num_train_timesteps, 1, kMaxConfigDim).Above("shift", c.shift, 0.0, 1e4);
  return check.status();
}

std::vector<float> ShiftedSigmas(int n, double shift) {
  const at::Tensor base = at::linspace(1.0, 1.0 / n, n, at::TensorOptions().dtype(at::kFloat));
  const float s = static_cast<float>(shift);
  const at::Tensor shifted = (base * s) / (1.0f + (s - 1.0f) * base);
  std::vector<float> sigmas(shifted.data_ptr<float>(), shifted.data_ptr<float>() + n);
  sigmas.push_back(0.0f);
  return sigmas;
}

double FlowMatchEulerScheduler::Shift(double sigma) const {
  return config_.shift * sigma / (1.0 + (config_.shift - 1.0) * sigma);
}

void FlowMatchEulerScheduler::SetTimesteps(int steps) {
  const double n = config_.num_train_timesteps;
  // As diffusers does: the training schedule's shifted end points, a linear ramp between them in
  // timestep space, then the shift applied to the ramp.
  const double sigma_max = Shift(1.0);
  const double sigma_min = Shift(1.0 / n);
  const double t_max = sigma_max * n;
  const double t_min = sigma_min * n;
  sigmas_.clear();
  timesteps_.clear();
  for (int i = 0; i < steps; ++i) {
    const double t = steps == 1 ? t_max : t_max + (t_min - t_max) * i / (steps - 1);
    const double sigma = Shift(t / n);
    sigmas_.push_back(sigma);
    timesteps_.push_back(sigma * n);
  }
  sigmas_.push_back(0.0);
}

at::Tensor FlowMatchEulerScheduler::Step(const at::Tensor& velocity, int index,
                                         const at::Tensor& sample) const {
  return EulerStep(sample, velocity, sigmas_.at(index + 1) - sigmas_.at(index));
}

at::Tensor EulerStep(const at::Tensor& sample, const at::Tensor& velocity, double dt) {
  return sample.to(at::kFloat) + velocity.to(at::kFloat) * dt;
}

}  // namespace stowage
