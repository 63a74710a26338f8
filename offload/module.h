// Module: the node of the layer library's module trees, and the hook points offloading uses.
//
// Every layer (models/core/layers.h) derives from Module, owns its parameters and buffers as tensor
// slots, and opens its forward with a ForwardScope, which runs the module's hooks: pre-forward hooks
// in the order they were added on entry, post-forward hooks in reverse order on a normal exit.
// Hooks are named and added or removed independently (group offloading is one named hook).
//
// An offloaded tensor slot holds an undefined tensor: reading it through tensor() throws an
// OffloadedTensorAccess naming the tensor, so a forward can never compute on stale memory.
//
// Thread-safety: a module tree is used by one thread at a time (the device's request worker);
// hooks are added and removed between forwards.
//
//   class Scale : public Module {
//    public:
//     Scale() : Module("Scale") { weight_ = AddParameter("weight", at::ones({4})); }
//     at::Tensor Forward(const at::Tensor& x) {
//       ForwardScope scope(*this);
//       return x * tensor(weight_);
//     }
//    private:
//     int weight_;
//   };
#ifndef STOWAGE_OFFLOAD_MODULE_H_
#define STOWAGE_OFFLOAD_MODULE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"

namespace stowage {

class Module;

// Thrown when a forward reads a tensor slot whose weights are not on the device.
class OffloadedTensorAccess : public std::logic_error {
 public:
  using std::logic_error::logic_error;
};

// A hook around a module's forward. Implementations must not throw from PostForward while an
// exception is propagating (ForwardScope skips post hooks in that case).
class ModuleHook {
 public:
  virtual ~ModuleHook() = default;
  virtual void PreForward(Module& module) { (void)module; }
  virtual void PostForward(Module& module) { (void)module; }
};

// A parameter or buffer owned directly by a module.
struct TensorSlot {
  std::string name;   // Local name, e.g. "weight".
  at::Tensor value;   // Undefined while offloaded.
  bool is_buffer = false;
};

// A weight whose FP8 form is declared but not computed yet (Module::DeferFp8).
struct DeferredFp8 {
  int codes = -1;     // Slot of the e4m3 codes [rows, k]: a host tensor not written yet.
  int scales = -1;    // Slot of the fp32 scales [rows]: not written yet.
  at::Tensor source;  // The weight [rows, k] on the host (fp32, bf16 or fp16) they are made from.
};

// A host tensor whose pages come from the system only as they are written (an anonymous mapping),
// so a deferred FP8 weight that is never written holds no RAM. Zero-filled when read unwritten.
// Throws c10::Error when the mapping is refused.
at::Tensor UnwrittenHostTensor(at::IntArrayRef sizes, at::ScalarType dtype);

class Module {
 public:
  explicit Module(std::string kind);
  virtual ~Module();
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;

  // The layer type, e.g. "Linear".
  const std::string& kind() const { return kind_; }
  // Dotted path from the root, e.g. "blocks.3.attn.to_q"; empty for the root.
  const std::string& path() const { return path_; }

  // --- Tree -------------------------------------------------------------------------------------
  template <typename T>
  T* AddChild(std::string name, std::unique_ptr<T> child) {
    T* raw = child.get();
    AttachChild(std::move(name), std::move(child));
    return raw;
  }
  const std::vector<std::pair<std::string, Module*>>& children() const { return child_views_; }
  bool is_leaf() const { return children_.empty(); }
  // Pre-order walk over this module and its descendants.
  void ForEachModule(const std::function<void(Module&)>& fn);

  // --- Tensors ----------------------------------------------------------------------------------
  // Adds a parameter or buffer; returns its index for tensor(). Names are unique per module.
  int AddParameter(std::string name, at::Tensor value);
  int AddBuffer(std::string name, at::Tensor value);
  // The tensor at `index`; throws OffloadedTensorAccess when its weights are offloaded.
  const at::Tensor& tensor(int index) const;
  std::vector<TensorSlot>& slots() { return slots_; }
  const std::vector<TensorSlot>& slots() const { return slots_; }
  // Full dotted name of a slot, e.g. "blocks.0.attn.to_q.weight".
  std::string SlotPath(const TensorSlot& slot) const;
  // Every slot of this subtree, pre-order.
  void ForEachSlot(const std::function<void(Module&, TensorSlot&)>& fn);
  // Bytes of every defined tensor of this subtree.
  int64_t DefinedBytes();

  // --- Adjacent tensors -------------------------------------------------------------------------
  // A group of tensors of this subtree (owner and slot index, in order) that onloading places next
  // to each other in one device allocation, e.g. the Q, K and V weights of an attention layer, so
  // that one GEMM can read them as one matrix (models/core/layers.h Linear::ForwardShared). A layout
  // hint only: every forward stays correct wherever the tensors are.
  void AddAdjacentGroup(std::vector<std::pair<Module*, int>> tensors);
  const std::vector<std::vector<std::pair<Module*, int>>>& adjacent_groups() const { return adjacent_groups_; }

  // --- Deferred FP8 -----------------------------------------------------------------------------
  // Declares that slots `codes` and `scales` of this module hold CompressFormat::kFp8E4M3's
  // Quantize(source) — e4m3 codes and one fp32 scale a row — without computing it now: their values
  // are host tensors of that dtype and shape whose bytes are not written (UnwrittenHostTensor).
  // HostWeights::Capture takes the declaration over and writes them on the host before anything
  // reads its host copies, except a compressed host store, which makes its int4 copy from `source`
  // directly (on the device: one pass over the bf16 weights instead of an FP8 copy made, kept and
  // read again). So a module with a deferred weight runs only through HostWeights.
  void DeferFp8(int codes, int scales, at::Tensor source, bool returned = false);
  // The declarations not taken yet; taking them leaves none, and counts them as held elsewhere until
  // each is written (DeferredFp8Written) or given back (DeferFp8 again, with `returned`).
  std::vector<DeferredFp8> TakeDeferredFp8();
  const std::vector<DeferredFp8>& deferred_fp8() const { return deferred_fp8_; }
  // Declarations taken and neither written nor given back: their slots' bytes are unwritten and only
  // their holder may write them (HostWeights::Capture refuses a tree with any).
  int deferred_fp8_held() const { return deferred_fp8_held_; }
  void DeferredFp8Written() { --deferred_fp8_held_; }

  // --- Hooks ------------------------------------------------------------------------------------
  // Fails with ALREADY_EXISTS if a hook of that name is registered on this module.
  absl::Status AddHook(std::string name, std::shared_ptr<ModuleHook> hook);
  // Returns false if no hook of that name was registered.
  bool RemoveHook(const std::string& name);
  ModuleHook* FindHook(const std::string& name) const;
  size_t hook_count() const { return hooks_.size(); }

  // --- Device caches ----------------------------------------------------------------------------
  // Frees what this module keeps on the device besides its weights (a model's captured CUDA graphs
  // and the activations they hold: models/core/step_graphs.h) and returns how many bytes that held.
  // Called on the device's worker when the module's weights leave the device (HostWeights::OffloadAll
  // and PointAtHost; placement before a move to a peer) and, under a budget, by placement on idle
  // components when weights must move to make room. The default keeps nothing.
  virtual int64_t ReleaseDeviceCaches() { return 0; }

 protected:
  // Runs the hooks around a forward: construct at the top of every Forward.
  class ForwardScope {
   public:
    explicit ForwardScope(Module& module);
    ~ForwardScope();
    ForwardScope(const ForwardScope&) = delete;
    ForwardScope& operator=(const ForwardScope&) = delete;

   private:
    Module& module_;
    int uncaught_at_entry_;
  };

 private:
  void AttachChild(std::string name, std::unique_ptr<Module> child);
  void SetPath(std::string path);
  int AddSlot(std::string name, at::Tensor value, bool is_buffer);

  std::string kind_;
  std::string path_;
  std::vector<TensorSlot> slots_;
  std::vector<std::unique_ptr<Module>> children_;
  std::vector<std::pair<std::string, Module*>> child_views_;
  std::vector<std::pair<std::string, std::shared_ptr<ModuleHook>>> hooks_;
  std::vector<std::vector<std::pair<Module*, int>>> adjacent_groups_;
  std::vector<DeferredFp8> deferred_fp8_;
  int deferred_fp8_held_ = 0;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_MODULE_H_
