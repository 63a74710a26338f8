#include "runtime/adapter_table.h"

#include <algorithm>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "runtime/config.h"

namespace stowage {
namespace {

// The Linear layers of `pipeline`'s components that `file` names, with their component and dtype.
struct Target {
  Linear* layer;
  const LoraWeights* weights;
  at::ScalarType dtype;
  std::string component;
};

absl::StatusOr<std::vector<Target>> Targets(Pipeline& pipeline, const LoraFile& file) {
  std::vector<Target> targets;
  for (const auto& [component_name, layers] : file.layers) {
    Component* component = nullptr;
    std::vector<std::string> names;
    for (Component* c : pipeline.components()) {
      names.push_back(c->name());
      if (c->name() == component_name) component = c;
    }
    if (component == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("the adapter adapts component '", Truncated(component_name),
                                                     "', which pipeline '", pipeline.name(), "' lacks (it has ",
                                                     absl::StrJoin(names, ", "), ")"));
    }
    std::map<std::string, Linear*> linears;
    component->module().ForEachModule([&](Module& m) {
      if (auto* linear = dynamic_cast<Linear*>(&m)) linears[m.path()] = linear;
    });
    for (const auto& [path, weights] : layers) {
      auto it = linears.find(path);
      if (it == linears.end()) {
        return absl::InvalidArgumentError(absl::StrCat("the adapter's layer '", component_name, ".", Truncated(path, 160),
                                                       "' is no Linear layer of pipeline '", pipeline.name(), "'"));
      }
      if (weights.A().size(1) != it->second->in_features() || weights.B().size(0) != it->second->out_features()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "the adapter's layer '", component_name, ".", Truncated(path, 160), "' is [", weights.B().size(0), " x ",
            weights.A().size(1), "]; the pipeline's is [", it->second->out_features(), " x ",
            it->second->in_features(), "]"));
      }
      targets.push_back(Target{it->second, &weights, component->dtype(), component_name});
    }
  }
  return targets;
}

}  // namespace

std::string AdapterKey(const std::string& pipeline, const std::string& adapter) {
  return absl::StrCat(pipeline, "/", adapter);
}

absl::StatusOr<PreparedAdapter> PrepareAdapter(Pipeline& pipeline, const std::string& name, const std::string& path,
                                               const LoraFile& file) {
  if (name.empty() || !IsValidTenant(name)) {
    return absl::InvalidArgumentError(absl::StrCat("name: adapter name ", Truncated(name), " is not 1..",
                                                   kMaxTenantLength, " characters of [A-Za-z0-9._-]"));
  }
  // A kohya file names its layers with '_' for '.': matched against this pipeline's Linear layers.
  LoraFile resolved = file;
  {
    std::map<std::string, std::vector<std::string>> linear_paths;
    for (Component* c : pipeline.components()) {
      c->module().ForEachModule([&](Module& m) {
        if (dynamic_cast<Linear*>(&m) != nullptr) linear_paths[c->name()].push_back(m.path());
      });
    }
    RETURN_IF_ERROR(ResolveLayerPaths(resolved, linear_paths));
  }
  ASSIGN_OR_RETURN(const std::vector<Target> targets, Targets(pipeline, resolved));
  PreparedAdapter prepared;
  prepared.info.set_name(name);
  prepared.info.set_pipeline(pipeline.name());
  prepared.info.set_path(path);
  prepared.info.set_rank(static_cast<int32_t>(file.rank));
  prepared.info.set_layers(static_cast<int32_t>(targets.size()));
  for (const auto& [component, layers] : file.layers) prepared.info.add_components(component);
  // Its matrices in one module, each in its component's dtype, on the host: its placement component.
  RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("loading adapter '", name, "'"), [&] {
    std::vector<std::pair<std::string, const LoraWeights*>> layers;
    std::vector<at::ScalarType> dtypes;
    for (const Target& target : targets) {
      layers.emplace_back(absl::StrCat(target.component, ".", target.layer->path()), target.weights);
      dtypes.push_back(target.dtype);
    }
    LoraAdapterModule made = MakeLoraAdapterModule(layers, dtypes);
    for (size_t i = 0; i < targets.size(); ++i) prepared.layers.emplace_back(targets[i].layer, made.weights[i]);
    absl::StatusOr<std::unique_ptr<Component>> created =
        Component::Create(absl::StrCat("lora:", name), std::move(made.module),
                          targets.empty() ? at::kFloat : targets.front().dtype);
    if (!created.ok()) throw std::runtime_error(std::string(created.status().message()));
    prepared.component = std::move(*created);
  }));
  prepared.info.set_bytes(prepared.component->weight_bytes());
  return prepared;
}

absl::Status AdapterTable::Add(const std::string& pipeline, const v1::Adapter& info,
                               std::shared_ptr<Component> component) {
  absl::MutexLock lock(&mu_);
  auto& adapters = by_pipeline_[pipeline];
  if (adapters.count(info.name()) > 0) {
    return absl::AlreadyExistsError(
        absl::StrCat("pipeline '", pipeline, "' already has an adapter named '", info.name(), "'"));
  }
  adapters[info.name()] = Entry{info, std::move(component)};
  return absl::OkStatus();
}

bool AdapterTable::Contains(const std::string& pipeline, const std::string& name) const {
  absl::MutexLock lock(&mu_);
  auto it = by_pipeline_.find(pipeline);
  return it != by_pipeline_.end() && it->second.count(name) > 0;
}

absl::StatusOr<std::shared_ptr<Component>> AdapterTable::Remove(const std::string& pipeline, const std::string& name) {
  absl::MutexLock lock(&mu_);
  auto on_pipeline = by_pipeline_.find(pipeline);
  if (on_pipeline == by_pipeline_.end() || on_pipeline->second.count(name) == 0) {
    return absl::NotFoundError(absl::StrCat("pipeline '", pipeline, "' has no adapter named '", Truncated(name), "'"));
  }
  std::shared_ptr<Component> component = std::move(on_pipeline->second.at(name).component);
  on_pipeline->second.erase(name);
  return component;
}

std::vector<std::string> AdapterTable::RemovePipeline(const std::string& pipeline) {
  absl::MutexLock lock(&mu_);
  std::vector<std::string> names;
  auto it = by_pipeline_.find(pipeline);
  if (it == by_pipeline_.end()) return names;
  for (const auto& [name, entry] : it->second) names.push_back(name);
  by_pipeline_.erase(it);
  return names;
}

std::vector<v1::Adapter> AdapterTable::All() const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Adapter> out;
  for (const auto& [pipeline, adapters] : by_pipeline_) {
    for (const auto& [name, entry] : adapters) out.push_back(entry.info);
  }
  return out;
}

std::vector<v1::Adapter> AdapterTable::Of(const std::string& pipeline) const {
  absl::MutexLock lock(&mu_);
  std::vector<v1::Adapter> out;
  auto it = by_pipeline_.find(pipeline);
  if (it == by_pipeline_.end()) return out;
  for (const auto& [name, entry] : it->second) out.push_back(entry.info);
  return out;
}

absl::Status AdapterTable::CheckNamed(const std::string& pipeline, const std::string& name,
                                      const std::string& field) const {
  absl::MutexLock lock(&mu_);
  auto on_pipeline = by_pipeline_.find(pipeline);
  if (on_pipeline != by_pipeline_.end() && on_pipeline->second.count(name) > 0) return absl::OkStatus();
  std::vector<std::string> loaded;
  if (on_pipeline != by_pipeline_.end()) {
    for (const auto& [loaded_name, entry] : on_pipeline->second) loaded.push_back(loaded_name);
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ".name: pipeline '", pipeline, "' has no adapter ",
                                                 Truncated(name), " (loaded: ",
                                                 loaded.empty() ? "none" : absl::StrJoin(loaded, ", "), ")"));
}

absl::StatusOr<std::vector<AdapterTable::Use>> AdapterTable::Uses(
    const std::string& pipeline, const google::protobuf::RepeatedPtrField<v1::LoraRef>& loras) const {
  absl::MutexLock lock(&mu_);
  std::vector<Use> uses;
  auto on_pipeline = by_pipeline_.find(pipeline);
  for (const v1::LoraRef& ref : loras) {
    if (ref.scale() == 0.0f) continue;
    if (on_pipeline == by_pipeline_.end() || on_pipeline->second.count(ref.name()) == 0) {
      return absl::FailedPreconditionError(absl::StrCat("adapter '", ref.name(), "' was unloaded from pipeline '",
                                                        pipeline, "' before the request ran"));
    }
    uses.push_back(Use{ref.name(), on_pipeline->second.at(ref.name()).component});
  }
  return uses;
}

AdapterHolds::~AdapterHolds() {
  for (Component* c : held_) placement_.Unhold(*c);
}

absl::Status AdapterHolds::Hold(Component& component, const std::string& reason) {
  if (std::find(held_.begin(), held_.end(), &component) != held_.end()) return absl::OkStatus();
  RETURN_IF_ERROR(placement_.Hold(component, reason));
  held_.push_back(&component);
  return absl::OkStatus();
}

}  // namespace stowage
