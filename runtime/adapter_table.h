// The LoRA adapters loaded on one device's pipelines (AdminService.LoadAdapter / UnloadAdapter):
// what each one is (v1::Adapter), its placement component (its matrices as one module:
// models/core/lora.h MakeLoraAdapterModule), and the rules that go with them — making a file ready
// for a pipeline, the name layers attach it under, the adapters a request may name, and holding the
// ones a batch uses on the device. DeviceRuntime owns one table per device and changes it on its
// worker; attaching to layers and registering with placement stay the worker's (DeviceRuntime).
#ifndef STOWAGE_RUNTIME_ADAPTER_TABLE_H_
#define STOWAGE_RUNTIME_ADAPTER_TABLE_H_

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "models/core/layers.h"
#include "models/core/lora.h"
#include "models/pipelines/component.h"
#include "models/pipelines/pipeline.h"
#include "placement/placement_manager.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// The name an adapter is attached to Linear layers under: components are shared between pipelines
// (by content), and each pipeline's adapter names are its own.
std::string AdapterKey(const std::string& pipeline, const std::string& adapter);

// An adapter file made ready for one pipeline (off the worker): what it is, its matrices as a
// placement component ("lora:<name>", on the host), and each adapted layer with the weights that
// read the component's slots.
struct PreparedAdapter {
  v1::Adapter info;  // name, pipeline, path, rank, layers, components, bytes.
  std::shared_ptr<Component> component;
  std::vector<std::pair<Linear*, LoraWeights>> layers;
};

// INVALID_ARGUMENT naming what is wrong: an adapter name that is not 1..kMaxTenantLength of
// [A-Za-z0-9._-]; a component the pipeline lacks; a layer that is no Linear of it (kohya's
// underscored names matched onto the pipeline's Linear paths first) or of another shape.
absl::StatusOr<PreparedAdapter> PrepareAdapter(Pipeline& pipeline, const std::string& name, const std::string& path,
                                               const LoraFile& file);

// Thread-safety: thread-safe.
class AdapterTable {
 public:
  // An adapter a request uses, with its component (held on the device while the request runs).
  struct Use {
    std::string name;
    std::shared_ptr<Component> component;
  };

  // ALREADY_EXISTS when `pipeline` has an adapter of that name.
  absl::Status Add(const std::string& pipeline, const v1::Adapter& info, std::shared_ptr<Component> component)
      ABSL_LOCKS_EXCLUDED(mu_);
  bool Contains(const std::string& pipeline, const std::string& name) const ABSL_LOCKS_EXCLUDED(mu_);
  // Removes one adapter and returns its component; NOT_FOUND naming it when `pipeline` has none so named.
  absl::StatusOr<std::shared_ptr<Component>> Remove(const std::string& pipeline, const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Removes every adapter of `pipeline`; returns their names.
  std::vector<std::string> RemovePipeline(const std::string& pipeline) ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<v1::Adapter> All() const ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<v1::Adapter> Of(const std::string& pipeline) const ABSL_LOCKS_EXCLUDED(mu_);
  // Request validation: INVALID_ARGUMENT "<field>.name: pipeline 'p' has no adapter x (loaded: ...)".
  absl::Status CheckNamed(const std::string& pipeline, const std::string& name, const std::string& field) const
      ABSL_LOCKS_EXCLUDED(mu_);
  // At run time: the adapters `loras` names with a non-zero scale, or FAILED_PRECONDITION naming one
  // unloaded since the request was accepted.
  absl::StatusOr<std::vector<Use>> Uses(const std::string& pipeline,
                                        const google::protobuf::RepeatedPtrField<v1::LoraRef>& loras) const
      ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    v1::Adapter info;
    std::shared_ptr<Component> component;
  };
  mutable absl::Mutex mu_;
  std::map<std::string, std::map<std::string, Entry>> by_pipeline_ ABSL_GUARDED_BY(mu_);
};

// The adapters a batch holds on the device (PlacementManager::Hold), each once, released when it
// goes. Worker only (it changes placement).
class AdapterHolds {
 public:
  explicit AdapterHolds(PlacementManager& placement) : placement_(placement) {}
  ~AdapterHolds();
  AdapterHolds(const AdapterHolds&) = delete;
  AdapterHolds& operator=(const AdapterHolds&) = delete;
  absl::Status Hold(Component& component, const std::string& reason);

 private:
  PlacementManager& placement_;
  std::vector<Component*> held_;
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_ADAPTER_TABLE_H_
