#include "models/core/step_graphs.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <list>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/log.h"
#include "models/core/lora.h"

#ifdef STOWAGE_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace stowage {
namespace {

// Off unless asked for: measured on the H200 at 1024², batch 1 (bench/results/compute_h200/run9.jsonl),
// graphs left the Z-Image step where it was (0.1043 s with, 0.1039 s without; FP8 0.0698 / 0.0699):
// the GPU is busy with kernels, not waiting for launches.
bool EnabledAtStart() {
  const char* env = std::getenv("STOWAGE_CUDA_GRAPHS");
  return env != nullptr && std::strcmp(env, "1") == 0;
}

std::atomic<bool>& EnabledFlag() {
  static std::atomic<bool> enabled{EnabledAtStart()};
  return enabled;
}

}  // namespace

void SetCudaGraphsEnabled(bool enabled) { EnabledFlag().store(enabled); }
bool CudaGraphsEnabled() { return EnabledFlag().load(); }

struct StepGraphs::Impl {
  std::string name;
  size_t capacity;
  StepGraphStats stats;
#ifdef STOWAGE_WITH_CUDA
  struct Entry {
    std::string key;
    std::vector<at::Tensor> inputs;   // What the graph reads: the caller's inputs are copied in.
    std::vector<at::Tensor> outputs;  // What it writes, in the pool: copied out after each replay.
    std::unique_ptr<at::cuda::CUDAGraph> graph;
  };
  std::list<Entry> entries;        // Most recently used first.
  std::set<std::string> warmed;    // Shapes whose first forward ran eagerly on the capture stream.
  // The thread those forwards ran on: libraries set up per thread (cuDNN's plans, cuBLAS's handles),
  // so a forward on another thread (the device's worker goes on on a fresh one after out-of-memory
  // errors) runs each shape eagerly again before any capture.
  std::thread::id warmed_on;
  // The capture stream: this cache's own (not one of LibTorch's pooled streams, which the device's
  // copy streams may share). Replays run on the caller's stream, one at a time (the worker's): the
  // graphs sharing the pool never overlap.
  cudaStream_t raw_stream = nullptr;
  std::optional<c10::cuda::CUDAStream> stream;
  using PoolId = decltype(at::cuda::graph_pool_handle());
  PoolId pool{0, 0};
  uint64_t fingerprint = 0;  // The weights' addresses the entries were captured with.
  int capture_failures = 0;
  bool broken = false;

  ~Impl() {
    Drop();
    DestroyStream();
  }

  void Drop() {
    if (!entries.empty() && stream.has_value()) {  // No replay may still be running (no throw: destructors call this).
      (void)cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(stream->device_index()).stream());
    }
    stats.released += static_cast<int64_t>(entries.size());
    entries.clear();
    pool = {0, 0};
    stats.held_bytes = 0;
  }

  void DestroyStream() {
    if (raw_stream == nullptr) return;
    (void)cudaStreamSynchronize(raw_stream);
    (void)cudaStreamDestroy(raw_stream);
    raw_stream = nullptr;
    stream.reset();
  }

  bool UseStream(const c10::Device& device) {
    if (stream.has_value() && stream->device() == device) return true;
    Drop();
    DestroyStream();
    warmed.clear();
    if (cudaStreamCreateWithFlags(&raw_stream, cudaStreamNonBlocking) != cudaSuccess) {
      (void)cudaGetLastError();
      raw_stream = nullptr;
      return false;
    }
    stream = c10::cuda::getStreamFromExternal(raw_stream, device.index());
    return true;
  }
#endif
};

StepGraphs::StepGraphs(std::string name, size_t capacity) : impl_(std::make_unique<Impl>()) {
  impl_->name = std::move(name);
  impl_->capacity = capacity == 0 ? 1 : capacity;
}

StepGraphs::~StepGraphs() = default;

StepGraphStats StepGraphs::stats() const { return impl_->stats; }

#ifndef STOWAGE_WITH_CUDA

std::vector<at::Tensor> StepGraphs::Run(Module& model, const std::vector<at::Tensor>& inputs, const Body& body) {
  (void)model;
  ++impl_->stats.eager;
  return body(inputs);
}

int64_t StepGraphs::Release() { return 0; }

#else

namespace {

// The weights' addresses, or nullopt when a graph cannot serve `model` on `device`: a hook anywhere
// (its weights may move during a forward), or a tensor not on the device.
std::optional<uint64_t> WeightsFingerprint(Module& model, const c10::Device& device) {
  bool usable = true;
  model.ForEachModule([&](Module& m) { usable = usable && m.hook_count() == 0; });
  if (!usable) return std::nullopt;
  uint64_t hash = 1469598103934665603ull;  // FNV-1a over (address, bytes) of every tensor.
  auto mix = [&](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      hash ^= (v >> (8 * i)) & 0xff;
      hash *= 1099511628211ull;
    }
  };
  model.ForEachSlot([&](Module&, TensorSlot& slot) {
    if (!usable) return;
    if (!slot.value.defined() || slot.value.device() != device) {
      usable = false;
      return;
    }
    mix(reinterpret_cast<uintptr_t>(slot.value.data_ptr()));
    mix(static_cast<uint64_t>(slot.value.nbytes()));
  });
  if (!usable) return std::nullopt;
  return hash;
}

// Shapes, strides and dtypes of the inputs; empty when one cannot be copied into a static tensor of
// the same layout (not dense) or is not on `device`.
std::string InputKey(const std::vector<at::Tensor>& inputs, const c10::Device& device) {
  std::string key;
  for (const at::Tensor& t : inputs) {
    if (!t.defined() || t.device() != device || !t.is_non_overlapping_and_dense()) return "";
    absl::StrAppend(&key, static_cast<int>(t.scalar_type()), ":");
    for (int64_t d = 0; d < t.dim(); ++d) absl::StrAppend(&key, t.size(d), "/", t.stride(d), ",");
    absl::StrAppend(&key, ";");
  }
  return key;
}

std::vector<at::Tensor> CloneAll(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  out.reserve(tensors.size());
  for (const at::Tensor& t : tensors) out.push_back(t.clone());
  return out;
}

int64_t ReservedBytes(c10::DeviceIndex index) {
  return c10::cuda::CUDACachingAllocator::getDeviceStats(index).reserved_bytes[0].current;
}

}  // namespace

std::vector<at::Tensor> StepGraphs::Run(Module& model, const std::vector<at::Tensor>& inputs, const Body& body) {
  Impl& s = *impl_;
  auto eager = [&] {
    ++s.stats.eager;
    return body(inputs);
  };
  if (s.broken || !CudaGraphsEnabled() || inputs.empty() || !inputs.front().defined() ||
      !inputs.front().is_cuda() || ActiveLoras() != nullptr || ActiveLoraRows() != nullptr) {
    return eager();
  }
  const c10::Device device = inputs.front().device();
  const std::optional<uint64_t> fingerprint = WeightsFingerprint(model, device);
  const std::string key = InputKey(inputs, device);
  if (!fingerprint.has_value() || key.empty()) return eager();

  const c10::cuda::CUDAGuard guard(device);
  if (!s.UseStream(device)) return eager();
  if (*fingerprint != s.fingerprint) {
    s.Drop();  // The weights moved since these graphs were captured.
    s.fingerprint = *fingerprint;
  }
  if (s.warmed_on != std::this_thread::get_id()) {
    s.warmed.clear();
    s.warmed_on = std::this_thread::get_id();
  }
  c10::cuda::CUDAStream current = c10::cuda::getCurrentCUDAStream(device.index());

  for (auto it = s.entries.begin(); it != s.entries.end(); ++it) {
    if (it->key != key) continue;
    for (size_t i = 0; i < inputs.size(); ++i) it->inputs[i].copy_(inputs[i]);
    it->graph->replay();
    ++s.stats.replays;
    s.entries.splice(s.entries.begin(), s.entries, it);
    return CloneAll(s.entries.front().outputs);
  }

  if (s.warmed.count(key) == 0) {
    // The first forward of a shape runs eagerly on the capture stream (after what the caller
    // queued; the caller's stream continues after it): cuBLAS, cuDNN and the allocator set up
    // what they need there, outside any capture.
    // Its activations stay cached for the capture stream until placement returns cached memory.
    at::cuda::CUDAEvent ready;
    ready.record(current);
    ready.block(*s.stream);
    std::vector<at::Tensor> out;
    auto rejoin = [&] {  // The caller's stream waits for the reads of its inputs, whatever happened.
      at::cuda::CUDAEvent done;
      done.record(*s.stream);
      done.block(current);
    };
    try {
      const c10::cuda::CUDAStreamGuard on_stream(*s.stream);
      out = body(inputs);
    } catch (...) {
      rejoin();
      throw;
    }
    rejoin();
    s.warmed.insert(key);
    ++s.stats.eager;
    return out;
  }

  if (s.entries.size() >= s.capacity) {
    current.synchronize();
    s.entries.pop_back();
    ++s.stats.released;
  }
  Impl::Entry entry;
  entry.key = key;
  for (const at::Tensor& t : inputs) {
    at::Tensor copy = at::empty_strided(t.sizes(), t.strides(), t.options());
    copy.copy_(t);
    entry.inputs.push_back(std::move(copy));
  }
  entry.graph = std::make_unique<at::cuda::CUDAGraph>();
  const int64_t reserved_before = ReservedBytes(device.index());
  at::cuda::CUDAEvent ready;
  ready.record(current);
  ready.block(*s.stream);
  std::exception_ptr failure;
  bool began = false, ended = false;
  {
    const c10::cuda::CUDAStreamGuard on_stream(*s.stream);
    try {
      if (s.pool == Impl::PoolId{0, 0}) s.pool = at::cuda::graph_pool_handle();
      entry.graph->capture_begin(s.pool, cudaStreamCaptureModeThreadLocal);
      began = true;
      try {
        entry.outputs = body(entry.inputs);
      } catch (...) {
        failure = std::current_exception();
      }
      entry.graph->capture_end();
      ended = true;
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  at::cuda::CUDAEvent captured;
  captured.record(*s.stream);
  captured.block(current);
  if (failure) {
    ++s.stats.failures;
    bool out_of_memory = false;
    std::string what = "unknown error";
    try {
      std::rethrow_exception(failure);
    } catch (const c10::OutOfMemoryError& e) {
      out_of_memory = true;
      what = e.what();
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    (void)cudaGetLastError();  // A failed capture leaves a non-sticky error behind.
    // The other graphs go first, so that nothing live shares the pool; then, when the capture did
    // not end, the allocator stops routing this stream's allocations to the pool and lets it go.
    const Impl::PoolId failed_pool = s.pool;
    entry = Impl::Entry();
    s.Drop();
    if (began && !ended) {
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device.index(), failed_pool);
      } catch (...) {
      }
      try {
        c10::cuda::CUDACachingAllocator::releasePool(device.index(), failed_pool);
      } catch (...) {
      }
    }
    // Out of memory is a moment's state (placement may have more resident now): eager this time,
    // capture again later, up to a few times; anything else means the body cannot be captured.
    s.broken = !out_of_memory || ++s.capture_failures >= 3;
    LogWarning(absl::StrCat("cuda_graphs model=", LogValue(s.name), " outcome=capture_failed action=",
                            s.broken ? "eager_from_now" : "eager_this_forward", " error=", LogValue(what, 300)));
    return eager();
  }
  entry.graph->replay();
  ++s.stats.captures;
  ++s.stats.replays;
  s.stats.held_bytes += std::max<int64_t>(0, ReservedBytes(device.index()) - reserved_before);
  s.entries.push_front(std::move(entry));
  return CloneAll(s.entries.front().outputs);
}

int64_t StepGraphs::Release() {
  const int64_t held = impl_->stats.held_bytes;
  impl_->Drop();
  return held;
}

#endif

}  // namespace stowage
