// PlacementManager: the registry of components on one device and the ComponentRunner through
// which pipelines call them. Before a component runs it is made resident (its host weights copied
// to the device); components stay resident until something moves them.
//
// Thread-safety: Register/Unregister/Snapshot may be called from any thread; Run is called by the
// device's request worker (one request at a time per device).
#ifndef STOWAGE_PLACEMENT_PLACEMENT_MANAGER_H_
#define STOWAGE_PLACEMENT_PLACEMENT_MANAGER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/component.h"
#include "offload/device_backend.h"

namespace stowage {

enum class ComponentState {
  kOffloaded,  // Weights only on the host.
  kResident,   // All weights on the device.
};

const char* ComponentStateName(ComponentState state);

struct ComponentView {
  std::string id;  // "<pipeline>/<component>".
  std::string name;
  std::string kind;
  std::vector<std::string> pipelines;
  int64_t weight_bytes = 0;
  ComponentState state = ComponentState::kOffloaded;
  absl::Time last_use;
};

class PlacementManager : public ComponentRunner {
 public:
  explicit PlacementManager(DeviceBackend* backend);

  DeviceBackend& backend() { return *backend_; }

  // Adds a component used by `pipeline`. Starts offloaded; it is onloaded when first run.
  absl::Status Register(const std::string& pipeline, Component* component);

  // ComponentRunner: makes `component` resident, then runs `fn`. Exceptions from `fn` become a
  // status; a device out-of-memory error keeps its IsDeviceOom() mark.
  absl::Status Run(Component& component, const std::function<void()>& fn) override;

  std::vector<ComponentView> Snapshot() const;

 private:
  struct Entry {
    std::string id;
    Component* component;
    std::vector<std::string> pipelines;
    ComponentState state = ComponentState::kOffloaded;
    absl::Time last_use = absl::InfinitePast();
  };
  Entry* Find(const Component& component) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  DeviceBackend* backend_;
  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

}  // namespace stowage

#endif  // STOWAGE_PLACEMENT_PLACEMENT_MANAGER_H_
