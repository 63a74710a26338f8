// Flow-matching Euler scheduler, with the semantics of diffusers' FlowMatchEulerDiscreteScheduler
// (static shift, no dynamic shifting): sigmas fall from 1 towards 0, the model predicts a velocity
// v, and each step moves x by (sigma_next - sigma) * v.
#ifndef STOWAGE_MODELS_FLOW_MATCH_SCHEDULER_H_
#define STOWAGE_MODELS_FLOW_MATCH_SCHEDULER_H_

#include <vector>

#include <ATen/core/Tensor.h>

namespace stowage {

struct FlowMatchSchedulerConfig {
  int num_train_timesteps = 1000;
  double shift = 3.0;
};

class FlowMatchEulerScheduler {
 public:
  explicit FlowMatchEulerScheduler(const FlowMatchSchedulerConfig& config) : config_(config) {}

  // Prepares `steps` steps: steps + 1 sigmas (the last is 0) and `steps` timesteps
  // (sigma * num_train_timesteps).
  void SetTimesteps(int steps);
  const std::vector<double>& sigmas() const { return sigmas_; }
  const std::vector<double>& timesteps() const { return timesteps_; }

  // One Euler step from sigmas()[index] to sigmas()[index + 1]; computed in float32.
  at::Tensor Step(const at::Tensor& velocity, int index, const at::Tensor& sample) const;

 private:
  double Shift(double sigma) const;
  FlowMatchSchedulerConfig config_;
  std::vector<double> sigmas_;
  std::vector<double> timesteps_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_FLOW_MATCH_SCHEDULER_H_
