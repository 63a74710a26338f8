// Component: one model of a pipeline (text encoder, transformer, VAE) — a module tree, its host
// weights, and what placement needs to know about it. Placement decides where its weights are;
// the pipeline only runs it through a ComponentRunner.
#ifndef STOWAGE_MODELS_PIPELINES_COMPONENT_H_
#define STOWAGE_MODELS_PIPELINES_COMPONENT_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "offload/host_weights.h"
#include "offload/compression.h"
#include "offload/module.h"

namespace stowage {

// PipelineConfig.host_spill_dir for a module being built into a component: its heap host tensors move
// into a mapped file in `dir` (SpillHeapTensors, offload/host_spill.h); an error names the field and
// the component ("pipeline.host_spill_dir: component 'transformer': ...").
absl::Status SpillComponentHostCopies(Module& module, const std::string& dir, const std::string& component);

class Component {
 public:
  // `root` must hold its weights as contiguous CPU tensors (they become the host copies).
  static absl::StatusOr<std::unique_ptr<Component>> Create(std::string name,
                                                           std::unique_ptr<Module> root,
                                                           at::ScalarType dtype);

  const std::string& name() const { return name_; }
  const std::string& kind() const { return root_->kind(); }
  Module& module() { return *root_; }
  at::ScalarType dtype() const { return dtype_; }
  HostWeights& host_weights() { return *host_weights_; }
  int64_t weight_bytes() const { return host_weights_->bytes(); }
  int64_t parameter_count() const { return host_weights_->parameter_count(); }
  // HostWeights::CheckSourceFiles: FAILED_PRECONDITION naming a model file that changed on disk
  // under weights still mapped from it. Call on the device worker (which owns the host weights).
  absl::Status CheckSourceFiles() const { return host_weights_->CheckSourceFiles(); }

  // Set when the weights were read from an 8-bit checkpoint (offload/compressed_safetensors.h): the
  // stored 8-bit values and scales, by slot path, and their format. Group offloading with the same
  // `compress` format streams these bytes as they are instead of quantizing the host copies again.
  void set_prequantized(std::shared_ptr<const PrequantizedWeights> weights, CompressFormat format) {
    prequantized_ = std::move(weights);
    prequantized_format_ = format;
  }
  const std::shared_ptr<const PrequantizedWeights>& prequantized() const { return prequantized_; }

  // "fp8" when its blocks' linear layers were converted to FP8 at load (PipelineConfig.compute);
  // empty: it computes in dtype(). Set once, before the component is shared.
  const std::string& compute() const { return compute_; }
  void set_compute(std::string compute) { compute_ = std::move(compute); }
  CompressFormat prequantized_format() const { return prequantized_format_; }

 private:
  Component(std::string name, std::unique_ptr<Module> root, at::ScalarType dtype,
            std::unique_ptr<HostWeights> host_weights);
  std::string name_;
  std::unique_ptr<Module> root_;
  at::ScalarType dtype_;
  std::unique_ptr<HostWeights> host_weights_;
  std::shared_ptr<const PrequantizedWeights> prequantized_;
  CompressFormat prequantized_format_ = CompressFormat::kNone;
  std::string compute_;
};

// How a pipeline calls its components. Implemented by placement: it makes the component runnable
// on the device (moving it or others as its strategy decides), runs `fn`, and records what it did.
// `fn` may throw (LibTorch errors, DeviceOutOfMemory); the runner turns that into a status.
class ComponentRunner {
 public:
  virtual ~ComponentRunner() = default;
  virtual absl::Status Run(Component& component, const std::function<void()>& fn) = 0;
  // A hint that `component` runs next, after whatever runs now or is about to: the runner may start
  // moving its weights so that the copy overlaps the current compute (placement: the first groups
  // of a group-offloaded component). Never required for correctness; the default does nothing.
  virtual void Prefetch(Component& component) { (void)component; }
  // A hint that the next Run of `component` is the last this run of the pipeline needs (a request's
  // last denoising step): the runner need not prepare a run after it (placement: a group-offloaded
  // component's last forward prefetches no groups of a next one, which would be copied for nothing
  // once the component sits idle and gives its ring back). Never required for correctness; the
  // default does nothing.
  virtual void LastRunNext(Component& component) { (void)component; }
  // Between two denoising steps of the run (`done` of `total` steps done; not after the last): the
  // runner may run other work on the device here — the server runs a waiting request that
  // preempts this one (SchedulerConfig.preemption) to its end — with this run's tensors kept where
  // they are. The pipeline checks its interrupt after it. The default does nothing.
  virtual void BetweenSteps(int done, int total) {
    (void)done;
    (void)total;
  }
  // The device `component` runs on: its inputs must be there, and its outputs appear there. A
  // pipeline whose components sit on several devices (a split layout) moves tensors between them
  // with this. `home` is the pipeline's own device, which the default (one device) returns.
  virtual c10::Device DeviceOf(const Component& component, const c10::Device& home) const {
    (void)component;
    return home;
  }
};

std::string DtypeName(at::ScalarType dtype);

// Random-weights mode: the seed component `name` draws its weights from — its entry in `seeds`
// (PipelineConfig.component_weight_seeds) or the pipeline's `seed`.
uint64_t ComponentSeed(const std::map<std::string, uint64_t>& seeds, const std::string& name, uint64_t seed);

// Where a component's weights come from, for sharing one copy between pipelines (ComponentCache).
struct ComponentSource {
  // Equal for two components whose weights may be the same: the role ("text_encoder", "vae_encoder"),
  // the dtype, the compute mode, the folder's config.json (as canonical JSON: key order and spacing
  // aside) and either the random-weights seed or each weight file's name, size and safetensors
  // header. Exact for random weights.
  std::string key;
  // The folder's canonical path: same key and folder, same weights.
  std::string folder;
  // Weight files (canonical paths, in order): when the key matches a component loaded from another
  // folder, their bytes decide (a content hash of each side, computed once). Empty: the key is exact.
  std::vector<std::string> weight_files;
};

// The source of component `role` read from `folder` (a diffusers component folder: config.json and
// *.safetensors), or drawn from `seed` when `random_weights`. Reads config.json and each weight
// file's header, not the weights. NOT_FOUND / errors naming the file when they cannot be read.
absl::StatusOr<ComponentSource> DescribeComponentSource(const std::string& role, const std::string& folder,
                                                        at::ScalarType dtype, bool random_weights, uint64_t seed,
                                                        const std::string& compute = "");

// A content hash of safetensors `files`, in order (xxh3-128, hex): each header as canonical JSON,
// then its tensors' bytes; errors name the file.
absl::StatusOr<std::string> HashFiles(const std::vector<std::string>& files);

// Components loaded from model directories, deduplicated by content: a pipeline naming a component
// with the same source key as a loaded one gets that object — from the same folder, or from another
// folder whose weight files hold the same bytes (a fine-tune's copied text encoder and VAE, Flux
// [schnell] beside [dev]) — so its weights exist once and placement sees one component used by two
// pipelines. Holds weak references: a component lives as long as a pipeline uses it.
//
// Thread-safety: thread-safe.
class ComponentCache {
 public:
  using Loader = std::function<absl::StatusOr<std::unique_ptr<Component>>()>;
  absl::StatusOr<std::shared_ptr<Component>> GetOrLoad(const ComponentSource& source, const Loader& load);
  // Components found by content in another folder (each a second pipeline's load that read nothing).
  int64_t shared_by_content() const;

 private:
  struct Entry {
    std::weak_ptr<Component> component;
    std::string folder;
    std::vector<std::string> weight_files;
    std::string content_hash;  // Computed when first compared ("" until then).
    // The weight files' device, inode, size and mtime when it was loaded: a folder changed since
    // no longer holds what the component holds, and matches nothing.
    std::string identity;
  };
  // The live entry of `key` that `source` matches (same folder, or same content), or null. Hashes
  // outside the lock; entries stay in the map (the lock is re-taken to read and to store hashes).
  std::shared_ptr<Component> FindMatch(const ComponentSource& source, std::string& source_hash)
      ABSL_LOCKS_EXCLUDED(mu_);
  mutable absl::Mutex mu_;
  std::map<std::string, std::vector<Entry>> entries_ ABSL_GUARDED_BY(mu_);
  int64_t shared_by_content_ ABSL_GUARDED_BY(mu_) = 0;
};

// Loads through `cache` when there is one (sharing by source), else loads a private copy.
absl::StatusOr<std::shared_ptr<Component>> LoadMaybeShared(ComponentCache* cache, const ComponentSource& source,
                                                           const ComponentCache::Loader& load);
// The same, describing the source first (DescribeComponentSource); without a cache nothing is read.
absl::StatusOr<std::shared_ptr<Component>> LoadMaybeShared(ComponentCache* cache, const std::string& role,
                                                           const std::string& folder, at::ScalarType dtype,
                                                           bool random_weights, uint64_t seed,
                                                           const std::string& compute,
                                                           const ComponentCache::Loader& load);

}  // namespace stowage

#endif  // STOWAGE_MODELS_PIPELINES_COMPONENT_H_
