#include "models/core/weight_init.h"

#include <algorithm>
#include <cmath>
#include <string>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include "base/load_progress.h"

namespace stowage {
namespace {

// FNV-1a: a hash whose value is the same on every platform and standard library.
uint64_t StableHash(const std::string& text, uint64_t seed) {
  uint64_t h = 1469598103934665603ULL ^ seed;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

}  // namespace

void InitializeRandomWeights(Module& root, uint64_t seed) {
  // A load's progress (base/load_progress.h) counts drawn weights as read.
  AddLoadBytesTotal(root.DefinedBytes());
  root.ForEachSlot([&](Module& module, TensorSlot& slot) {
    if (!slot.value.defined()) return;
    AddLoadBytesRead(static_cast<int64_t>(slot.value.nbytes()));
    at::Tensor& t = slot.value;
    at::Generator gen = at::detail::createCPUGenerator(StableHash(module.SlotPath(slot), seed));
    const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
    // Up to kDrawn values are drawn; larger tensors tile them, so billion-parameter models fill at
    // memory speed (their random-weights mode exists for benchmarks, not for pictures): the drawn
    // values are scaled and rounded to the weight's dtype once, then copied tile by tile — the same
    // values as scaling the whole tiled tensor in float32 (each element's arithmetic is the same),
    // without a float32 copy of it.
    constexpr int64_t kDrawn = int64_t{1} << 20;
    const bool large = t.numel() > kDrawn;
    at::Tensor values = large ? at::randn({kDrawn}, gen, f32) : at::randn(t.sizes(), gen, f32);
    const std::string& kind = module.kind();
    const bool is_norm = kind.find("Norm") != std::string::npos;
    if (slot.name == "bias") {
      values.mul_(0.02);
    } else if (is_norm) {
      values.mul_(0.1).add_(1.0);
    } else if (kind == "Embedding" || t.dim() < 2) {
      // Embedding rows and free-standing vectors keep unit scale.
    } else {
      const double fan_in = static_cast<double>(t.numel() / t.size(0));
      values.mul_(1.0 / std::sqrt(fan_in));
    }
    if (!large) {
      t.copy_(values);
      return;
    }
    // A strided view is filled through a contiguous tensor of its own.
    at::Tensor dest = t.is_contiguous() ? t : at::empty(t.sizes(), t.options());
    const at::Tensor tile = values.to(t.scalar_type());
    at::Tensor flat = dest.view({-1});
    for (int64_t offset = 0; offset < t.numel(); offset += kDrawn) {
      const int64_t n = std::min(kDrawn, t.numel() - offset);
      flat.narrow(0, offset, n).copy_(tile.narrow(0, 0, n));
    }
    if (!dest.is_same(t)) t.copy_(dest);
  });
}

}  // namespace stowage
