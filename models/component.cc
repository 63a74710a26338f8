#include "models/component.h"

#include "offload/status_macros.h"

namespace stowage {

absl::StatusOr<std::unique_ptr<Component>> Component::Create(std::string name,
                                                             std::unique_ptr<Module> root,
                                                             at::ScalarType dtype) {
  ASSIGN_OR_RETURN(std::unique_ptr<HostWeights> weights, HostWeights::Capture(*root));
  return std::unique_ptr<Component>(
      new Component(std::move(name), std::move(root), dtype, std::move(weights)));
}

Component::Component(std::string name, std::unique_ptr<Module> root, at::ScalarType dtype,
                     std::unique_ptr<HostWeights> host_weights)
    : name_(std::move(name)),
      root_(std::move(root)),
      dtype_(dtype),
      host_weights_(std::move(host_weights)) {}

std::string DtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return c10::toString(dtype);
  }
}

}  // namespace stowage
