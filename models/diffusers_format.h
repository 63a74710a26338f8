// Diffusers-format model directories: model_index.json, one folder per component with config.json
// and safetensors weights (one file, or shards listed by *.safetensors.index.json), read through
// mmap without copies. JSON is parsed by protobuf's JSON support into google.protobuf.Struct.
//
//   <dir>/model_index.json            {"_class_name": ..., "transformer": ["diffusers", "Cls"], ...}
//   <dir>/<component>/config.json
//   <dir>/<component>/diffusion_pytorch_model.safetensors   (or model.safetensors, or shards +
//   <dir>/<component>/diffusion_pytorch_model.safetensors.index.json  {"weight_map": {name: file}})
#ifndef STOWAGE_MODELS_DIFFUSERS_FORMAT_H_
#define STOWAGE_MODELS_DIFFUSERS_FORMAT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "offload/module.h"
#include "offload/safetensors.h"

namespace stowage {

// Parses a JSON file; errors name the file.
absl::StatusOr<google::protobuf::Struct> ReadJsonFile(const std::string& path);
absl::Status WriteJsonFile(const std::string& path, const google::protobuf::Struct& value);

// Typed reads of config fields, with defaults; a present field of the wrong type is an error naming
// the file's role and the field.
absl::StatusOr<int64_t> ConfigInt(const google::protobuf::Struct& config, const std::string& field,
                                  int64_t default_value);
absl::StatusOr<double> ConfigDouble(const google::protobuf::Struct& config, const std::string& field,
                                    double default_value);
absl::StatusOr<std::vector<int64_t>> ConfigIntList(const google::protobuf::Struct& config,
                                                   const std::string& field,
                                                   std::vector<int64_t> default_value);

// The component names of model_index.json (keys that map to [library, class] pairs) and classes.
absl::StatusOr<std::map<std::string, std::string>> ReadModelIndex(const std::string& dir);

// All tensors of a component folder, zero-copy views into the mapped files (kept alive by the
// tensors). Errors name the file and the tensor.
struct ComponentWeights {
  std::map<std::string, at::Tensor> tensors;
  std::map<std::string, std::string> file_of;  // Tensor name → file it came from.
  std::vector<std::shared_ptr<SafetensorsFile>> files;  // The mapped files, for CheckUnchanged.
};
absl::StatusOr<ComponentWeights> ReadComponentWeights(const std::string& component_dir);

// Points every tensor slot of `root` at the tensor of the same dotted name. Shapes must match;
// a dtype other than `dtype` is converted (a copy) — a matching dtype is used in place. Missing and
// unexpected names are errors listing them (first 10), naming `component_dir`.
// Names starting with one of `ignored_prefixes` (e.g. "encoder." of a VAE used only to decode) are
// neither bound nor reported as unexpected.
absl::Status BindWeights(Module& root, const ComponentWeights& weights, at::ScalarType dtype,
                         const std::string& component_dir,
                         const std::vector<std::string>& ignored_prefixes = {});

// ReadComponentWeights + BindWeights for a component folder, accepting transformers checkpoints whose
// names carry a "model." prefix.
absl::Status LoadComponentWeights(Module& root, const std::string& component_dir, at::ScalarType dtype,
                                  const std::vector<std::string>& ignored_prefixes = {});

// Writes `root`'s tensors as <dir>/diffusion_pytorch_model.safetensors (sharded into files of at
// most `max_shard_bytes` with an index when larger; 0: one file) and `config` as config.json.
absl::Status SaveComponent(Module& root, const std::string& dir, const google::protobuf::Struct& config,
                           int64_t max_shard_bytes = 0);

}  // namespace stowage

#endif  // STOWAGE_MODELS_DIFFUSERS_FORMAT_H_
