// MakeComponent: one architecture component built from its validated config and filled from its
// diffusers-format folder (or with deterministic random weights), wrapped as a placement Component.
// Shared by the pipelines' loaders (Z-Image, Flux).
#ifndef STOWAGE_MODELS_PIPELINES_COMPONENT_FACTORY_H_
#define STOWAGE_MODELS_PIPELINES_COMPONENT_FACTORY_H_

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "models/pipelines/component.h"
#include "models/core/diffusers_format.h"
#include "models/core/layers.h"
#include "models/core/weight_init.h"

namespace stowage {

// T is the module, built as T(config, LayerOptions{dtype}); `Validate(config, file)` runs first (the
// config's own validator, found by overload). `dir` empty means a built-in config (no files);
// `ignored` lists state-dict prefixes the module does not use (e.g. a VAE's encoder).
//
// `fp8`: the linear layers of its transformer blocks are converted to FP8 after loading
// (ConvertBlockLinearsToFp8, on the host: the converted copies replace the loaded ones), and the
// component reports compute() "fp8". FAILED_PRECONDITION when the component has no such layers.
//
// `host_spill_dir` not empty: the host tensors no model file holds (random or converted weights)
// are then moved into a file there, mapped in their place (offload/host_spill.h); its errors name
// pipeline.host_spill_dir.
//
// `fp8_one_pass` (with `fp8`): the FP8 form of weights in a file's mapping is declared, not computed
// (ConvertBlockLinearsToFp8 deferred): the component's int4 host copy is made from the loaded bf16
// weights in one pass, on the device (offload/host_weights.h, deferred FP8 weights); anything else
// that reads the host copies first (a resident onload) has HostWeights write the FP8 form on the host
// then — into RAM, not into host_spill_dir. Drawn (random) weights move into host_spill_dir first
// when there is one, and are converted at once when there is none.
template <typename T, typename Config>
absl::StatusOr<std::unique_ptr<Component>> MakeComponent(const std::string& name, const Config& config,
                                                         at::ScalarType dtype, const std::string& dir,
                                                         bool random_weights, uint64_t seed,
                                                         const std::vector<std::string>& ignored, bool fp8 = false,
                                                         const std::string& host_spill_dir = "",
                                                         bool fp8_one_pass = false) {
  RETURN_IF_ERROR(Validate(config, dir.empty() ? absl::StrCat("built-in ", name, " config")
                                               : absl::StrCat(dir, "/config.json")));
  std::unique_ptr<T> module;
  RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("building ", name), [&] {
    module = std::make_unique<T>(config, LayerOptions{dtype});
  }));
  CheckpointQuantization quantization;
  if (random_weights) {
    InitializeRandomWeights(*module, seed);
  } else {
    RETURN_IF_ERROR(LoadComponentWeights(*module, dir, dtype, ignored, &quantization));
  }
  auto spill = [&](Module& m) { return SpillComponentHostCopies(m, host_spill_dir, name); };
  if (fp8) {
    absl::StatusOr<int64_t> converted = absl::InternalError("not converted");
    // With a spill directory each block's FP8 copies leave RAM before the next block converts, so
    // the conversion never holds the whole component's.
    std::function<absl::Status(Module&)> after_block;
    if (!host_spill_dir.empty()) after_block = spill;
    // One pass declares only weights in a file's mapping: drawn weights move into the spill file first.
    if (fp8_one_pass && !host_spill_dir.empty()) RETURN_IF_ERROR(spill(*module));
    RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("converting ", name, " to FP8"),
                                  [&] { converted = ConvertBlockLinearsToFp8(*module, after_block, fp8_one_pass); }));
    RETURN_IF_ERROR(converted.status());
    if (*converted == 0) {
      return absl::FailedPreconditionError(absl::StrCat("compute FP8: component '", name, "' (", module->kind(),
                                                        ") has no transformer blocks with linear layers"));
    }
  }
  if (!host_spill_dir.empty()) RETURN_IF_ERROR(spill(*module));
  ASSIGN_OR_RETURN(std::unique_ptr<Component> component, Component::Create(name, std::move(module), dtype));
  if (fp8) component->set_compute("fp8");
  // An 8-bit checkpoint: 8-bit group offloading in its format streams its bytes as stored.
  if (quantization.weights != nullptr) component->set_prequantized(quantization.weights, quantization.format);
  return component;
}

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_COMPONENT_FACTORY_H_
