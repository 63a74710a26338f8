#include "offload/module.h"

#include <sys/mman.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <utility>

#include <ATen/Functions.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace stowage {

Module::Module(std::string kind) : kind_(std::move(kind)) {}
Module::~Module() = default;

void Module::AttachChild(std::string name, std::unique_ptr<Module> child) {
  for (const auto& [existing, unused] : child_views_) {
    if (existing == name) throw std::invalid_argument(absl::StrCat("duplicate child '", name, "'"));
  }
  child->SetPath(path_.empty() ? name : absl::StrCat(path_, ".", name));
  child_views_.emplace_back(std::move(name), child.get());
  children_.push_back(std::move(child));
}

void Module::SetPath(std::string path) {
  path_ = std::move(path);
  for (auto& [name, child] : child_views_) child->SetPath(absl::StrCat(path_, ".", name));
}

void Module::ForEachModule(const std::function<void(Module&)>& fn) {
  fn(*this);
  for (auto& [name, child] : child_views_) child->ForEachModule(fn);
}

int Module::AddSlot(std::string name, at::Tensor value, bool is_buffer) {
  for (const TensorSlot& slot : slots_) {
    if (slot.name == name) throw std::invalid_argument(absl::StrCat("duplicate tensor '", name, "'"));
  }
  slots_.push_back(TensorSlot{std::move(name), std::move(value), is_buffer});
  return static_cast<int>(slots_.size()) - 1;
}

int Module::AddParameter(std::string name, at::Tensor value) {
  return AddSlot(std::move(name), std::move(value), /*is_buffer=*/false);
}

int Module::AddBuffer(std::string name, at::Tensor value) {
  return AddSlot(std::move(name), std::move(value), /*is_buffer=*/true);
}

const at::Tensor& Module::tensor(int index) const {
  const TensorSlot& slot = slots_.at(static_cast<size_t>(index));
  if (!slot.value.defined()) {
    throw OffloadedTensorAccess(absl::StrCat(
        "tensor '", SlotPath(slot), "' is offloaded: the forward of ", kind_,
        " read it outside its group's onload (missing or removed offload hook?)"));
  }
  return slot.value;
}

std::string Module::SlotPath(const TensorSlot& slot) const {
  return path_.empty() ? slot.name : absl::StrCat(path_, ".", slot.name);
}

void Module::ForEachSlot(const std::function<void(Module&, TensorSlot&)>& fn) {
  ForEachModule([&](Module& m) {
    for (TensorSlot& slot : m.slots_) fn(m, slot);
  });
}

int64_t Module::DefinedBytes() {
  int64_t bytes = 0;
  ForEachSlot([&](Module&, TensorSlot& slot) {
    if (slot.value.defined()) bytes += static_cast<int64_t>(slot.value.nbytes());
  });
  return bytes;
}

at::Tensor UnwrittenHostTensor(at::IntArrayRef sizes, at::ScalarType dtype) {
  int64_t numel = 1;
  for (const int64_t s : sizes) numel *= s;
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(numel) * c10::elementSize(dtype));
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "cannot map ", bytes, " bytes for an unwritten host tensor: ", std::strerror(errno));
  return at::from_blob(
      base, sizes, [bytes](void* p) { ::munmap(p, bytes); }, at::TensorOptions().dtype(dtype));
}

void Module::DeferFp8(int codes, int scales, at::Tensor source, bool returned) {
  TORCH_CHECK(codes >= 0 && static_cast<size_t>(codes) < slots_.size() && scales >= 0 &&
                  static_cast<size_t>(scales) < slots_.size() && codes != scales,
              path(), ": DeferFp8 names slots ", codes, " and ", scales, " of ", slots_.size());
  TORCH_CHECK(source.defined() && source.device().is_cpu() && source.dim() >= 2, path(),
              ": a deferred FP8 weight needs its source on the host, of rank >= 2");
  deferred_fp8_.push_back(DeferredFp8{codes, scales, std::move(source)});
  if (returned) --deferred_fp8_held_;
}

std::vector<DeferredFp8> Module::TakeDeferredFp8() {
  deferred_fp8_held_ += static_cast<int>(deferred_fp8_.size());
  return std::exchange(deferred_fp8_, {});
}

void Module::AddAdjacentGroup(std::vector<std::pair<Module*, int>> tensors) {
  adjacent_groups_.push_back(std::move(tensors));
}

absl::Status Module::AddHook(std::string name, std::shared_ptr<ModuleHook> hook) {
  if (FindHook(name) != nullptr) {
    return absl::AlreadyExistsError(
        absl::StrCat("module '", path_, "' (", kind_, ") already has a hook named '", name, "'"));
  }
  hooks_.emplace_back(std::move(name), std::move(hook));
  return absl::OkStatus();
}

bool Module::RemoveHook(const std::string& name) {
  for (auto it = hooks_.begin(); it != hooks_.end(); ++it) {
    if (it->first == name) {
      hooks_.erase(it);
      return true;
    }
  }
  return false;
}

ModuleHook* Module::FindHook(const std::string& name) const {
  for (const auto& [hook_name, hook] : hooks_) {
    if (hook_name == name) return hook.get();
  }
  return nullptr;
}

Module::ForwardScope::ForwardScope(Module& module)
    : module_(module), uncaught_at_entry_(std::uncaught_exceptions()) {
  for (auto& [name, hook] : module_.hooks_) hook->PreForward(module_);
}

Module::ForwardScope::~ForwardScope() {
  // A forward that is unwinding skips its post hooks: they would run against a half-done state.
  if (std::uncaught_exceptions() > uncaught_at_entry_) return;
  for (auto it = module_.hooks_.rbegin(); it != module_.hooks_.rend(); ++it) {
    it->second->PostForward(module_);
  }
}

}  // namespace stowage
