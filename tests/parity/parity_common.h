// What the parity checks (zimage_parity_check, flux_parity_check) share: one line per check with its
// error and tolerance, relative L2 error, reading a fixture's tensors, and building a module from a
// diffusers-format component folder.
#ifndef STOWAGE_TESTS_PARITY_PARITY_COMMON_H_
#define STOWAGE_TESTS_PARITY_PARITY_COMMON_H_

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/status/statusor.h"
#include "base/status_macros.h"
#include "models/pipelines/component.h"
#include "models/core/diffusers_format.h"
#include "models/core/layers.h"
#include "models/core/lora.h"
#include "offload/safetensors.h"

namespace stowage::parity {

inline int failures = 0;

inline void Report(const std::string& check, double error, double tolerance) {
  const bool ok = std::isfinite(error) && error <= tolerance;
  if (!ok) ++failures;
  std::printf("%-34s error %.3g (tolerance %.1g) %s\n", check.c_str(), error, tolerance, ok ? "ok" : "FAIL");
}

inline void Fail(const std::string& check, const absl::Status& status) {
  ++failures;
  std::printf("%-34s FAIL: %s\n", check.c_str(), std::string(status.message()).c_str());
}

inline double RelativeError(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kDouble), w = want.to(at::kDouble);
  return (g - w).norm().item<double>() / std::max(w.norm().item<double>(), 1e-30);
}

inline absl::StatusOr<std::map<std::string, at::Tensor>> ReadAll(const std::string& path) {
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  std::map<std::string, at::Tensor> out;
  for (const auto& entry : file->tensors()) {
    ASSIGN_OR_RETURN(at::Tensor t, file->Get(entry.first));
    out[entry.first] = t.clone();
  }
  return out;
}

template <typename T, typename Config>
absl::StatusOr<std::unique_ptr<T>> Build(const Config& config, const std::string& dir, at::ScalarType dtype,
                                         const std::vector<std::string>& ignored = {}) {
  auto module = std::make_unique<T>(config, LayerOptions{dtype});
  RETURN_IF_ERROR(LoadComponentWeights(*module, dir, dtype, ignored));
  return module;
}

// Attaches `file`'s layers of `component` to `model`'s Linear layers under `key`: the number
// attached, or NOT_FOUND naming a layer the model lacks.
inline absl::StatusOr<int> AttachLoraLayers(Module& model, const LoraFile& file, const std::string& component,
                                            const std::string& key) {
  std::map<std::string, Linear*> linears;
  model.ForEachModule([&](Module& m) {
    if (auto* l = dynamic_cast<Linear*>(&m)) linears[m.path()] = l;
  });
  int attached = 0;
  for (const auto& [path, weights] : file.layers.at(component)) {
    auto it = linears.find(path);
    if (it == linears.end()) {
      return absl::NotFoundError("the adapter's layer " + path + " is no Linear of the " + component);
    }
    RETURN_IF_ERROR(it->second->AttachLora(key, weights));
    ++attached;
  }
  return attached;
}

// Runs components on the CPU with their weights pointing at the host copies.
class HostRunner : public ComponentRunner {
 public:
  absl::Status Run(Component& c, const std::function<void()>& fn) override {
    c.host_weights().PointAtHost();
    return CatchAsStatus(c.name(), fn);
  }
};

// An image's 8-bit pixels as [3, H, W] floats in [0, 1], as diffusers' output_type="pt" has them.
template <typename Image>
at::Tensor ImageAsTensor(Image& image) {
  return at::from_blob(image.rgb.data(), {image.height, image.width, 3}, at::kByte).permute({2, 0, 1}).to(at::kFloat) /
         255.0;
}

// Runs each named check, catching what LibTorch throws; prints the verdict line; the exit status.
inline int RunChecks(const std::string& root,
                     const std::vector<std::pair<std::string, absl::Status (*)(const std::string&)>>& checks) {
  for (const auto& entry : checks) {
    const std::string& name = entry.first;
    const auto check = entry.second;
    const absl::Status status = CatchAsStatus(name, [&] {
      const absl::Status inner = check(root);
      if (!inner.ok()) Fail(name, inner);
    });
    if (!status.ok()) Fail(name, status);
  }
  std::printf("%s\n", failures == 0 ? "parity: all checks passed" : "parity: FAILED");
  return failures == 0 ? 0 : 1;
}

}  // namespace stowage::parity

#endif  // STOWAGE_TESTS_PARITY_PARITY_COMMON_H_
