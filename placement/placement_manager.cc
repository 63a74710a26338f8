#include "placement/placement_manager.h"

#include "absl/strings/str_cat.h"
#include "offload/status_macros.h"

namespace stowage {

const char* ComponentStateName(ComponentState state) {
  switch (state) {
    case ComponentState::kOffloaded:
      return "offloaded";
    case ComponentState::kResident:
      return "resident";
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
    if (entry->state != ComponentState::kResident) {
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
    view.last_use = entry->last_use;
    views.push_back(std::move(view));
  }
  return views;
}

}  // namespace stowage
