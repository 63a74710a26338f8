// Diffusers-format model directories: model_index.json, one folder per component with config.json
// and safetensors weights (one file, or shards listed by *.safetensors.index.json), read through
// mmap without copies. JSON is parsed by protobuf's JSON support into google.protobuf.Struct.
//
//   <dir>/model_index.json            {"_class_name": ..., "transformer": ["diffusers", "Cls"], ...}
//   <dir>/<component>/config.json
//   <dir>/<component>/diffusion_pytorch_model.safetensors   (or model.safetensors, or shards +
//   <dir>/<component>/diffusion_pytorch_model.safetensors.index.json  {"weight_map": {name: file}})
#ifndef STOWAGE_MODELS_CORE_DIFFUSERS_FORMAT_H_
#define STOWAGE_MODELS_CORE_DIFFUSERS_FORMAT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/json_limits.h"
#include "google/protobuf/struct.pb.h"
#include "offload/module.h"
#include "offload/compression.h"
#include "offload/safetensors.h"

namespace stowage {

// Parses JSON text that must be an object, after CheckJsonLimits (so in time linear in its size);
// errors name `what` and never quote the text (protobuf's parse errors do, so they are dropped).
absl::StatusOr<google::protobuf::Struct> ParseJsonObject(absl::string_view text, const JsonLimits& limits,
                                                         absl::string_view what);
// Reads and parses a JSON file (ParseJsonObject; a file larger than limits.max_bytes is refused
// before it is read); errors name the file.
absl::StatusOr<google::protobuf::Struct> ReadJsonFile(const std::string& path,
                                                      const JsonLimits& limits = kConfigJsonLimits);
absl::Status WriteJsonFile(const std::string& path, const google::protobuf::Struct& value);

// Typed reads of config fields, with defaults (absent or null: the default); a present field of the
// wrong type is INVALID_ARGUMENT "<file>: <field> must be ...". Integers must be JSON numbers that
// are whole and within ±2^53 (so the conversion is exact and defined); ranges are the validators'.
absl::StatusOr<int64_t> ConfigInt(const google::protobuf::Struct& config, const std::string& field,
                                  int64_t default_value, absl::string_view file = "config");
absl::StatusOr<double> ConfigDouble(const google::protobuf::Struct& config, const std::string& field,
                                    double default_value, absl::string_view file = "config");
// At most kMaxConfigListSize entries.
absl::StatusOr<std::vector<int64_t>> ConfigIntList(const google::protobuf::Struct& config,
                                                   const std::string& field,
                                                   std::vector<int64_t> default_value,
                                                   absl::string_view file = "config");
// A boolean field (absent or null: the default).
absl::StatusOr<bool> ConfigBool(const google::protobuf::Struct& config, const std::string& field,
                                bool default_value, absl::string_view file = "config");
inline constexpr int kMaxConfigListSize = 64;

// The component names of model_index.json (keys that map to [library, class] pairs) and classes.
absl::StatusOr<std::map<std::string, std::string>> ReadModelIndex(const std::string& dir);

// All tensors of a component folder, zero-copy views into the mapped files (kept alive by the
// tensors). Errors name the file and the tensor. Shard names of an index must be plain file names
// in the folder ("*.safetensors", no '/'), at most kMaxShards of them.
inline constexpr int kMaxShards = 4096;
struct ComponentWeights {
  std::map<std::string, at::Tensor> tensors;
  // From 8-bit checkpoints (metadata "stowage_compress", offload/compressed_safetensors.h): the
  // quantized tensors by name, dequantized to the model's dtype when bound; one format per component.
  std::shared_ptr<PrequantizedWeights> quantized;
  CompressFormat format = CompressFormat::kNone;
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
// names carry a "model." prefix, and, for a module whose tensors all sit under one top-level child
// (CLIPTextModel's "text_model."), checkpoints that leave that child's name out (transformers 5).
// An 8-bit checkpoint's quantized tensors are dequantized into the module; with `quantization`, they
// are also handed back (for Component::set_prequantized), else dropped after binding.
struct CheckpointQuantization {
  std::shared_ptr<const PrequantizedWeights> weights;  // Null: the folder holds no 8-bit file.
  CompressFormat format = CompressFormat::kNone;
};
absl::Status LoadComponentWeights(Module& root, const std::string& component_dir, at::ScalarType dtype,
                                  const std::vector<std::string>& ignored_prefixes = {},
                                  CheckpointQuantization* quantization = nullptr);

// Writes `root`'s tensors as <dir>/diffusion_pytorch_model.safetensors (sharded into files of at
// most `max_shard_bytes` with an index when larger; 0: one file) and `config` as config.json.
absl::Status SaveComponent(Module& root, const std::string& dir, const google::protobuf::Struct& config,
                           int64_t max_shard_bytes = 0);
// The same for modules that share one folder (a VAE's decoder and encoder components): their
// tensors together, in order.
absl::Status SaveComponent(const std::vector<Module*>& roots, const std::string& dir,
                           const google::protobuf::Struct& config, int64_t max_shard_bytes = 0);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_DIFFUSERS_FORMAT_H_
