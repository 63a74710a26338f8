#include "models/pipelines/component.h"

#include <climits>
#include <cstdlib>

#include "absl/strings/str_cat.h"

#include "base/status_macros.h"

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

absl::StatusOr<std::shared_ptr<Component>> ComponentCache::GetOrLoad(const std::string& key,
                                                                    const Loader& load) {
  {
    absl::MutexLock lock(&mu_);
    auto it = components_.find(key);
    if (it != components_.end()) {
      if (std::shared_ptr<Component> existing = it->second.lock()) return existing;
    }
  }
  ASSIGN_OR_RETURN(std::unique_ptr<Component> loaded, load());
  std::shared_ptr<Component> shared = std::move(loaded);
  absl::MutexLock lock(&mu_);
  // Another thread may have loaded it meanwhile: keep the first, drop this copy.
  auto& slot = components_[key];
  if (std::shared_ptr<Component> existing = slot.lock()) return existing;
  slot = shared;
  return shared;
}

absl::StatusOr<std::shared_ptr<Component>> LoadMaybeShared(ComponentCache* cache, const std::string& key,
                                                           const ComponentCache::Loader& load) {
  if (cache != nullptr) return cache->GetOrLoad(key, load);
  ASSIGN_OR_RETURN(std::unique_ptr<Component> component, load());
  return std::shared_ptr<Component>(std::move(component));
}

std::string ComponentCacheKey(const std::string& component_dir, at::ScalarType dtype, bool random_weights,
                              uint64_t seed, const std::string& compute) {
  char resolved[PATH_MAX];
  const std::string path = ::realpath(component_dir.c_str(), resolved) != nullptr ? resolved : component_dir;
  return absl::StrCat(path, "|", DtypeName(dtype), compute.empty() ? "" : absl::StrCat("|", compute),
                      random_weights ? absl::StrCat("|random:", seed) : "");
}

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
