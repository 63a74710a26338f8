#include "models/flow_match_scheduler.h"

#include <ATen/ATen.h>

namespace stowage {

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
  const double dt = sigmas_.at(index + 1) - sigmas_.at(index);
  return sample.to(at::kFloat) + velocity.to(at::kFloat) * dt;
}

}  // namespace stowage
