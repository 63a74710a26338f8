#include "models/core/diffusers_format.h"


#include <sys/stat.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/match.h"
#include "google/protobuf/util/json_util.h"
#include "base/load_progress.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "offload/compressed_safetensors.h"

namespace stowage {
namespace {

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string List(const std::vector<std::string>& names) {
  std::vector<std::string> first;
  for (size_t i = 0; i < std::min<size_t>(10, names.size()); ++i) first.push_back(Truncated(names[i]));
  std::string text = absl::StrJoin(first, ", ");
  if (names.size() > 10) absl::StrAppend(&text, ", … (", names.size(), " in all)");
  return text;
}

}  // namespace

absl::StatusOr<google::protobuf::Struct> ParseJsonObject(absl::string_view text, const JsonLimits& limits,
                                                         absl::string_view what) {
  RETURN_IF_ERROR(CheckJsonLimits(text, limits, what));
  google::protobuf::Struct value;
  const auto status = google::protobuf::util::JsonStringToMessage(std::string(text), &value);
  if (!status.ok()) {
    // protobuf's message quotes the input around the error: name the file only.
    return absl::InvalidArgumentError(absl::StrCat(what, ": not a valid JSON object"));
  }
  return value;
}

absl::StatusOr<google::protobuf::Struct> ReadJsonFile(const std::string& path, const JsonLimits& limits) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat("'", path, "' is not a regular file"));
  if (st.st_size > limits.max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": JSON of ", st.st_size, " bytes exceeds the limit of ",
                                                   limits.max_bytes, " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read '", path, "'"));
  std::stringstream text;
  text << in.rdbuf();
  return ParseJsonObject(text.str(), limits, path);
}

absl::Status WriteJsonFile(const std::string& path, const google::protobuf::Struct& value) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.add_whitespace = true;
  if (!google::protobuf::util::MessageToJsonString(value, &json, options).ok()) {
    return absl::InternalError("cannot serialise JSON");
  }
  std::ofstream out(path, std::ios::trunc);
  out << json;
  if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", path, "'"));
  return absl::OkStatus();
}

namespace {

constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

bool AsInteger(const google::protobuf::Value& value, int64_t* out) {
  if (!value.has_number_value()) return false;
  const double d = value.number_value();
  if (!(std::fabs(d) <= kMaxExactInteger) || d != std::floor(d)) return false;  // Also NaN, inf.
  *out = static_cast<int64_t>(d);
  return true;
}

absl::Status FieldError(absl::string_view file, const std::string& field, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", field, " ", why));
}

}  // namespace

absl::StatusOr<int64_t> ConfigInt(const google::protobuf::Struct& config, const std::string& field,
                                  int64_t default_value, absl::string_view file) {
  auto it = config.fields().find(field);
  if (it == config.fields().end() || it->second.has_null_value()) return default_value;
  int64_t value = 0;
  if (!AsInteger(it->second, &value)) return FieldError(file, field, "must be an integer (a whole JSON number)");
  return value;
}

absl::StatusOr<double> ConfigDouble(const google::protobuf::Struct& config, const std::string& field,
                                    double default_value, absl::string_view file) {
  auto it = config.fields().find(field);
  if (it == config.fields().end() || it->second.has_null_value()) return default_value;
  if (!it->second.has_number_value() || !std::isfinite(it->second.number_value())) {
    return FieldError(file, field, "must be a finite number");
  }
  return it->second.number_value();
}

absl::StatusOr<std::vector<int64_t>> ConfigIntList(const google::protobuf::Struct& config,
                                                   const std::string& field,
                                                   std::vector<int64_t> default_value, absl::string_view file) {
  auto it = config.fields().find(field);
  if (it == config.fields().end() || it->second.has_null_value()) return default_value;
  if (!it->second.has_list_value()) return FieldError(file, field, "must be a list of integers");
  if (it->second.list_value().values_size() > kMaxConfigListSize) {
    return FieldError(file, field, absl::StrCat("has ", it->second.list_value().values_size(),
                                                " entries; at most ", kMaxConfigListSize));
  }
  std::vector<int64_t> out;
  for (const auto& v : it->second.list_value().values()) {
    int64_t value = 0;
    if (!AsInteger(v, &value)) return FieldError(file, field, "must be a list of integers");
    out.push_back(value);
  }
  return out;
}

absl::StatusOr<bool> ConfigBool(const google::protobuf::Struct& config, const std::string& field,
                                bool default_value, absl::string_view file) {
  auto it = config.fields().find(field);
  if (it == config.fields().end() || it->second.has_null_value()) return default_value;
  if (!it->second.has_bool_value()) return FieldError(file, field, "must be true or false");
  return it->second.bool_value();
}

absl::StatusOr<std::map<std::string, std::string>> ReadModelIndex(const std::string& dir) {
  ASSIGN_OR_RETURN(google::protobuf::Struct index, ReadJsonFile(absl::StrCat(dir, "/model_index.json")));
  std::map<std::string, std::string> components;
  for (const auto& [name, value] : index.fields()) {
    if (name.empty() || name[0] == '_' || !value.has_list_value()) continue;
    const auto& pair = value.list_value().values();
    if (pair.size() == 2 && pair[1].has_string_value()) components[name] = pair[1].string_value();
  }
  return components;
}

absl::StatusOr<ComponentWeights> ReadComponentWeights(const std::string& component_dir) {
  std::vector<std::string> files;
  for (const std::string base : {"diffusion_pytorch_model", "model"}) {
    const std::string single = absl::StrCat(component_dir, "/", base, ".safetensors");
    const std::string index = absl::StrCat(component_dir, "/", base, ".safetensors.index.json");
    if (Exists(index)) {
      ASSIGN_OR_RETURN(google::protobuf::Struct map, ReadJsonFile(index));
      auto it = map.fields().find("weight_map");
      if (it == map.fields().end() || !it->second.has_struct_value()) {
        return absl::InvalidArgumentError(absl::StrCat("'", index, "' has no weight_map"));
      }
      std::set<std::string> shards;
      for (const auto& [tensor, file] : it->second.struct_value().fields()) {
        // A shard must be a file of this folder: no paths ("../..."), nothing but safetensors.
        const std::string& shard = file.string_value();
        if (!file.has_string_value() || shard.empty() || shard.size() > 255 ||
            shard.find('/') != std::string::npos || shard.find('\0') != std::string::npos ||
            !absl::EndsWith(shard, ".safetensors")) {
          return absl::InvalidArgumentError(absl::StrCat(index, ": weight_map entry of tensor '", Truncated(tensor),
                                                         "' is not a *.safetensors file name in the folder"));
        }
        shards.insert(shard);
        if (shards.size() > static_cast<size_t>(kMaxShards)) {
          return absl::InvalidArgumentError(absl::StrCat(index, ": more than ", kMaxShards, " shards"));
        }
      }
      for (const std::string& shard : shards) files.push_back(absl::StrCat(component_dir, "/", shard));
      break;
    }
    if (Exists(single)) {
      files.push_back(single);
      break;
    }
  }
  if (files.empty()) {
    return absl::NotFoundError(absl::StrCat("no safetensors weights in '", component_dir,
                                            "' (diffusion_pytorch_model.safetensors, model.safetensors, "
                                            "or a *.safetensors.index.json)"));
  }
  ComponentWeights weights;
  std::vector<std::string> unscaled;  // fp8 weights whose scale was not in their own shard.
  for (const std::string& path : files) {
    ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
    weights.files.push_back(file);
    AddLoadBytesTotal(file->data_bytes());
    if (file->metadata().count(kCompressMetadataKey) > 0 || HoldsFloat8(*file)) {
      // An 8-bit checkpoint (this server's convention, or a common fp8 layout): read (and checked)
      // as a whole, into RAM.
      ASSIGN_OR_RETURN(CompressedCheckpoint checkpoint, ReadCompressedSafetensors(path));
      if (weights.format != CompressFormat::kNone && weights.format != checkpoint.format) {
        return absl::InvalidArgumentError(absl::StrCat("'", component_dir, "' mixes 8-bit formats across its files"));
      }
      weights.format = checkpoint.format;
      if (weights.quantized == nullptr) weights.quantized = std::make_shared<PrequantizedWeights>();
      auto add = [&](const std::string& name) -> absl::Status {
        if (weights.tensors.count(name) > 0 || weights.quantized->count(name) > 0) {
          return absl::InvalidArgumentError(absl::StrCat("tensor '", Truncated(name), "' appears in both '",
                                                         weights.file_of[name], "' and '", path, "'"));
        }
        weights.file_of[name] = path;
        return absl::OkStatus();
      };
      for (auto& [name, q] : checkpoint.quantized) {
        RETURN_IF_ERROR(add(name));
        (*weights.quantized)[name] = q;
      }
      for (auto& [name, t] : checkpoint.plain) {
        RETURN_IF_ERROR(add(name));
        weights.tensors[name] = t;
      }
      unscaled.insert(unscaled.end(), checkpoint.unscaled.begin(), checkpoint.unscaled.end());
      continue;
    }
    for (const auto& [name, info] : file->tensors()) {
      if (weights.tensors.count(name) > 0 || (weights.quantized != nullptr && weights.quantized->count(name) > 0)) {
        return absl::InvalidArgumentError(absl::StrCat("tensor '", Truncated(name), "' appears in both '",
                                                       weights.file_of[name], "' and '", path, "'"));
      }
      ASSIGN_OR_RETURN(at::Tensor tensor, file->Get(name));
      weights.tensors[name] = tensor;
      weights.file_of[name] = path;
    }
  }
  if (weights.format == CompressFormat::kFp8E4M3 && weights.quantized != nullptr) {
    // A sharded fp8 checkpoint may keep a weight's scale in another shard than the weight.
    for (const std::string& name : unscaled) {
      QuantizedTensor& q = weights.quantized->at(name);
      for (const std::string& scale_name : Float8ScaleNames(name)) {
        auto it = weights.tensors.find(scale_name);
        if (it == weights.tensors.end()) continue;
        absl::StatusOr<at::Tensor> channels = Float8ChannelScales(it->second, q.q.size(0), scale_name);
        if (!channels.ok()) {
          return absl::InvalidArgumentError(absl::StrCat("'", weights.file_of[scale_name], "': ", channels.status().message(),
                                                         " (of F8_E4M3 tensor '", Truncated(name), "')"));
        }
        q.scale = *channels;
        weights.tensors.erase(it);
        break;
      }
    }
    // Activation scales and markers of the fp8 layouts, in shards without F8 tensors.
    for (auto it = weights.tensors.begin(); it != weights.tensors.end();) {
      it = IsFloat8Auxiliary(it->first) ? weights.tensors.erase(it) : std::next(it);
    }
  }
  return weights;
}

absl::Status BindWeights(Module& root, const ComponentWeights& weights, at::ScalarType dtype,
                         const std::string& component_dir,
                         const std::vector<std::string>& ignored_prefixes) {
  std::vector<std::string> missing;
  std::set<std::string> used;
  absl::Status status;
  root.ForEachSlot([&](Module& module, TensorSlot& slot) {
    if (!status.ok()) return;
    const std::string name = module.SlotPath(slot);
    auto it = weights.tensors.find(name);
    const QuantizedTensor* quantized = nullptr;
    if (it == weights.tensors.end() && weights.quantized != nullptr) {
      auto q = weights.quantized->find(name);
      if (q != weights.quantized->end()) quantized = &q->second;
    }
    if (it == weights.tensors.end() && quantized == nullptr) {
      missing.push_back(name);
      return;
    }
    used.insert(name);
    const at::Tensor source = quantized != nullptr ? quantized->q : it->second;
    if (slot.value.defined() && source.sizes() != slot.value.sizes()) {
      std::ostringstream expected, got;
      expected << slot.value.sizes();
      got << source.sizes();
      status = absl::InvalidArgumentError(absl::StrCat("tensor '", Truncated(name), "' in '", weights.file_of.at(name),
                                                       "' has shape ", got.str(), "; the model needs ",
                                                       expected.str()));
      return;
    }
    // A float weight stored as integers (or the reverse) is not a weight of this model, whatever its
    // bytes: converting it would silently load garbage.
    if (quantized == nullptr && slot.value.defined() &&
        at::isFloatingType(slot.value.scalar_type()) != at::isFloatingType(source.scalar_type())) {
      status = absl::InvalidArgumentError(absl::StrCat(
          "tensor '", Truncated(name), "' in '", weights.file_of.count(name) ? weights.file_of.at(name) : component_dir,
          "' is ", c10::toString(source.scalar_type()), "; the model needs ",
          at::isFloatingType(slot.value.scalar_type()) ? "a floating-point tensor (F32, F16 or BF16)" : "an integer tensor"));
      return;
    }
    if (quantized != nullptr) {
      slot.value = Dequantize(*quantized, weights.format, dtype);  // The compute-dtype host copy.
    } else {
      slot.value = source.scalar_type() == dtype ? source : source.to(dtype);
    }
    AddLoadBytesRead(source.nbytes());
  });
  RETURN_IF_ERROR(status);
  std::vector<std::string> unexpected;
  auto check_used = [&](const std::string& name) {
    bool ignored = false;
    for (const std::string& prefix : ignored_prefixes) ignored = ignored || name.rfind(prefix, 0) == 0;
    if (used.count(name) == 0 && !ignored) unexpected.push_back(name);
  };
  for (const auto& [name, tensor] : weights.tensors) check_used(name);
  if (weights.quantized != nullptr) {
    for (const auto& [name, q] : *weights.quantized) check_used(name);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", component_dir, "' lacks ", missing.size(),
                                                   " tensor(s) the model needs: ", List(missing)));
  }
  if (!unexpected.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("'", component_dir, "' has ", unexpected.size(),
                                                   " tensor(s) the model does not use: ", List(unexpected)));
  }
  return absl::OkStatus();
}

absl::Status LoadComponentWeights(Module& root, const std::string& component_dir, at::ScalarType dtype,
                                  const std::vector<std::string>& ignored_prefixes,
                                  CheckpointQuantization* quantization) {
  ASSIGN_OR_RETURN(ComponentWeights weights, ReadComponentWeights(component_dir));
  ComponentWeights named;
  // A module whose tensors all sit under one top-level child ("text_model." of CLIPTextModel) reads
  // checkpoints with or without that prefix: transformers 5 saves such models without it.
  std::string only_child;
  if (root.children().size() == 1) only_child = root.children().front().first + ".";
  bool has_child_prefix = only_child.empty();
  for (const auto& entry : weights.tensors) {
    if (has_child_prefix) break;
    const std::string& key = entry.first;
    has_child_prefix = key.rfind(only_child, 0) == 0 || key.rfind("model." + only_child, 0) == 0;
  }
  if (weights.quantized != nullptr && !has_child_prefix) {
    for (const auto& entry : *weights.quantized) {
      has_child_prefix = has_child_prefix || entry.first.rfind(only_child, 0) == 0;
    }
  }
  auto strip = [&](const std::string& key) {
    const std::string bare = key.rfind("model.", 0) == 0 ? key.substr(6) : key;
    return has_child_prefix ? bare : only_child + bare;
  };
  for (auto& [key, tensor] : weights.tensors) {
    named.tensors[strip(key)] = tensor;
    named.file_of[strip(key)] = weights.file_of[key];
  }
  if (weights.quantized != nullptr) {
    named.quantized = std::make_shared<PrequantizedWeights>();
    named.format = weights.format;
    for (auto& [key, q] : *weights.quantized) {
      (*named.quantized)[strip(key)] = q;
      named.file_of[strip(key)] = weights.file_of[key];
    }
  }
  RETURN_IF_ERROR(BindWeights(root, named, dtype, component_dir, ignored_prefixes));
  if (quantization != nullptr) {
    quantization->weights = named.quantized;
    quantization->format = named.format;
  }
  // A file truncated while BindWeights converted its tensors (a dtype copy) made them read zeros.
  for (const auto& file : weights.files) RETURN_IF_ERROR(file->CheckUnchanged());
  return absl::OkStatus();
}

absl::Status SaveComponent(Module& root, const std::string& dir, const google::protobuf::Struct& config,
                           int64_t max_shard_bytes) {
  return SaveComponent(std::vector<Module*>{&root}, dir, config, max_shard_bytes);
}

absl::Status SaveComponent(const std::vector<Module*>& roots, const std::string& dir,
                           const google::protobuf::Struct& config, int64_t max_shard_bytes) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create '", dir, "'"));
  }
  std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
  int64_t shard_bytes = 0;
  for (Module* root : roots) {
    root->ForEachSlot([&](Module& module, TensorSlot& slot) {
      if (!slot.value.defined()) return;
      const int64_t n = static_cast<int64_t>(slot.value.nbytes());
      if (max_shard_bytes > 0 && shard_bytes > 0 && shard_bytes + n > max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().emplace_back(module.SlotPath(slot), slot.value.to(at::kCPU));
      shard_bytes += n;
    });
  }
  RETURN_IF_ERROR(WriteJsonFile(absl::StrCat(dir, "/config.json"), config));
  if (shards.size() == 1) {
    return WriteSafetensors(absl::StrCat(dir, "/diffusion_pytorch_model.safetensors"), shards[0]);
  }
  google::protobuf::Struct index;
  auto* map = (*index.mutable_fields())["weight_map"].mutable_struct_value();
  for (size_t i = 0; i < shards.size(); ++i) {
    const std::string file = absl::StrCat("diffusion_pytorch_model-", i + 1, "-of-", shards.size(), ".safetensors");
    RETURN_IF_ERROR(WriteSafetensors(absl::StrCat(dir, "/", file), shards[i]));
    for (const auto& [name, tensor] : shards[i]) (*map->mutable_fields())[name].set_string_value(file);
  }
  return WriteJsonFile(absl::StrCat(dir, "/diffusion_pytorch_model.safetensors.index.json"), index);
}

}  // namespace stowage
