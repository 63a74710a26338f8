#include "placement/placement_manager.h"

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "offload/status_macros.h"

namespace stowage {

const char* ComponentStateName(ComponentState state) {
  switch (state) {
    case ComponentState::kOffloaded:
      return "offloaded";
    case ComponentState::kResident:
      return "resident";
    case ComponentState::kGroupOffloaded:
      return "group_offloaded";
  }
  return "unknown";
}

PlacementManager::PlacementManager(DeviceBackend* backend) : backend_(backend) {}

absl::Status PlacementManager::Register(const std::string& pipeline, Component* component) {
  absl::MutexLock lock(&mu_);
  if (Entry* existing = Find(*component)) {
    existing->pipelines.push_back(pipeline);
    return absl::OkStatus();
  }
  auto entry = std::make_unique<Entry>();
  entry->id = absl::StrCat(pipeline, "/", component->name());
  entry->component = component;
  entry->pipelines.push_back(pipeline);
  component->host_weights().OffloadAll();
  entries_.push_back(std::move(entry));
  return absl::OkStatus();
}

PlacementManager::Entry* PlacementManager::Find(const Component& component) {
  for (auto& entry : entries_) {
    if (entry->component == &component) return entry.get();
  }
  return nullptr;
}

absl::Status PlacementManager::Run(Component& component, const std::function<void()>& fn) {
  {
    absl::MutexLock lock(&mu_);
    Entry* entry = Find(component);
    if (entry == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("component '", component.name(), "' is not registered with placement"));
    }
    if (entry->state == ComponentState::kOffloaded) {
      RETURN_IF_ERROR(component.host_weights().OnloadAll(*backend_));
      entry->state = ComponentState::kResident;
    }
    entry->last_use = absl::Now();
  }
  return CatchAsStatus(absl::StrCat("running ", component.name()), fn);
}

std::vector<ComponentView> PlacementManager::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<ComponentView> views;
  for (const auto& entry : entries_) {
    ComponentView view;
    view.id = entry->id;
    view.name = entry->component->name();
    view.kind = entry->component->kind();
    view.pipelines = entry->pipelines;
    view.weight_bytes = entry->component->weight_bytes();
    view.state = entry->state;
    if (entry->state == ComponentState::kResident) view.device_bytes = view.weight_bytes;
    if (entry->group_offload) view.device_bytes = entry->group_offload->stats().working_set_bytes;
    view.last_use = entry->last_use;
    views.push_back(std::move(view));
  }
  return views;
}

absl::StatusOr<PlacementManager::Entry*> PlacementManager::FindById(const std::string& id) const {
  std::vector<std::string> ids;
  for (const auto& entry : entries_) {
    if (entry->id == id) return entry.get();
    ids.push_back(entry->id);
  }
  return absl::NotFoundError(absl::StrCat("component '", id, "' not found; known: ",
                                          absl::StrJoin(ids, ", ")));
}

absl::Status PlacementManager::EnableLocked(Entry& entry, const GroupOffloadOptions& options) {
  if (entry.group_offload) {
    return absl::FailedPreconditionError(absl::StrCat(
        "component '", entry.id, "' is already group-offloaded; disable it before changing options"));
  }
  GroupOffloadOptions effective = options;
  Component& component = *entry.component;
  // One directory per component under the configured one.
  std::string name = entry.id;
  std::replace(name.begin(), name.end(), '/', '_');
  ASSIGN_OR_RETURN(entry.group_offload, GroupOffloader::Apply(name, component.module(),
                                                              component.host_weights(), *backend_,
                                                              effective));
  entry.state = ComponentState::kGroupOffloaded;
  return absl::OkStatus();
}

absl::Status PlacementManager::EnableGroupOffload(const std::string& id,
                                                  const GroupOffloadOptions& options) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * entry, FindById(id));
  return EnableLocked(*entry, options);
}

absl::Status PlacementManager::EnablePipelineGroupOffload(const std::string& pipeline,
                                                          const PipelineGroupOffloadOptions& options) {
  absl::MutexLock lock(&mu_);
  std::vector<Entry*> targets;
  std::set<std::string> names;
  for (auto& entry : entries_) {
    if (std::find(entry->pipelines.begin(), entry->pipelines.end(), pipeline) == entry->pipelines.end()) continue;
    names.insert(entry->component->name());
    if (std::find(options.exclude.begin(), options.exclude.end(), entry->component->name()) !=
        options.exclude.end()) {
      continue;
    }
    targets.push_back(entry.get());
  }
  if (names.empty()) return absl::NotFoundError(absl::StrCat("pipeline '", pipeline, "' not found"));
  for (const std::string& excluded : options.exclude) {
    if (names.count(excluded) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("exclude: pipeline '", pipeline,
                                                     "' has no component '", excluded, "'"));
    }
  }
  for (const auto& [name, unused] : options.overrides) {
    if (names.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("overrides: pipeline '", pipeline,
                                                     "' has no component '", name, "'"));
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    auto it = options.overrides.find(targets[i]->component->name());
    absl::Status status = EnableLocked(*targets[i], it != options.overrides.end() ? it->second : options.defaults);
    if (!status.ok()) {
      for (size_t j = 0; j < i; ++j) {  // All or nothing.
        targets[j]->group_offload.reset();
        targets[j]->state = ComponentState::kOffloaded;
      }
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status PlacementManager::DisableGroupOffload(const std::string& id) {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * entry, FindById(id));
  if (!entry->group_offload) {
    return absl::FailedPreconditionError(absl::StrCat("component '", id, "' is not group-offloaded"));
  }
  entry->group_offload.reset();
  entry->state = ComponentState::kOffloaded;
  return absl::OkStatus();
}

absl::StatusOr<GroupOffloadStats> PlacementManager::GroupOffloadStatsOf(const std::string& id) const {
  absl::MutexLock lock(&mu_);
  ASSIGN_OR_RETURN(Entry * entry, FindById(id));
  if (!entry->group_offload) {
    return absl::FailedPreconditionError(absl::StrCat("component '", id, "' is not group-offloaded"));
  }
  return entry->group_offload->stats();
}

}  // namespace stowage
