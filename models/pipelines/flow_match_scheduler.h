// Flow-matching Euler scheduler, with the semantics of diffusers' FlowMatchEulerDiscreteScheduler
// (static shift, no dynamic shifting): sigmas fall from 1 towards 0, the model predicts a velocity
// v, and each step moves x by (sigma_next - sigma) * v.
#ifndef STOWAGE_MODELS_PIPELINES_FLOW_MATCH_SCHEDULER_H_
#define STOWAGE_MODELS_PIPELINES_FLOW_MATCH_SCHEDULER_H_

#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"

namespace stowage {

struct FlowMatchSchedulerConfig {
  int num_train_timesteps = 1000;
  double shift = 3.0;
};

// Reads num_train_timesteps and shift from a scheduler_config.json (absent fields keep
// `defaults`') and validates them; `file` names it in errors.
absl::StatusOr<FlowMatchSchedulerConfig> FlowMatchSchedulerConfigFromJson(
    const google::protobuf::Struct& json, const FlowMatchSchedulerConfig& defaults,
    const std::string& file = "scheduler/scheduler_config.json");

// num_train_timesteps in [1, 2^20] (sigmas divide by it); shift finite in (0, 1e4] (the shift
// formula divides by 1 + (shift - 1) * sigma, zero at shift 0 and sigma 1).
absl::Status Validate(const FlowMatchSchedulerConfig& config, const std::string& file);

// The sigmas diffusers' Z-Image and Flux.1 [schnell] pipelines step through with a fixed shift:
// linspace(1, 1/n, n) shifted as shift·s / (1 + (shift − 1)·s) in float32 arithmetic, then a final 0
// (n + 1 values). (Flux.1 [dev]'s resolution-dependent shift: FluxSigmas in flux_latents.h.)
std::vector<float> ShiftedSigmas(int n, double shift);

// The Euler step of every flow-matching pipeline: sample + dt · velocity, both widened to float32
// first, the result in float32 (a caller keeping latents in another dtype casts it back). With dt =
// 0 − sigma it gives the clean sample the velocity predicts (a preview's latents).
at::Tensor EulerStep(const at::Tensor& sample, const at::Tensor& velocity, double dt);

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

#endif  // STOWAGE_MODELS_PIPELINES_FLOW_MATCH_SCHEDULER_H_
