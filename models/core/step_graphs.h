// StepGraphs: captured CUDA graphs of a transformer's steady-state forward, by input shape.
//
// A denoising step launches ~700 kernels one by one from the host; a CUDA graph replays the whole
// sequence with one launch, which pays where launches, not kernels, bound the step (small images and
// models, a busy host). At 1024² on the H200 the kernels bound it and graphs gain nothing measurable,
// hence off by default. A model hands Run the tensors its forward reads
// besides its weights and a body that computes the forward from them; Run
//   1. runs the body eagerly the first time a shape is seen (its kernels choose their algorithms and
//      allocate their workspaces on the capture stream),
//   2. captures it the second time into a graph (inputs copied into static tensors the graph reads,
//      its activations in a memory pool the cache's graphs share), replays it and returns a copy of
//      its outputs,
//   3. afterwards copies the inputs in and replays.
// A graph reads the weights at the addresses they had when it was captured: the addresses of every
// tensor of the model are part of a graph's key, and a model whose weights moved is captured again.
//
// Graphs serve a forward only when all of these hold, else Run runs the body eagerly:
//   - a CUDA build, enabled (SetCudaGraphsEnabled / environment STOWAGE_CUDA_GRAPHS=1), inputs on a
//     CUDA device;
//   - the model has no hooks anywhere (no group offloading or streaming: its weights stay put) and
//     every tensor of it is on the device;
//   - no LoRA adapters active on the running thread (their per-request matrices are not captured);
//   - no capture of this cache failed (out of memory aside: see StepGraphStats; failures are logged).
// The cache keeps `capacity` shapes (least recently used goes; a Z-Image request's shape includes its
// caption length, padded to a multiple of 32). The graphs share one memory pool: they run one at a
// time, on the caller's (the worker's) stream, and their outputs are copied out at once, so the pool
// holds about one forward's activations whatever the number of shapes. The eager first forwards run
// on the cache's own capture stream, whose cached blocks (another forward's activations) stay
// reserved until cached memory is returned (placement does when weights move). The model's
// ReleaseDeviceCaches calls Release: when its weights leave the device (offload/module.h says who
// calls it), and under a budget when placement must move weights to make room.
//
// Thread-safety: one thread at a time (the device's worker), as the model itself.
#ifndef STOWAGE_MODELS_CORE_STEP_GRAPHS_H_
#define STOWAGE_MODELS_CORE_STEP_GRAPHS_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "offload/module.h"

namespace stowage {

// Process-wide switch, default off (environment STOWAGE_CUDA_GRAPHS=1 turns it on at start-up, for
// the server too: the H200 measurement behind the default is in step_graphs.cc). Off: every forward
// runs eagerly.
void SetCudaGraphsEnabled(bool enabled);
bool CudaGraphsEnabled();

struct StepGraphStats {
  int64_t eager = 0;       // Forwards run eagerly (graphs not usable, or a shape's first forward).
  int64_t captures = 0;    // Graphs captured.
  int64_t replays = 0;     // Forwards served by a graph (a capture's own forward included).
  int64_t released = 0;    // Graphs dropped (Release, eviction from the cache, weights moved).
  int64_t failures = 0;    // Captures that failed.
  int64_t held_bytes = 0;  // Growth of the device's reserved memory during the cached graphs'
                           // captures (approximate: other allocations meanwhile count too; 0 when none).
  // A capture that runs out of memory leaves that forward eager and is tried again later (three
  // times at most); any other failure leaves the cache eager for good.
};

class StepGraphs {
 public:
  using Body = std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>& inputs)>;

  // `name` names the cache in logs (e.g. the model kind).
  explicit StepGraphs(std::string name, size_t capacity = 4);
  ~StepGraphs();
  StepGraphs(const StepGraphs&) = delete;
  StepGraphs& operator=(const StepGraphs&) = delete;

  // body(inputs), through a graph when one can serve (see the file comment). `inputs`: defined
  // tensors; the body must read nothing else that changes between forwards but `model`'s weights,
  // make no host round trip and return defined tensors. The outputs are the caller's own.
  std::vector<at::Tensor> Run(Module& model, const std::vector<at::Tensor>& inputs, const Body& body);

  // Drops every graph and its memory; returns the bytes the pool held.
  int64_t Release();
  StepGraphStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_STEP_GRAPHS_H_
