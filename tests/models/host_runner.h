// A ComponentRunner for model tests: runs components on the CPU with their weights pointing at the
// host copies, and records the order in which they ran.
#ifndef STOWAGE_TESTS_MODELS_HOST_RUNNER_H_
#define STOWAGE_TESTS_MODELS_HOST_RUNNER_H_

#include <functional>
#include <string>
#include <vector>

#include "models/pipelines/component.h"
#include "base/status_macros.h"

namespace stowage {

class HostRunner : public ComponentRunner {
 public:
  absl::Status Run(Component& component, const std::function<void()>& fn) override {
    component.host_weights().PointAtHost();
    calls.push_back(component.name());
    return CatchAsStatus(component.name(), fn);
  }
  std::vector<std::string> calls;
};

}  // namespace stowage

#endif  // STOWAGE_TESTS_MODELS_HOST_RUNNER_H_
