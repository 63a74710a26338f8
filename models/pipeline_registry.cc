#include "models/pipeline_registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "models/core/diffusers_format.h"
#include "models/pipelines/flux_pipeline.h"
#include "models/pipelines/tiny_pipeline.h"
#include "models/pipelines/zimage_pipeline.h"

namespace stowage {
namespace {

// The options every architecture's loader shares, from the registry's common ones.
template <typename Options>
Options CommonOptions(const PipelineLoadOptions& o) {
  Options options;
  options.name = o.name;
  options.dtype = o.dtype;
  options.weight_seed = o.weight_seed;
  options.component_seeds = o.component_seeds;
  options.device = o.device;
  options.fp8_components = o.fp8_components;
  options.fp8_one_pass_components = o.fp8_one_pass_components;
  options.host_spill_dir = o.host_spill_dir;
  return options;
}

PipelineArchitecture ZImageArchitecture() {
  PipelineArchitecture a;
  a.class_names = {"ZImagePipeline"};
  a.builtins = {"zimage-tiny"};
  a.load_dir = [](const std::string& dir, const PipelineLoadOptions& o) {
    ZImagePipelineOptions options = CommonOptions<ZImagePipelineOptions>(o);
    options.default_size = o.default_size;
    return LoadZImagePipeline(dir, options, o.random_weights, o.cache);
  };
  a.create_builtin = [](const std::string&, const PipelineLoadOptions& o) {
    ZImagePipelineOptions options = CommonOptions<ZImagePipelineOptions>(o);
    options.default_size = o.default_size;
    return CreateTinyZImagePipeline(options);
  };
  return a;
}

PipelineArchitecture FluxArchitecture() {
  PipelineArchitecture a;
  a.class_names = {"FluxPipeline"};
  a.builtins = {"flux-tiny"};
  a.load_dir = [](const std::string& dir, const PipelineLoadOptions& o) {
    FluxPipelineOptions options = CommonOptions<FluxPipelineOptions>(o);
    options.default_size = o.default_size;
    return LoadFluxPipeline(dir, options, o.random_weights, o.cache);
  };
  a.create_builtin = [](const std::string&, const PipelineLoadOptions& o) {
    FluxPipelineOptions options = CommonOptions<FluxPipelineOptions>(o);
    options.default_size = o.default_size;
    return CreateTinyFluxPipeline(options);
  };
  return a;
}

// The tiny architecture's default image size is fixed by its config, and it computes in its dtype.
absl::Status NoDefaultSize(const PipelineLoadOptions& o) {
  if (!o.fp8_components.empty()) {
    return absl::UnimplementedError(absl::StrCat("compute FP8 ('", *o.fp8_components.begin(),
                                                 "'): the tiny architecture computes in its dtype only"));
  }
  if (o.default_size == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat("default_size ", o.default_size,
                                                 ": the tiny architecture's default size comes from its config; "
                                                 "leave default_size at 0"));
}

PipelineArchitecture TinyArchitecture() {
  PipelineArchitecture a;
  a.class_names = {"StowageTinyPipeline"};
  a.builtins = {"tiny"};
  a.load_dir = [](const std::string& dir, const PipelineLoadOptions& o) -> absl::StatusOr<std::unique_ptr<Pipeline>> {
    RETURN_IF_ERROR(NoDefaultSize(o));
    return LoadTinyPipeline(dir, CommonOptions<TinyPipelineOptions>(o), o.random_weights, o.cache);
  };
  a.create_builtin = [](const std::string&, const PipelineLoadOptions& o) -> absl::StatusOr<std::unique_ptr<Pipeline>> {
    RETURN_IF_ERROR(NoDefaultSize(o));
    return CreateTinyPipeline(CommonOptions<TinyPipelineOptions>(o));
  };
  return a;
}

}  // namespace

absl::Status PipelineRegistry::Register(PipelineArchitecture architecture) {
  const size_t index = architectures_.size();
  for (const std::string& c : architecture.class_names) {
    if (by_class_.count(c) > 0) return absl::InvalidArgumentError(absl::StrCat("class '", c, "' is registered twice"));
  }
  for (const std::string& b : architecture.builtins) {
    if (builtins_.count(b) > 0) return absl::InvalidArgumentError(absl::StrCat("built-in '", b, "' is registered twice"));
  }
  for (const std::string& c : architecture.class_names) by_class_[c] = index;
  for (const std::string& b : architecture.builtins) builtins_[b] = index;
  architectures_.push_back(std::move(architecture));
  return absl::OkStatus();
}

std::vector<std::string> PipelineRegistry::BuiltinNames() const {
  std::vector<std::string> names;
  for (const auto& [name, unused] : builtins_) names.push_back(name);
  return names;
}

std::vector<std::string> PipelineRegistry::ClassNames() const {
  std::vector<std::string> names;
  for (const auto& [name, unused] : by_class_) names.push_back(name);
  return names;
}

absl::StatusOr<std::unique_ptr<Pipeline>> PipelineRegistry::LoadDirectory(
    const std::string& dir, const PipelineLoadOptions& options) const {
  const std::string index_path = absl::StrCat(dir, "/model_index.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct index, ReadJsonFile(index_path));
  auto field = index.fields().find("_class_name");
  if (field == index.fields().end() || !field->second.has_string_value()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": _class_name is missing or not a string; known: ",
                                                   absl::StrJoin(ClassNames(), ", ")));
  }
  auto it = by_class_.find(field->second.string_value());
  if (it == by_class_.end()) {
    return absl::InvalidArgumentError(absl::StrCat(index_path, ": _class_name '", Truncated(field->second.string_value()),
                                                   "' is not a pipeline this server knows; known: ",
                                                   absl::StrJoin(ClassNames(), ", ")));
  }
  return architectures_[it->second].load_dir(dir, options);
}

absl::StatusOr<std::unique_ptr<Pipeline>> PipelineRegistry::CreateBuiltin(
    const std::string& builtin, const PipelineLoadOptions& options) const {
  auto it = builtins_.find(builtin);
  if (it == builtins_.end()) {
    return absl::InvalidArgumentError(absl::StrCat("unknown built-in pipeline; available: ",
                                                   absl::StrJoin(BuiltinNames(), ", ")));
  }
  return architectures_[it->second].create_builtin(builtin, options);
}

const PipelineRegistry& DefaultPipelineRegistry() {
  static const PipelineRegistry* registry = [] {
    auto* r = new PipelineRegistry();
    // One line per architecture.
    (void)r->Register(ZImageArchitecture());
    (void)r->Register(TinyArchitecture());
    (void)r->Register(FluxArchitecture());
    return r;
  }();
  return *registry;
}

}  // namespace stowage
