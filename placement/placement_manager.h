// PlacementManager: the registry of components on one device and the ComponentRunner through
// which pipelines call them. Before a component runs it is made resident (its host weights copied
// to the device); components stay resident until something moves them.
//
// Ownership: a PlacementManager is device state. It is thread-compatible and owned by its
// device's worker (runtime/device_worker.h): every method but DecisionLog runs on that one thread
// (or, before a worker exists and in single-threaded tests, on whichever single thread owns it).
// Nothing here locks around a forward because nothing else may touch the registry, the hooks or
// the group offloaders while one runs. Other threads read the PlacementSnapshot that the owner
// takes after each change (TakeSnapshot) and publishes; DecisionLog alone is safe from any thread.
#ifndef STOWAGE_PLACEMENT_PLACEMENT_MANAGER_H_
#define STOWAGE_PLACEMENT_PLACEMENT_MANAGER_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "models/pipelines/component.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "placement/strategy.h"

namespace stowage {

enum class ComponentState {
  kOffloaded,       // Weights only on the host.
  kResident,        // All weights on the device.
  kGroupOffloaded,  // Places itself: groups stream through its own slots (never moved by placement).
  kPartiallyResident,  // Group-offloaded with a budget that keeps some groups on the device.
};

// Group offloading for every component of a pipeline, with exclusions and per-component overrides.
struct PipelineGroupOffloadOptions {
  GroupOffloadOptions defaults;
  std::vector<std::string> exclude;                        // Component names left alone.
  std::map<std::string, GroupOffloadOptions> overrides;    // Component name → its options.
};

const char* ComponentStateName(ComponentState state);

// A component's lifecycle in the registry, beside where its weights are (ComponentState):
//   Register → LOADING → MarkReady → READY → MarkUnloading → UNLOADING → Unregister → gone
//                                      ▲──────── AbandonUnloading ◀──────┘
// A component shared by several pipelines is READY while any of them is; it is UNLOADING only when
// every pipeline using it is being unloaded. Every change goes through one transition function.
enum class ComponentLifecycle { kLoading, kReady, kUnloading };
const char* ComponentLifecycleName(ComponentLifecycle lifecycle);

struct ComponentView {
  std::string id;  // "<pipeline>/<component>".
  std::string name;
  std::string kind;
  std::string compute;  // Component::compute().
  std::vector<std::string> pipelines;
  int64_t weight_bytes = 0;
  // Device bytes it holds now: all weights when resident, its working set when group-offloaded.
  int64_t device_bytes = 0;
  ComponentState state = ComponentState::kOffloaded;
  absl::Time last_use;
  // Set for group-offloaded (and partially resident) components.
  std::optional<GroupOffloadStats> group_offload;
  ComponentLifecycle lifecycle = ComponentLifecycle::kLoading;
  // The most device memory one of its runs allocated besides its weights (its working set when
  // group-offloaded): placement makes that much room before it runs. 0 until it has run.
  int64_t run_headroom_bytes = 0;
  // A run of it has completed since it was registered.
  bool ran = false;
};

// One placement decision, as recorded in the bounded log.
struct PlacementDecision {
  absl::Time time;
  std::string request_id;
  std::string component;  // Component id.
  std::string action;     // "onload", "offload", "group_offload", "release_slots", "release_group_cache", "oom", ...
  int64_t bytes = 0;
  int64_t free_before = 0;
  int64_t free_after = 0;
  std::string strategy;
  std::string reason;
  // Set when peer eviction weighed a peer device against the host for this eviction (see
  // PeerEviction): the peer ("" when the host won) and both costs, in seconds.
  std::string to_device;
  double d2d_seconds = 0;
  double h2d_seconds = 0;
};

// Evicting to a peer device instead of the host. When the strategy evicts a resident component to
// make room before another runs (not after a run, not in out-of-memory recovery: a component
// evicted after its own run may run again in the same request, whose tensors are on this device)
// that only one pipeline uses and `eligible`
// allows, and a peer has room for it, the manager compares moving it there now, device to device
// (bytes / peer_bytes_per_second), with bringing it back from the host later (bytes /
// host_to_device_bytes_per_second). When the peer is cheaper it calls `move`, which has the peer's
// owner copy the weights device to device (HostWeights::OnloadFromPeer) and register the component
// there; the component then leaves this registry (the pipeline runs it on the peer). Otherwise, or
// when `move` fails, it goes to the host as usual. Either way the decision records both costs.
struct PeerEviction {
  double host_to_device_bytes_per_second = 0;  // > 0.
  double peer_bytes_per_second = 0;            // > 0.
  // May `pipeline`'s component move off this device now?
  std::function<bool(const std::string& pipeline)> eligible;
  // The peers and their free bytes (published snapshots).
  std::function<std::vector<std::pair<std::string, int64_t>>()> peers;
  // Moves `component` of `pipeline` (resident here) to `device`; OK once it is resident there.
  std::function<absl::Status(const std::string& pipeline, Component& component, const std::string& device)> move;
};

// Cumulative counters, for metrics.
struct PlacementCounters {
  int64_t onloads = 0;
  int64_t onload_bytes = 0;
  int64_t offloads = 0;
  int64_t offload_bytes = 0;
  int64_t oom_recoveries = 0;
  // Runs the device began: its requests and batches (BeginRequest), peers' requests (BeginPeerRun).
  int64_t runs_begun = 0;
  // Cross-pipeline prefetch (PrefetchPipeline): components whose copies started while another
  // pipeline's request ran (also counted in onloads), those that then ran before anything evicted
  // them, and those evicted or released unused; with their bytes.
  int64_t pipeline_prefetches = 0;
  int64_t pipeline_prefetch_bytes = 0;
  int64_t pipeline_prefetches_used = 0;
  int64_t pipeline_prefetch_used_bytes = 0;
  int64_t pipeline_prefetches_unused = 0;
  int64_t decisions = 0;           // Strategy consultations.
  double decision_seconds = 0;     // Time spent in them.
  // (strategy, cause) → evictions; cause is "before_run", "after_run", "out_of_memory" or "budget"
  // (SetMemoryBudget).
  std::map<std::pair<std::string, std::string>, int64_t> evictions;
};

// Everything a reader on another thread may know about placement on one device, as of one moment
// on the worker: components, strategy, warnings, counters and the device's memory statistics.
struct PlacementSnapshot {
  std::string device;
  DeviceMemoryStats memory;
  std::string strategy;
  std::vector<ComponentView> components;
  std::vector<std::string> warnings;
  PlacementCounters counters;
  // What the spare-room caches leave free beyond what runs allocate: the configured margin plus the
  // learned one (see set_streamed_group_cache); 0 with the caches off.
  int64_t cache_margin_bytes = 0;
};

// Lifetime: the registered components must outlive the manager (group offloading unhooks their
// modules when the manager goes).
class PlacementManager : public ComponentRunner {
 public:
  explicit PlacementManager(DeviceBackend* backend);
  ~PlacementManager();

  // Replaces the strategy (default: footprint with a 0-byte reserve). Returns the warning text when
  // a footprint strategy now manages a group-offloaded component, else "".
  std::string SetStrategy(std::unique_ptr<OffloadStrategy> strategy);
  // Current warnings (e.g. footprint strategy over group-offloaded components).
  std::vector<std::string> Warnings() const;
  // Records a scheduling decision of the device's request scheduler, for `pipeline`, and why:
  // action "schedule" (the request chosen ahead of an older one) or "preempt" (a request run
  // between the denoising steps of the running one).
  void RecordSchedule(const std::string& request_id, const std::string& pipeline, const std::string& reason,
                      const std::string& action = "schedule");
  // The request id recorded with decisions from now on (set by the server per request).
  void SetRequestId(std::string request_id);
  // A request (or a batch) begins its run: SetRequestId, counted in runs_begun and toward
  // narrowing a learned cache margin (see set_streamed_group_cache). Called by the device's request
  // executor.
  void BeginRequest(std::string request_id);
  // A component run for another device's request `request_id` (split pipelines): SetRequestId, and
  // counted as BeginRequest is at the first run of each such request in a row.
  void BeginPeerRun(std::string request_id);
  // The newest `limit` decisions, oldest first.
  std::vector<PlacementDecision> DecisionLog(size_t limit) const;

  DeviceBackend& backend() { return *backend_; }

  // Adds a component used by `pipeline`. Starts offloaded; it is onloaded when first run. A new
  // component starts LOADING; one already registered (shared) keeps its lifecycle.
  absl::Status Register(const std::string& pipeline, Component* component);
  // `pipeline`'s LOADING components become READY (its load finished).
  void MarkReady(const std::string& pipeline);
  // Components that only `pipeline` uses become UNLOADING (its unload began; they still run the
  // requests already accepted); AbandonUnloading takes them back to READY.
  void MarkUnloading(const std::string& pipeline);
  void AbandonUnloading(const std::string& pipeline);

  // Removes `pipeline` from its components; components no other pipeline uses leave the device and
  // the registry (group offloading removed first). Call when no request of the pipeline runs.
  void Unregister(const std::string& pipeline);
  // The same for one component of `pipeline` (it moves to another device): recorded as "unregister"
  // with `reason`. NOT_FOUND when `pipeline` does not use it here.
  absl::Status UnregisterComponent(const std::string& pipeline, const Component& component,
                                   const std::string& reason);
  // The pipelines using `component` here (empty when it is not registered) and its state.
  std::vector<std::string> PipelinesOf(const Component& component) const;
  std::optional<ComponentState> StateOf(const Component& component) const;
  // True when any registered component is used by `pipeline`.
  bool Hosts(const std::string& pipeline) const;
  const std::string& request_id() const { return request_id_; }

  // ComponentRunner: makes `component` resident, then runs `fn`. Exceptions from `fn` become a
  // status; a device out-of-memory error keeps its IsDeviceOom() mark. A run that runs out of device
  // memory is retried after each of, in order, until one suffices: the spare-room caches given back;
  // every other component moved off but those the strategy keeps resident; those too; the component
  // itself group-offloaded (a whole one). Then the cannot-fit status (OUT_OF_RANGE).
  absl::Status Run(Component& component, const std::function<void()>& fn) override;

  // For components a run reads outside their own Run — LoRA adapters, read by every adapted layer
  // while its component runs: makes `component` resident (moving others as the strategy decides,
  // recorded as an "onload" with `reason`) and keeps it there until the matching Unhold: no other
  // component's move evicts a held one (strategies never see it as a candidate). Holds nest (a
  // count). Whole components only: FAILED_PRECONDITION for a group-offloaded one; when it does not
  // fit even with every unheld component offloaded, the cannot-fit status (OUT_OF_RANGE) naming it,
  // nothing held.
  absl::Status Hold(Component& component, const std::string& reason);
  void Unhold(Component& component);
  // ComponentRunner: for a group-offloaded component with room for its working set, copies the
  // groups its next forward needs first (GroupOffloader::PrefetchNextForward) and keeps its slots
  // while other components run, until it runs itself (memory pressure may still take them).
  // Recorded as a "prefetch" decision. Other components: nothing (they move when they run).
  void Prefetch(Component& component) override;
  // Its next forward prefetches no groups of a forward after it (GroupOffloader::
  // SkipPrefetchAfterNextForward); nothing for a component without group offloading.
  void LastRunNext(Component& component) override;
  // Peer eviction on (see PeerEviction); off by default and with an empty `move`.
  void SetPeerEviction(PeerEviction peer) { peer_ = std::move(peer); }
  // The peer's side of a peer eviction: registers `component` of `pipeline` here and makes it
  // resident by copying its weights from the device where they are now (device to device),
  // recorded as "onload_from_peer" with `reason`. FAILED_PRECONDITION when there is no room.
  absl::Status AdoptFromPeer(const std::string& pipeline, Component& component, const std::string& reason);
  // Host RAM the registered components' host copies may hold (0: no budget): what
  // EnableGroupOffload chooses the compression against when options.choose_compress (see there).
  void set_host_memory_budget(int64_t bytes) { host_budget_ = bytes; }
  // The host bytes of every registered component as placement counts them (HostBytesOf).
  int64_t HostBytes() const;
  // Cross-component prefetch on (the default) or off (Prefetch does nothing; for measuring it).
  void set_prefetch_next_component(bool on) { prefetch_next_component_ = on; }

  // Cross-pipeline prefetch: the weights of the pipeline whose request runs next copy onto the
  // device while the current request computes. The caller (the request executor) names `next` (the
  // pipeline the device's queue says runs next) with `next_components`, the components its request
  // will run in the order it runs them (learned from its last run), and `remaining`: the components
  // the running request has still to run, the one about to run first. Nothing happens unless every
  // one of `remaining` is resident (whole, not streamed): then the running request copies nothing
  // more, and copies enqueued now hold none of its own up. Each of `next_components`, in order, that
  // is registered for `next` and offloaded — READY, not a LoRA adapter (adapters move for the
  // requests that name them), not one of `remaining`, its host copies page-locked (an onload from
  // pageable memory would hold up the worker) — starts copying (HostWeights::OnloadAllAsync) when
  // its weights fit in the free device memory less the largest run headroom among `remaining`: a
  // prefetch never evicts anything and never takes room the running request will use. It is then
  // resident as far as placement and the scheduler see; until it first runs, the strategy does not
  // move it to make room for a component of its own pipeline (that request is about to use it). Its
  // first run makes the compute stream wait for the copies, and a move before that waits for them
  // on the host. The first group-offloaded (streamed) one of `next_components` that qualifies the
  // same way (pinning aside: its host store is its own) gets the groups its forward loads first
  // copied into its slots (GroupOffloader::PrefetchNextForward) when its working set fits that room:
  // the next request's first streamed forward starts with them on the device. Those slots stay
  // while the running request runs; after it ended, a component of another pipeline running first
  // gives them back (counted unused); its own run counts them used. Recorded as "prefetch_pipeline"
  // decisions naming `reason`; counted in PlacementCounters. Returns the bytes whose copies started.
  int64_t PrefetchPipeline(const std::string& next, const std::vector<const Component*>& next_components,
                           const std::vector<const Component*>& remaining, const std::string& reason);
  // Sets the device's memory budget (DeviceBackend::SetMemoryBudget; 0: none) at run time, between
  // runs. When what is allocated no longer fits, idle group-offloaded components give their slots
  // back, idle components their device caches, cached blocks go back to the device, and then whole
  // resident components move to the host, least recently used first, until it fits; their ids are
  // appended to `offloaded`. FAILED_PRECONDITION, with the previous budget back and nothing moved,
  // when what cannot move (held components, group-offloaded working sets) and the context exceed the
  // budget (no weights moved then; idle slots, graphs and cached blocks may have gone), or when the
  // moves did not free what the weights counted (the previous budget back; `offloaded` lists what
  // moved); the backend's INVALID_ARGUMENT for a budget it refuses. Recorded as "set_budget".
  absl::Status SetMemoryBudget(int64_t bytes, std::vector<std::string>* offloaded);

  // A request of `pipeline` ended: what was prefetched for it and did not run in it counts as
  // unused, and the strategy may move it again (a component its last run used that this one did
  // not, say an image encoder).
  void EndPipelineRun(const std::string& pipeline);
  // The spare-room cache of group-offloaded components (DeviceConfig.streamed_group_cache; off by
  // default): before each run of one that ran before, GroupOffloader::SetCacheAllowance with what it
  // holds in its cache plus the free device bytes less its working set still to allocate, the largest
  // room any registered component's run allocates (its run headroom: a VAE decoding at 1024² after the
  // transformer; for another streamed component of its pipelines, plus the working set it allocates),
  // `margin_bytes` and the margin out-of-memory errors taught; 0 for its first run and when off. A
  // cache stays between runs (and requests) while nothing needs its room: any move or run that needs
  // room shrinks the caches first, least recently used first (EvictBefore), a streamed component of
  // another pipeline starting to run takes it all, a component a request runs more times than
  // another takes the other's cache when the room left is less than it could hold (YieldCachesTo: a
  // transformer's steps over the text encoder that filled the room first), and a lower budget empties
  // them. A run that runs out of device memory while caches hold room gets them all
  // back and runs again before any weights move, and the learned margin doubles (recorded as
  // "widen_cache_margin"; on CUDA, room the allocator's counts call free can be split into blocks
  // too small for the run's largest allocation), up to a quarter of the budget. A run that succeeded
  // although the allocator ran short inside it changes no margin: neither a retry (the allocator gave
  // its cached blocks back and the allocation fitted; multi-tenant run 14: a few milliseconds for that
  // run) nor an out-of-memory error a library recovered from (cuDNN going a slower way: run 15's VAE
  // decodes took 0.097–0.145 s against 0.094 that once, and the device's worker then goes on on a
  // fresh thread so the slower plan does not stay, ThreadRenewalPolicy), where each widening it
  // caused (sessions 41–42) kept the caches 2 GiB smaller for the next 32 runs — run 15's scheduler
  // ran 158 of its 200 requests at 4.25 GiB and moved 8 % more bytes than FIFO, which ran 104 of its
  // 200 at 1.25–2.25 GiB. Only when the fresh thread's first item runs short again does the margin
  // widen (WidenCacheMarginForShortRoom): then the room is what is missing. The learned margin
  // halves again once kCacheMarginNarrowAfterRuns runs began on this device (requests, batches and
  // peers' requests: BeginRequest, BeginPeerRun) without such an error (recorded as
  // "narrow_cache_margin"), down to none: the fragments that made the room unusable may be
  // those of one moment (multi-tenant run 12: four VAE runs ran out in the first eleven requests after
  // the budget was set, none in the 389 after, and the doubled margin kept the caches 2 GiB smaller
  // for the whole run).
  void set_streamed_group_cache(bool on, int64_t margin_bytes) {
    streamed_group_cache_ = on;
    streamed_group_cache_margin_ = margin_bytes;
    learned_cache_margin_ = 0;
    quiet_runs_ = 0;
  }
  static constexpr int kCacheMarginNarrowAfterRuns = 32;
  // The margin out-of-memory errors added to the configured one (0 until one happened).
  int64_t learned_cache_margin() const { return learned_cache_margin_; }
  // The device's worker went on on a fresh thread after allocator out-of-memory errors and its first
  // item there ran short again (ThreadRenewalPolicy::fresh_thread_ran_short), the largest refusal
  // `refused_bytes`: the room, not a plan kept on the old thread, is what is missing. Under a budget,
  // with the spare-room caches on and holding room, and the refusal within what they hold and the
  // free memory together (a workspace larger than all of it is not the caches' doing), the learned
  // margin widens as for a failed run (WidenCacheMargin, recorded as "widen_cache_margin" with
  // `reason`) and the caches give back what it added; otherwise nothing changes. A single shortfall a
  // fresh thread does not meet again widens nothing (multi-tenant run 15). Returns whether it widened.
  bool WidenCacheMarginForShortRoom(int64_t refused_bytes, const std::string& reason);
  // How many times WidenCacheMargin ran (a failed run, WidenCacheMarginForShortRoom; at the cap too,
  // where it widens nothing): the device runtime compares it across an item so one shortfall does not
  // widen twice.
  int64_t cache_margin_widenings() const { return cache_margin_widenings_; }
  // Cross-pipeline prefetch on or off (DeviceConfig.prefetch_next_pipeline; default on).
  void set_prefetch_next_pipeline(bool on) { prefetch_next_pipeline_ = on; }
  bool prefetch_next_pipeline() const { return prefetch_next_pipeline_; }
  // Pinned host copies (off by default): each component registered from now on, while it is not
  // group-offloaded, has its host copies page-locked in place (HostWeights::PinInPlace), so placement
  // moves it onto the device at the link's speed instead of pageable memory's (a tenth of it on the
  // H200). Recorded as "pin_host"; a host that refuses (RLIMIT_MEMLOCK) leaves the copies pageable,
  // recorded as "pin_failed" and listed in Warnings(). Group offloading unpins a component first (its
  // host store manages its own memory) and disabling it pins it again.
  void set_pin_host_copies(bool on) { pin_host_copies_ = on; }

  std::vector<ComponentView> Snapshot() const;
  // The whole published view (components with their group-offload statistics, counters, memory).
  PlacementSnapshot TakeSnapshot() const;

  // Group-offloads one component (by id "<pipeline>/<component>"): if resident it leaves the device
  // first; from then on it places itself. Fails, changing nothing, if it is already group-offloaded
  // or the options are refused (the error names the component and the option).
  // With options.choose_compress, the format is chosen first (recorded as a "compress" decision):
  // kNone when the host bytes of the other components plus this one's uncompressed copy fit the
  // host memory budget (or there is none), else the least lossy of int8_grouped and int4 whose
  // estimated host bytes fit, else the one with the fewest (reason "over the host budget").
  absl::Status EnableGroupOffload(const std::string& id, const GroupOffloadOptions& options);
  // Every component of `pipeline` but the excluded ones; all or nothing.
  absl::Status EnablePipelineGroupOffload(const std::string& pipeline,
                                          const PipelineGroupOffloadOptions& options);
  // Removes group offloading; the component is then offloaded (made resident again on next use).
  absl::Status DisableGroupOffload(const std::string& id);
  // How often a component's way of running changed (group offloading enabled — by an admin call,
  // the config or an out-of-memory recovery — or disabled): the first run after a change may load
  // kernels and streams (the context grows) that no earlier run used.
  int64_t run_changes() const { return run_changes_; }
  // Statistics of a group-offloaded component; NOT_FOUND / FAILED_PRECONDITION otherwise.
  absl::StatusOr<GroupOffloadStats> GroupOffloadStatsOf(const std::string& id) const;

 private:
  struct Entry {
    std::string id;
    Component* component;
    std::vector<std::string> pipelines;
    ComponentState state = ComponentState::kOffloaded;
    absl::Time last_use = absl::InfinitePast();
    std::unique_ptr<GroupOffloader> group_offload;
    ComponentLifecycle lifecycle = ComponentLifecycle::kLoading;
    // Prefetch() started its next forward: its slots stay while others run, until it runs.
    bool prefetched = false;
    // Hold() count: held components stay resident (never eviction candidates).
    int holds = 0;
    // Set by PrefetchPipeline while its copies may still run: the copy-stream event they complete
    // at. Arrive() (before it is read) makes the compute stream wait for it; Settle() (before its
    // device copies are freed or copied elsewhere) waits for it on the host.
    std::unique_ptr<DeviceEvent> arriving;
    // Prefetched by PrefetchPipeline for `prefetched_for` and not run since (for the used/unused
    // counters, and the strategy leaves it be while that pipeline's request runs).
    bool pipeline_prefetched = false;
    std::string prefetched_for;
    // A group-offloaded one whose first groups PrefetchPipeline copied (`prefetched` with
    // `prefetched_for` set) for the next request, and those bytes. Its slots stay while the request
    // that prefetched it runs; once that request ended (`group_prefetch_run_ended`), the first run of
    // another pipeline's component gives them back (the scheduler chose otherwise: counted unused).
    int64_t group_prefetch_bytes = 0;
    bool group_prefetch_run_ended = false;
    // The most device memory one of its runs allocated beyond what was there when it began
    // (activations, workspaces; for a group-offloaded one beyond its working set), over the runs
    // so far: room made before it runs again, so that its run does not fail out of memory and
    // throw everything else off the device in the recovery. Grows only.
    int64_t run_headroom = 0;
    // A run of it completed (its run headroom is known).
    bool ran = false;
    // Moved to a peer by peer eviction: no longer registered here; removed at the next sweep
    // (entries_ may be being iterated when it moves).
    bool moved = false;
    // Its runs in the request it last ran in (runs_request: the request id then) and in the one
    // before: how many times a request runs it (a transformer's steps), which ranks spare-room
    // caches (RunsPerRequest).
    std::string runs_request;
    int runs_in_request = 0;
    int runs_last_request = 0;
  };
  // Counts a run of `entry` in the current request (Entry::runs_in_request).
  void CountRun(Entry& entry);
  // How many times a request runs it: the larger of the current (or last) request's runs and the
  // one before's.
  static int RunsPerRequest(const Entry& entry);
  // The device bytes the budget leaves a spare-room cache of group-offloaded `entry` before its run
  // (beside what it holds): the free bytes less its working set still to allocate, the largest run
  // headroom of any component and the margins; INT64_MAX without a budget.
  int64_t SpareRoom(const Entry& entry, int64_t working_set) const;
  // Before a run of streamed `entry` whose cache could hold `wanted` bytes more than the spare room:
  // the caches of components a request runs fewer times (a text encoder beside a transformer's
  // steps) give it their room, the least run first, up to `wanted` — each byte of its cache spares a
  // copy every run, theirs once a request. Recorded as "release_group_cache"; returns the bytes freed.
  int64_t YieldCachesTo(const Entry& entry, int64_t wanted);
  void SweepMoved();
  // An out-of-memory error's message for its "oom" decision, with where the allocator's reserved
  // but unallocated memory lies (DeviceBackend::AllocatorLayoutNote) when it keeps any.
  std::string OomReason(const absl::Status& status);
  // See Entry::arriving. Arrive also counts a pipeline prefetch as used.
  void Arrive(Entry& entry);
  void Settle(Entry& entry);
  // Settle, and a pipeline prefetch not run counts as unused (it is moved or released).
  void DropPrefetch(Entry& entry);
  // Spare-room caches of group-offloaded components but `except`'s shrink, the least recently used
  // first and `last`'s after every other, until `needed` bytes are free (INT64_MAX: all of them go),
  // each recorded as "release_group_cache" with `reason`. Returns the bytes freed.
  int64_t ShrinkCaches(const Entry* except, int64_t needed, const std::string& reason,
                       const Entry* last = nullptr);
  // Shrinks the caches of `holders`, in their order, each by what `still_wanted(bytes freed so far)`
  // asks (all of it when that is its size or more) until it asks nothing, each recorded as
  // "release_group_cache" with `reason(holder)`; then the allocator's cached blocks go. Returns the
  // bytes freed.
  int64_t ReleaseCaches(const std::vector<Entry*>& holders, const std::function<int64_t(int64_t freed)>& still_wanted,
                        const std::function<std::string(const Entry&)>& reason);
  // Before streamed `running` runs: the caches of components that serve none of its pipelines go.
  void ReleaseCachesOfOtherPipelines(const Entry& running);
  // Before a run of group-offloaded `entry` whose working set still to allocate is `working_set`:
  // its spare-room cache allowance (see set_streamed_group_cache; with YieldCachesTo's room),
  // recorded as "release_group_cache" when that gives cached bytes back.
  void GrantGroupCache(Entry& entry, int64_t working_set);
  // Doubles learned_cache_margin_ (at least the configured margin, at most a quarter of the budget).
  void WidenCacheMargin(const std::string& reason);
  // One more run began (BeginRequest, BeginPeerRun): counted in runs_begun; once
  // kCacheMarginNarrowAfterRuns began since the learned margin last widened (or an error at its cap),
  // halves learned_cache_margin_ (to none below the configured margin).
  void CountRunBegun();
  // Entry::prefetched and the group prefetch's fields back to none.
  void ClearGroupPrefetch(Entry& entry);
  // A pipeline prefetch of `entry` not run counts as unused, and loses its mark.
  void MarkUnused(Entry& entry);
  // Idle components give back what they keep on the device besides their weights, each recorded
  // with `reason`: the slot rings of group-offloaded ones (not `running`'s; with `keep_prefetched`
  // not those prefetched to run next), and the captured graphs of resident ones (not `except`'s).
  void ReleaseIdleSlots(const Entry* running, bool keep_prefetched, const std::string& reason);
  void ReleaseIdleGraphs(const Entry* except, const std::string& reason);
  // The host bytes `entry` holds: its host copies; group-offloaded with compression, the compressed
  // copy plus the originals of compressed tensors that stay in RAM (not in a safetensors mapping,
  // whose pages are dropped) and the uncompressed tensors.
  int64_t HostBytesOf(const Entry& entry) const;
  // What `entry` would hold group-offloaded with `format` (kNone: its host copies), estimated from
  // its tensors' shapes as if every group streamed.
  static int64_t EstimateHostBytes(const Entry& entry, CompressFormat format);
  // options.choose_compress: the format for `entry` (see EnableGroupOffload), recorded.
  CompressFormat ChooseCompress(const Entry& entry);
  // Pins `entry`'s host copies when pin_host_copies_ and it is not group-offloaded (see
  // set_pin_host_copies).
  void PinHost(Entry& entry);
  // Takes `e` (no pipeline uses it any more) off the device and the host pins, recorded as
  // "unregister" with `reason`; the caller removes it from entries_.
  void Release(Entry& e, const std::string& reason);
  // Peer eviction of a resident `entry` (see PeerEviction): true when it moved to a peer.
  bool TryPeerEviction(Entry& entry, const std::string& reason, const std::string& cause);
  // The one lifecycle transition function: checks the edge (a wrong one is a programming error and
  // aborts) and applies it.
  static void Transition(Entry& entry, ComponentLifecycle to);
  Entry* Find(const Component& component);
  const Entry* Find(const Component& component) const;
  absl::StatusOr<Entry*> FindById(const std::string& id) const;
  absl::Status EnableLocked(Entry& entry, const GroupOffloadOptions& options)
     ;
  int64_t FreeBytes() const;
  void Record(const std::string& component, const std::string& action, int64_t bytes,
              int64_t free_before, const std::string& reason);
  void Record(PlacementDecision d);
  StrategyInput InputFor(const Entry& target, int64_t needed) const;
  void Offload(Entry& entry, const std::string& reason, const std::string& cause)
     ;
  // Asks the strategy (timed) and carries out its evictions.
  void EvictBefore(const Entry& target, int64_t needed, const std::string& reason)
     ;
  void EvictAfter(const Entry& target);
  void Evict(const std::vector<std::string>& ids, const std::string& reason, const std::string& cause)
     ;
  // Makes a non-group-offloaded entry resident, evicting per strategy, recovering from OOM.
  // `why`: the onload's reason in the log. `may_group_offload`: when nothing else can move, group-
  // offload the component instead of failing (not for held components, which never forward).
  absl::Status MakeResident(Entry& entry, const std::string& why = "needed to run", bool may_group_offload = true);
  // Evicts every movable resident but `keep` — and but those the strategy keeps resident
  // (OffloadStrategy::Keeps) unless `kept_too` — after every spare-room cache; returns the bytes freed.
  int64_t EvictAllBut(const Entry& keep, const std::string& reason, bool kept_too = true);
  // True when a resident component other than `except` that a move may take is one the strategy keeps.
  bool KeepsAnyResident(const Entry& except) const;
  // Out-of-memory recovery while `status` is a device out-of-memory error: every other component but
  // those the strategy keeps moves off (EvictAllBut) and `retry` runs; while it still runs out, the
  // kept ones move too and it runs again. A pass that moved nothing does not retry. Returns the last
  // status.
  absl::Status RetryAfterEvicting(const Entry& keep, const std::string& reason, absl::Status status,
                                  const std::function<absl::Status()>& retry);

  DeviceBackend* backend_;
  std::vector<std::unique_ptr<Entry>> entries_;
  std::unique_ptr<OffloadStrategy> strategy_;
  std::string request_id_;
  PlacementCounters counters_;
  bool prefetch_next_component_ = true;
  bool prefetch_next_pipeline_ = true;
  bool streamed_group_cache_ = false;
  int64_t streamed_group_cache_margin_ = 0;
  int64_t learned_cache_margin_ = 0;  // See set_streamed_group_cache.
  // Runs begun while learned_cache_margin_ > 0 since it last changed or WidenCacheMargin last ran
  // (CountRunBegun).
  int quiet_runs_ = 0;
  int64_t cache_margin_widenings_ = 0;  // See cache_margin_widenings().
  std::string last_peer_request_;  // BeginPeerRun's last request counted.

  bool pin_host_copies_ = false;
  int64_t host_budget_ = 0;
  int64_t run_changes_ = 0;  // See run_changes().
  std::map<std::string, std::string> pin_failures_;  // Component id → why its host copies stay pageable.
  PeerEviction peer_;
  // The decision log is the one part readers on other threads see live.
  mutable absl::Mutex log_mu_;
  std::deque<PlacementDecision> log_ ABSL_GUARDED_BY(log_mu_);
  static constexpr size_t kLogCapacity = 4096;
};

}  // namespace stowage

#endif  // STOWAGE_PLACEMENT_PLACEMENT_MANAGER_H_
