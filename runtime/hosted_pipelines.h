// HostedPipelines: the lifecycle table of the pipelines one server hosts.
//
// A pipeline is LOADING (its files are being read, on the loading thread), READY (serving),
// UNLOADING (refusing new requests; requests already accepted still run until the device worker
// removes it) or FAILED (its load failed; listed with the error until it is loaded again or
// unloaded). All state changes go through one transition function, which also keeps the default
// invariant: while any pipeline is READY, exactly one READY pipeline is the default; while none
// is, there is no default.
//
//   (absent) ──BeginLoad──▶ LOADING ──FinishLoad(ok)──▶ READY ──BeginUnload──▶ UNLOADING ──FinishUnload──▶ (absent)
//                            │  ╰──AbandonLoad──▶ (absent)        ▲                 │
//                            ╰──FinishLoad(error)──▶ FAILED        ╰──AbandonUnload──╯
//   FAILED ──BeginLoad──▶ LOADING;  FAILED ──BeginUnload──▶ (absent)
//
// This table holds no device state: what is on the device changes on the device's worker, which
// calls FinishLoad / FinishUnload from inside the task that registers or removes the components.
//
// Thread-safety: thread-safe.
#ifndef STOWAGE_RUNTIME_HOSTED_PIPELINES_H_
#define STOWAGE_RUNTIME_HOSTED_PIPELINES_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "models/pipelines/pipeline.h"

namespace stowage {

enum class PipelineState { kLoading, kReady, kUnloading, kFailed };
const char* PipelineStateName(PipelineState state);  // "loading", "ready", ...

class HostedPipelines {
 public:
  struct View {
    std::string name;
    PipelineState state = PipelineState::kLoading;
    bool is_default = false;
    std::string error;                    // FAILED only.
    std::shared_ptr<Pipeline> pipeline;   // READY and UNLOADING only.
  };

  // (absent or FAILED) → LOADING. ALREADY_EXISTS when `name` is LOADING or READY;
  // FAILED_PRECONDITION when it is UNLOADING (retry once it is gone).
  absl::Status BeginLoad(const std::string& name);
  // LOADING → READY (it becomes the default if none is, or if `make_default`).
  void FinishLoad(const std::string& name, std::shared_ptr<Pipeline> pipeline, bool make_default);
  // LOADING → FAILED with `error`.
  void FailLoad(const std::string& name, const absl::Status& error);
  // LOADING → absent: the load was withdrawn; nothing remains.
  void AbandonLoad(const std::string& name);

  // READY → UNLOADING (the default moves to another READY pipeline if there is one), returning the
  // pipeline; FAILED → absent, returning null. NOT_FOUND when absent; FAILED_PRECONDITION when
  // LOADING or already UNLOADING.
  absl::StatusOr<std::shared_ptr<Pipeline>> BeginUnload(const std::string& name);
  // UNLOADING → absent.
  void FinishUnload(const std::string& name);
  // UNLOADING → READY (the unload was withdrawn; it is the default again only if none is).
  void AbandonUnload(const std::string& name);

  // The READY pipeline a request names ("" = the default). NOT_FOUND (listing the READY ones) when
  // absent; UNAVAILABLE while LOADING; FAILED_PRECONDITION when UNLOADING or FAILED.
  absl::StatusOr<std::shared_ptr<Pipeline>> Resolve(const std::string& name) const;
  // True while `pipeline` is still the one hosted as `name` and not gone (READY or UNLOADING): a
  // request accepted before an unload began still runs.
  bool StillHosted(const std::string& name, const Pipeline* pipeline) const;

  // Every entry, in load order.
  std::vector<View> List() const;

 private:
  struct Entry {
    std::string name;
    PipelineState state = PipelineState::kLoading;
    std::string error;
    std::shared_ptr<Pipeline> pipeline;
  };
  Entry* Find(const std::string& name) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  const Entry* Find(const std::string& name) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The one transition function: checks that `from` → `to` is an edge of the diagram above (a
  // violation is a programming error and aborts), applies it, keeps the default invariant.
  // `to` == nullopt-like kAbsent removes the entry.
  enum class Target { kLoading, kReady, kUnloading, kFailed, kAbsent };
  void Transition(const std::string& name, Target to, bool make_default = false)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<Entry> entries_ ABSL_GUARDED_BY(mu_);
  std::string default_ ABSL_GUARDED_BY(mu_);  // A READY pipeline's name, or "" when none is READY.
  // The default an unload moved away from (a stand-in took its place): a withdrawn unload
  // (UNLOADING → READY) gives it back, so a withdrawn change changes nothing. Cleared when the
  // pipeline goes, or when another is made the default explicitly.
  std::string displaced_default_ ABSL_GUARDED_BY(mu_);
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_HOSTED_PIPELINES_H_
