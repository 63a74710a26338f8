// PipelineRegistry: architecture name → loader. The server never names an architecture: it asks
// the registry for the one a model directory declares (model_index.json's "_class_name") or for a
// built-in by name. A new pipeline is one file in models/ and one Register call in
// DefaultPipelineRegistry() (pipeline_registry.cc).
//
// Thread-safety: a registry is immutable once built; DefaultPipelineRegistry() is built once and
// may be used from any thread. Loaders run on the caller's thread and must not touch a device:
// they build host-side components only (placement moves them later, on the device's worker).
#ifndef STOWAGE_MODELS_PIPELINE_REGISTRY_H_
#define STOWAGE_MODELS_PIPELINE_REGISTRY_H_

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/status/statusor.h"
#include "models/pipelines/component.h"
#include "models/pipelines/pipeline.h"

namespace stowage {

// What every loader takes, whatever its architecture.
struct PipelineLoadOptions {
  std::string name;                        // The hosted pipeline's name.
  at::ScalarType dtype = at::kFloat;       // Compute dtype of the components.
  uint64_t weight_seed = 0;                // Random-weights mode.
  // Random-weights mode: seeds of single components (ComponentSeed), e.g. a fine-tune's transformer.
  std::map<std::string, uint64_t> component_seeds;
  c10::Device device = c10::Device(c10::kCPU);  // Where inputs and latents are created.
  bool random_weights = false;             // Directory loads: read configs only, draw weights.
  int64_t default_size = 0;                // Default image width and height; 0: the architecture's.
  ComponentCache* cache = nullptr;         // Shares components loaded from the same folder.
  // Components whose transformer blocks run FP8 GEMMs (PipelineConfig.compute; the caller checked
  // the device). Architectures without FP8 support refuse a non-empty set.
  std::set<std::string> fp8_components;
  // Of those, the ones group-offloaded from an int4 host copy (PipelineConfig.group_offload): their
  // FP8 form is made with that copy, in one pass over the bf16 weights (ConvertBlockLinearsToFp8
  // deferred), instead of on the host at load.
  std::set<std::string> fp8_one_pass_components;
  // PipelineConfig.host_spill_dir: where host copies no model file holds are moved (empty: nowhere).
  std::string host_spill_dir;
};

struct PipelineArchitecture {
  // model_index.json "_class_name" values this architecture loads, e.g. {"ZImagePipeline"}.
  std::vector<std::string> class_names;
  // Built-in names ("zimage-tiny") this architecture creates without any files.
  std::vector<std::string> builtins;
  std::function<absl::StatusOr<std::unique_ptr<Pipeline>>(const std::string& dir,
                                                          const PipelineLoadOptions& options)>
      load_dir;
  std::function<absl::StatusOr<std::unique_ptr<Pipeline>>(const std::string& builtin,
                                                          const PipelineLoadOptions& options)>
      create_builtin;
};

class PipelineRegistry {
 public:
  // INVALID_ARGUMENT when a class name or built-in is already taken.
  absl::Status Register(PipelineArchitecture architecture);

  // Reads <dir>/model_index.json and loads it with the architecture its "_class_name" names.
  // INVALID_ARGUMENT (naming the file and the known classes) for an unknown or missing class.
  absl::StatusOr<std::unique_ptr<Pipeline>> LoadDirectory(const std::string& dir,
                                                          const PipelineLoadOptions& options) const;
  // NOT_FOUND-free: INVALID_ARGUMENT naming the known built-ins for an unknown one.
  absl::StatusOr<std::unique_ptr<Pipeline>> CreateBuiltin(const std::string& builtin,
                                                          const PipelineLoadOptions& options) const;

  bool HasBuiltin(const std::string& builtin) const { return builtins_.count(builtin) > 0; }
  std::vector<std::string> BuiltinNames() const;
  std::vector<std::string> ClassNames() const;

 private:
  std::vector<PipelineArchitecture> architectures_;
  std::map<std::string, size_t> by_class_;
  std::map<std::string, size_t> builtins_;
};

// Every architecture this build knows.
const PipelineRegistry& DefaultPipelineRegistry();

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINE_REGISTRY_H_
