#include "placement/placement_manager.h"

#include "models/core/lora.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <iostream>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "base/load_progress.h"
#include "base/out_of_memory.h"
#include "base/text.h"
#include "base/status_macros.h"
#include "offload/compression.h"
#include "offload/safetensors.h"

namespace stowage {

const char* ComponentStateName(ComponentState state) {
  switch (state) {
    case ComponentState::kOffloaded:
      return "offloaded";
    case ComponentState::kResident:
      return "resident";
    case ComponentState::kGroupOffloaded:
      return "group_offloaded";
    case ComponentState::kPartiallyResident:
      return "partially_resident";
  }
  return "unknown";
}

const char* ComponentLifecycleName(ComponentLifecycle lifecycle) {
  switch (lifecycle) {
    case ComponentLifecycle::kLoading:
      return "loading";
    case ComponentLifecycle::kReady:
      return "ready";
    case ComponentLifecycle::kUnloading:
      return "unloading";
  }
  return "unknown";
}

void PlacementManager::Transition(Entry& entry, ComponentLifecycle to) {
  const ComponentLifecycle from = entry.lifecycle;
  const bool allowed = (from == ComponentLifecycle::kLoading && to == ComponentLifecycle::kReady) ||
                       (from == ComponentLifecycle::kReady && to == ComponentLifecycle::kUnloading) ||
                       (from == ComponentLifecycle::kUnloading && to == ComponentLifecycle::kReady);
  if (!allowed) {
    std::cerr << "stowage: invalid component lifecycle transition of '" << entry.id << "' from "
              << ComponentLifecycleName(from) << " to " << ComponentLifecycleName(to) << std::endl;
    std::abort();
  }
  entry.lifecycle = to;
}

namespace {
bool Uses(const std::vector<std::string>& pipelines, const std::string& pipeline) {
  return std::find(pipelines.begin(), pipelines.end(), pipeline) != pipelines.end();
}

// For decision reasons: the room a component's runs need besides its weights, when known.
std::string HeadroomNote(int64_t run_headroom) {
  if (run_headroom <= 0) return "";
  return absl::StrCat(", and ", run_headroom, " bytes its runs allocate");
}
}  // namespace

void PlacementManager::MarkReady(const std::string& pipeline) {
  SweepMoved();
  for (auto& e : entries_) {
    if (Uses(e->pipelines, pipeline) && e->lifecycle == ComponentLifecycle::kLoading) {
      Transition(*e, ComponentLifecycle::kReady);
    }
  }
}

void PlacementManager::MarkUnloading(const std::string& pipeline) {
  SweepMoved();
  for (auto& e : entries_) {
    if (e->pipelines.size() == 1 && e->pipelines[0] == pipeline && e->lifecycle == ComponentLifecycle::kReady) {
      Transition(*e, ComponentLifecycle::kUnloading);
    }
  }
}

void PlacementManager::AbandonUnloading(const std::string& pipeline) {
  SweepMoved();
  for (auto& e : entries_) {
    if (Uses(e->pipelines, pipeline) && e->lifecycle == ComponentLifecycle::kUnloading) {
      Transition(*e, ComponentLifecycle::kReady);
    }
  }
}

PlacementManager::PlacementManager(DeviceBackend* backend)
    : backend_(backend), strategy_(MakeFootprintStrategy(0)) {}

PlacementManager::~PlacementManager() {
  for (auto& entry : entries_) {
    Settle(*entry);
    entry->group_offload.reset();
    // Components may outlive this manager (shared through the component cache): nothing of theirs
    // may stay registered through a backend that may go with it. Moved entries belong to a peer now.
    if (!entry->moved) entry->component->host_weights().Unpin();
  }
}

int64_t PlacementManager::FreeBytes() const { return backend_->GetMemoryStats().free_bytes(); }

std::string PlacementManager::OomReason(const absl::Status& status) {
  // One line: a library's message may carry a backtrace after its first line.
  std::string message(status.message());
  const size_t newline = message.find('\n');
  if (newline != std::string::npos) message.resize(newline);
  const std::string layout = backend_->AllocatorLayoutNote();
  return layout.empty() ? message : absl::StrCat(message, "; ", layout);
}

void PlacementManager::Record(const std::string& component, const std::string& action,
                              int64_t bytes, int64_t free_before, const std::string& reason) {
  PlacementDecision d;
  d.time = absl::Now();
  d.request_id = request_id_;
  d.component = component;
  d.action = action;
  d.bytes = bytes;
  d.free_before = free_before;
  d.free_after = FreeBytes();
  d.strategy = strategy_->name();
  d.reason = reason;
  Record(std::move(d));
}

void PlacementManager::RecordSchedule(const std::string& request_id, const std::string& pipeline,
                                      const std::string& reason, const std::string& action) {
  PlacementDecision d;
  d.time = absl::Now();
  d.request_id = request_id;
  d.component = pipeline;
  d.action = action;
  d.free_before = d.free_after = FreeBytes();
  d.strategy = strategy_->name();
  d.reason = reason;
  Record(std::move(d));
}

void PlacementManager::Record(PlacementDecision d) {
  absl::MutexLock lock(&log_mu_);
  log_.push_back(std::move(d));
  while (log_.size() > kLogCapacity) log_.pop_front();
}

StrategyInput PlacementManager::InputFor(const Entry& target, int64_t needed) const {
  StrategyInput in;
  in.target = Candidate{target.id, target.component->name(), target.component->weight_bytes(), target.last_use};
  in.needed_bytes = needed;
  in.free_bytes = FreeBytes();
  for (const auto& e : entries_) {
    if (e.get() == &target || e->state != ComponentState::kResident || e->holds > 0) continue;
    // Prefetched for a pipeline whose component runs now (PrefetchPipeline) and not run yet: its
    // request is about to use it. Out-of-memory recovery may still move it.
    if (e->pipeline_prefetched && Uses(target.pipelines, e->prefetched_for)) continue;
    in.resident.push_back(Candidate{e->id, e->component->name(), e->component->weight_bytes(), e->last_use});
  }
  return in;
}

bool PlacementManager::TryPeerEviction(Entry& entry, const std::string& reason, const std::string& cause) {
  // Only evictions that make room before another component runs: a component evicted right after
  // its own run (a workflow "after" rule) may run again in the same request, whose tensors are
  // already on this device.
  // Never a LoRA adapter: the layers that read it run on this device.
  if (!peer_.move || cause != "before_run" || entry.pipelines.size() != 1 || entry.group_offload ||
      entry.component->kind() == kLoraAdapterKind ||
      peer_.peer_bytes_per_second <= 0 || peer_.host_to_device_bytes_per_second <= 0 ||
      (peer_.eligible && !peer_.eligible(entry.pipelines.front()))) {
    return false;
  }
  const int64_t bytes = entry.component->weight_bytes();
  std::string best;
  int64_t best_free = -1;
  for (const auto& peer : peer_.peers ? peer_.peers() : std::vector<std::pair<std::string, int64_t>>{}) {
    if (peer.second >= bytes && peer.second > best_free) {
      best = peer.first;
      best_free = peer.second;
    }
  }
  if (best.empty()) return false;  // No peer has room: the host, as without peer eviction.
  const double d2d = static_cast<double>(bytes) / peer_.peer_bytes_per_second;
  const double h2d = static_cast<double>(bytes) / peer_.host_to_device_bytes_per_second;
  PlacementDecision d;
  d.request_id = request_id_;
  d.component = entry.id;
  d.bytes = bytes;
  d.strategy = strategy_->name();
  d.d2d_seconds = d2d;
  d.h2d_seconds = h2d;
  const int64_t before = FreeBytes();
  absl::Status moved = absl::CancelledError("the host is cheaper");
  if (d2d < h2d) {
    // The peer's placement pins the host copies with its own backend when it adopts them.
    entry.component->host_weights().Unpin();
    moved = peer_.move(entry.pipelines.front(), *entry.component, best);
    if (!moved.ok()) PinHost(entry);  // Still ours.
  }
  if (!moved.ok()) {
    // Recorded as the host offload's companion: why the peer was not taken.
    d.time = absl::Now();
    d.action = "peer_declined";
    d.free_before = before;
    d.free_after = before;
    d.reason = d2d < h2d ? absl::StrCat("moving to ", best, " failed (", moved.message(), "); offloaded to the host")
                         : absl::StrCat("the host is cheaper than ", best, ": bringing it back ", h2d, " s <= moving it ",
                                        d2d, " s; ", reason);
    Record(std::move(d));
    return false;
  }
  // Its slots point at the peer's copies now: this device's copies are gone with them.
  backend_->Synchronize();
  backend_->ReleaseCachedMemory();
  entry.state = ComponentState::kOffloaded;
  entry.moved = true;
  ++counters_.offloads;
  counters_.offload_bytes += bytes;
  ++counters_.evictions[{strategy_->name(), cause}];
  d.time = absl::Now();
  d.action = "offload_to_peer";
  d.to_device = best;
  d.free_before = before;
  d.free_after = FreeBytes();
  d.reason = absl::StrCat("moved to ", best, ": ", d2d, " s device to device < ", h2d,
                          " s to bring it back from the host; ", reason);
  Record(std::move(d));
  return true;
}

void PlacementManager::SweepMoved() {
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(), [](const auto& e) { return e->moved; }),
                 entries_.end());
}

absl::Status PlacementManager::AdoptFromPeer(const std::string& pipeline, Component& component,
                                             const std::string& reason) {
  if (Find(component) != nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("component '", component.name(), "' is already on ", backend_->name()));
  }
  const int64_t bytes = component.weight_bytes();
  const int64_t before = FreeBytes();
  if (before < bytes) {
    return absl::FailedPreconditionError(absl::StrCat(backend_->name(), " has ", before, " free bytes; ",
                                                      component.name(), " needs ", bytes));
  }
  RETURN_IF_ERROR(component.host_weights().OnloadFromPeer(*backend_));
  auto entry = std::make_unique<Entry>();
  entry->id = absl::StrCat(pipeline, "/", component.name());
  entry->component = &component;
  entry->pipelines.push_back(pipeline);
  entry->state = ComponentState::kResident;
  entry->lifecycle = ComponentLifecycle::kReady;
  entry->last_use = absl::Now();
  entries_.push_back(std::move(entry));
  PinHost(*entries_.back());  // Nothing when the peer that had it pinned them already.
  ++counters_.onloads;
  counters_.onload_bytes += bytes;
  Record(absl::StrCat(pipeline, "/", component.name()), "onload_from_peer", bytes, before, reason);
  return absl::OkStatus();
}

void PlacementManager::Offload(Entry& entry, const std::string& reason, const std::string& cause) {
  if (entry.state != ComponentState::kResident) return;
  DropPrefetch(entry);  // Its copies (a pipeline prefetch) complete before its device copies go anywhere.
  // A peer move copies from the peer's worker: this device's worker drops the captured graphs that
  // read these weights first (moves to the host drop them in HostWeights::OffloadAll).
  entry.component->module().ReleaseDeviceCaches();
  if (TryPeerEviction(entry, reason, cause)) return;
  const int64_t before = FreeBytes();
  entry.component->host_weights().OffloadAll();
  backend_->Synchronize();
  backend_->ReleaseCachedMemory();  // What the GPU sees drops with it, not just the allocator's count.
  entry.state = ComponentState::kOffloaded;
  ++counters_.offloads;
  counters_.offload_bytes += entry.component->weight_bytes();
  ++counters_.evictions[{strategy_->name(), cause}];
  Record(entry.id, "offload", entry.component->weight_bytes(), before, reason);
}

void PlacementManager::Evict(const std::vector<std::string>& ids, const std::string& reason,
                             const std::string& cause) {
  for (const std::string& id : ids) {
    for (auto& e : entries_) {
      if (e->id == id && e->state == ComponentState::kResident && e->holds == 0) Offload(*e, reason, cause);
    }
  }
}

void PlacementManager::EvictBefore(const Entry& target, int64_t needed, const std::string& reason) {
  // Spare-room caches hold only room nothing else wanted: they give it back first, the least
  // recently used first, the target's own last (before its run: its working set comes first).
  if (FreeBytes() < needed) ShrinkCaches(nullptr, needed, absl::StrCat("make room: ", reason), &target);
  if (needed > 0 && FreeBytes() < needed) {
    // Under a budget, when weights are about to move to make room, what idle components keep on the
    // device besides their weights (captured graphs: memory the budget does not see as allocated)
    // goes first.
    ReleaseIdleGraphs(&target, absl::StrCat("idle: its captured graphs go before weights move, ", reason));
  }
  const absl::Time start = absl::Now();
  const std::vector<std::string> ids = strategy_->BeforeRun(InputFor(target, needed));
  ++counters_.decisions;
  counters_.decision_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  Evict(ids, reason, "before_run");
}

void PlacementManager::ReleaseIdleGraphs(const Entry* except, const std::string& reason) {
  for (auto& e : entries_) {
    if (e.get() == except || e->state != ComponentState::kResident) continue;
    const int64_t before = FreeBytes();
    const int64_t released = e->component->module().ReleaseDeviceCaches();
    if (released == 0) continue;
    backend_->ReleaseCachedMemory();
    Record(e->id, "release_graphs", released, before, reason);
  }
}

void PlacementManager::ReleaseIdleSlots(const Entry* running, bool keep_prefetched, const std::string& reason) {
  for (const auto& e : entries_) {
    if (e.get() == running || !e->group_offload || !e->group_offload->holds_slots()) continue;
    // Prefetched to run next: its first groups are in the slots. One prefetched for another
    // pipeline's next request stays until the request that prefetched it ended and a component not
    // of that pipeline runs first.
    const bool other_came_first = e->group_prefetch_run_ended && running != nullptr &&
                                  !Uses(running->pipelines, e->prefetched_for);
    if (keep_prefetched && e->prefetched && !other_came_first) continue;
    const int64_t before = FreeBytes();
    const int64_t released = e->group_offload->ReleaseSlots();
    if (e->prefetched && e->group_prefetch_bytes > 0) ++counters_.pipeline_prefetches_unused;
    ClearGroupPrefetch(*e);
    if (released > 0) Record(e->id, "release_slots", released, before, reason);
  }
}

int64_t PlacementManager::ShrinkCaches(const Entry* except, int64_t needed, const std::string& reason,
                                       const Entry* last) {
  std::vector<Entry*> holders;
  for (auto& e : entries_) {
    if (e.get() != except && e->group_offload && e->group_offload->cache_bytes() > 0) holders.push_back(e.get());
  }
  // Least recently used first (ties keep registry order), `last` after every other.
  std::stable_sort(holders.begin(), holders.end(), [last](const Entry* a, const Entry* b) {
    if ((a == last) != (b == last)) return b == last;
    return a->last_use < b->last_use;
  });
  const bool all = needed == INT64_MAX;
  return ReleaseCaches(holders, [&](int64_t) { return all ? INT64_MAX : needed - FreeBytes(); },
                       [&](const Entry&) { return reason; });
}

int64_t PlacementManager::ReleaseCaches(const std::vector<Entry*>& holders,
                                        const std::function<int64_t(int64_t freed)>& still_wanted,
                                        const std::function<std::string(const Entry&)>& reason) {
  int64_t freed = 0;
  for (Entry* e : holders) {
    const int64_t wanted = still_wanted(freed);
    if (wanted <= 0) break;
    const int64_t before = FreeBytes();
    const int64_t cached = e->group_offload->cache_bytes();
    const int64_t released =
        e->group_offload->SetCacheAllowance(wanted >= cached ? 0 : cached - wanted);
    if (released == 0) continue;
    freed += released;
    Record(e->id, "release_group_cache", released, before, reason(*e));
  }
  // The allocator's blocks go back too, so the next allocations find them (on CUDA, rather than new
  // segments beside cached ones).
  if (freed > 0) backend_->ReleaseCachedMemory();
  return freed;
}

void PlacementManager::ReleaseCachesOfOtherPipelines(const Entry& running) {
  for (auto& e : entries_) {
    if (e.get() == &running || !e->group_offload || e->group_offload->cache_bytes() == 0) continue;
    bool shared = false;
    for (const std::string& p : e->pipelines) shared = shared || Uses(running.pipelines, p);
    if (shared) continue;
    const int64_t before = FreeBytes();
    const int64_t released = e->group_offload->SetCacheAllowance(0);
    if (released > 0) {
      Record(e->id, "release_group_cache", released, before,
             absl::StrCat("streamed ", running.id, " of another pipeline runs: the spare room is its now"));
      backend_->ReleaseCachedMemory();
    }
  }
}

int64_t PlacementManager::SpareRoom(const Entry& entry, int64_t working_set) const {
  const int64_t free = FreeBytes();
  if (free == INT64_MAX) return INT64_MAX;  // No budget.
  // Whatever runs next (this one's next forward, or the next component of its request) must find
  // its run's room without the cache giving it back mid-request — for another streamed component of
  // its pipelines that room includes the working set it allocates (else the cache would fill with
  // the room that one takes back at its every run).
  int64_t headroom = entry.run_headroom;
  for (const auto& e : entries_) {
    if (e->moved) continue;
    int64_t needs = e->run_headroom;
    if (e.get() != &entry && e->group_offload) {
      bool shared = false;
      for (const std::string& p : e->pipelines) shared = shared || Uses(entry.pipelines, p);
      if (shared) needs += e->group_offload->bytes_needed_to_run();
    }
    headroom = std::max(headroom, needs);
  }
  const int64_t margin = streamed_group_cache_margin_ + learned_cache_margin_;
  return std::max<int64_t>(free - working_set - headroom - margin, 0);
}

int PlacementManager::RunsPerRequest(const Entry& entry) {
  return std::max(entry.runs_in_request, entry.runs_last_request);
}

void PlacementManager::CountRun(Entry& entry) {
  if (entry.runs_request != request_id_) {
    if (entry.runs_in_request > 0) entry.runs_last_request = entry.runs_in_request;
    entry.runs_in_request = 0;
    entry.runs_request = request_id_;
  }
  ++entry.runs_in_request;
}

int64_t PlacementManager::YieldCachesTo(const Entry& entry, int64_t wanted) {
  const int runs = RunsPerRequest(entry);
  std::vector<Entry*> holders;
  for (auto& e : entries_) {
    if (e.get() == &entry || !e->group_offload || e->group_offload->cache_bytes() == 0) continue;
    if (RunsPerRequest(*e) < runs) holders.push_back(e.get());
  }
  // The least run a request first, then the least recently used.
  std::stable_sort(holders.begin(), holders.end(), [](const Entry* a, const Entry* b) {
    if (RunsPerRequest(*a) != RunsPerRequest(*b)) return RunsPerRequest(*a) < RunsPerRequest(*b);
    return a->last_use < b->last_use;
  });
  return ReleaseCaches(
      holders, [wanted](int64_t freed) { return wanted - freed; },
      [&](const Entry& e) {
        return absl::StrCat(entry.id, " runs ", runs, " times a request, ", e.id, " ", RunsPerRequest(e),
                            ": the spare room saves more copies as its cache");
      });
}

void PlacementManager::GrantGroupCache(Entry& entry, int64_t working_set) {
  int64_t allowance = 0;
  if (streamed_group_cache_ && entry.ran) {
    int64_t room = SpareRoom(entry, working_set);
    if (room == INT64_MAX) {
      allowance = INT64_MAX;  // No budget.
    } else {
      const int64_t cached = entry.group_offload->cache_bytes();
      // What its cache could still take beyond the room there is (at most its streamed groups
      // widened) comes from the caches of components a request runs fewer times.
      const int64_t wanted = entry.group_offload->stats().streamed_bytes - cached - room;
      if (wanted > 0) room += YieldCachesTo(entry, wanted);
      allowance = cached + room;
    }
  }
  const int64_t before = FreeBytes();
  const int64_t freed = entry.group_offload->SetCacheAllowance(allowance);
  if (freed > 0) {
    Record(entry.id, "release_group_cache", freed, before,
           absl::StrCat("its spare-room cache above the room its run leaves (", allowance, " bytes)"));
  }
}

void PlacementManager::WidenCacheMargin(const std::string& reason) {
  const int64_t budget = backend_->MemoryBudget();
  const int64_t cap = budget > 0 ? budget / 4 : (int64_t{4} << 30);
  const int64_t widened =
      std::min(std::max(2 * learned_cache_margin_, std::max<int64_t>(streamed_group_cache_margin_, 1)), cap);
  // An error at the cap still says the margin is too small: the count of quiet runs starts again.
  quiet_runs_ = 0;
  ++cache_margin_widenings_;
  if (widened == learned_cache_margin_) return;
  // Below it only when the budget fell since it widened (the cap is a quarter of the budget).
  const bool wider = widened > learned_cache_margin_;
  learned_cache_margin_ = widened;
  Record("", wider ? "widen_cache_margin" : "narrow_cache_margin", streamed_group_cache_margin_ + learned_cache_margin_,
         FreeBytes(),
         absl::StrCat(reason, ": spare-room caches leave ", streamed_group_cache_margin_ + learned_cache_margin_,
                      " bytes free beyond what runs allocate from now on"));
}

bool PlacementManager::WidenCacheMarginForShortRoom(int64_t refused_bytes, const std::string& reason) {
  // Without a budget the caches leave no margin (and FreeBytes() is INT64_MAX).
  if (!streamed_group_cache_ || backend_->MemoryBudget() <= 0) return false;
  int64_t cached = 0;
  for (const auto& e : entries_) {
    if (!e->moved && e->group_offload) cached += e->group_offload->cache_bytes();
  }
  if (cached == 0) return false;  // No cache holds room: a wider margin would give nothing back.
  // A refusal larger than the caches and the free memory together (a library probing for a workspace
  // no room holds) is not the caches' doing; 0: the size was not kept, no telling.
  if (refused_bytes <= 0 || refused_bytes > cached + std::max<int64_t>(FreeBytes(), 0)) return false;
  const int64_t before = learned_cache_margin_;
  WidenCacheMargin(absl::StrCat(reason, " while spare-room caches held ", cached, " bytes"));
  const int64_t added = learned_cache_margin_ - before;
  if (added > 0) ShrinkCaches(nullptr, FreeBytes() + added, absl::StrCat(reason, ": the caches leave the wider margin"));
  return true;
}

void PlacementManager::CountRunBegun() {
  ++counters_.runs_begun;
  if (learned_cache_margin_ == 0) return;  // Nothing to narrow (and no count to keep).
  if (++quiet_runs_ < kCacheMarginNarrowAfterRuns) return;
  const int64_t was = learned_cache_margin_;
  learned_cache_margin_ = was / 2 < std::max<int64_t>(streamed_group_cache_margin_, 1) ? 0 : was / 2;
  quiet_runs_ = 0;
  Record("", "narrow_cache_margin", streamed_group_cache_margin_ + learned_cache_margin_, FreeBytes(),
         absl::StrCat(kCacheMarginNarrowAfterRuns, " runs began without one running out of memory while spare-room "
                      "caches held room: they leave ", streamed_group_cache_margin_ + learned_cache_margin_,
                      " bytes free beyond what runs allocate"));
}

void PlacementManager::ClearGroupPrefetch(Entry& entry) {
  entry.prefetched = false;
  if (entry.group_prefetch_bytes > 0) entry.prefetched_for.clear();
  entry.group_prefetch_bytes = 0;
  entry.group_prefetch_run_ended = false;
}

void PlacementManager::EvictAfter(const Entry& target) {
  const absl::Time start = absl::Now();
  // AfterRun may name the target itself ("after text_encoder: offload text_encoder").
  const std::vector<std::string> ids = strategy_->AfterRun(InputFor(target, 0));
  ++counters_.decisions;
  counters_.decision_seconds += absl::ToDoubleSeconds(absl::Now() - start);
  Evict(ids, absl::StrCat("after ", target.id, " ran"), "after_run");
}

bool PlacementManager::KeepsAnyResident(const Entry& except) const {
  for (const auto& e : entries_) {
    if (e.get() != &except && e->state == ComponentState::kResident && e->holds == 0 &&
        strategy_->Keeps(e->id, e->component->name())) {
      return true;
    }
  }
  return false;
}

absl::Status PlacementManager::RetryAfterEvicting(const Entry& keep, const std::string& reason, absl::Status status,
                                                  const std::function<absl::Status()>& retry) {
  for (const bool kept_too : {false, true}) {
    if (!IsDeviceOom(status) || (kept_too && !KeepsAnyResident(keep))) break;
    const int64_t freed = EvictAllBut(keep, reason, kept_too);
    if (!kept_too && freed == 0 && KeepsAnyResident(keep)) continue;  // Nothing moved: no retry yet.
    backend_->ReleaseCachedMemory();
    status = retry();
  }
  return status;
}

int64_t PlacementManager::EvictAllBut(const Entry& keep, const std::string& reason, bool kept_too) {
  int64_t freed = ShrinkCaches(&keep, INT64_MAX, reason);
  for (auto& e : entries_) {
    if (e.get() == &keep || e->state != ComponentState::kResident || e->holds > 0) continue;
    if (!kept_too && strategy_->Keeps(e->id, e->component->name())) continue;
    freed += e->component->weight_bytes();
    Offload(*e, reason, "out_of_memory");
  }
  return freed;
}

absl::Status PlacementManager::MakeResident(Entry& entry, const std::string& why, bool may_group_offload) {
  const int64_t needed = entry.component->weight_bytes();
  EvictBefore(entry, needed + entry.run_headroom,
              absl::StrCat("make room for ", entry.id, " (", needed, " bytes", HeadroomNote(entry.run_headroom), ")"));
  int64_t before = FreeBytes();
  absl::Status status = entry.component->host_weights().OnloadAll(*backend_);
  if (IsDeviceOom(status)) {
    // Recovery 1: move every other movable resident off, return cached blocks, retry.
    Record(entry.id, "oom", needed, before, OomReason(status));
    status = RetryAfterEvicting(entry, absl::StrCat("out of memory onloading ", entry.id), std::move(status), [&] {
      before = FreeBytes();
      return entry.component->host_weights().OnloadAll(*backend_);
    });
    if (status.ok()) ++counters_.oom_recoveries;
  }
  if (IsDeviceOom(status) && !may_group_offload) {
    return MakeCannotFitStatus(absl::StrCat("component '", entry.id, "' does not fit on ", backend_->name(),
                                            " beside what stays (", status.message(), ")"));
  }
  if (IsDeviceOom(status)) {
    // Recovery 2: nothing else can move: group-offload the component itself (block level, streams),
    // its host copy pinned where it is (no second copy in RAM, no minutes of packing a large model
    // into new pinned memory; staged through a small ring where the host refuses to pin).
    GroupOffloadOptions options;
    options.use_stream = backend_->supports_streams();
    options.target = OffloadTarget::kPageableHost;
    const absl::Status enabled = EnableLocked(entry, options);
    if (!enabled.ok()) {
      return MakeCannotFitStatus(absl::StrCat(
          "component '", entry.id, "' does not fit on ", backend_->name(), ": onload failed (",
          status.message(), "); evicting every other component did not help; group offloading it "
          "failed too (", enabled.message(), ")"));
    }
    ++counters_.oom_recoveries;
    Record(entry.id, "group_offload", entry.group_offload->stats().working_set_bytes, before,
           "out of memory even with every other component offloaded");
    return absl::OkStatus();
  }
  if (!status.ok()) return status;
  entry.state = ComponentState::kResident;
  ++counters_.onloads;
  counters_.onload_bytes += needed;
  Record(entry.id, "onload", needed, before, why);
  return absl::OkStatus();
}

absl::Status PlacementManager::Hold(Component& component, const std::string& reason) {
  SweepMoved();
  Entry* entry = Find(component);
  if (entry == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat("component '", component.name(), "' is not registered with placement"));
  }
  if (entry->group_offload) {
    return absl::FailedPreconditionError(absl::StrCat("component '", entry->id, "' is group-offloaded; only whole "
                                                      "components are held on the device"));
  }
  if (entry->state == ComponentState::kOffloaded) RETURN_IF_ERROR(MakeResident(*entry, reason, /*may_group_offload=*/false));
  Arrive(*entry);
  ++entry->holds;
  entry->last_use = absl::Now();
  return absl::OkStatus();
}

void PlacementManager::Unhold(Component& component) {
  Entry* entry = Find(component);
  if (entry != nullptr && entry->holds > 0) --entry->holds;
}

std::string PlacementManager::SetStrategy(std::unique_ptr<OffloadStrategy> strategy) {
  strategy_ = std::move(strategy);
  Record("", "set_strategy", 0, FreeBytes(), strategy_->name());
  for (auto& e : entries_) {
    if (e->group_offload && strategy_->footprint_based()) {
      return "the footprint strategy manages group-offloaded components: their footprint is their "
             "working set (slots), not their weights";
    }
  }
  return "";
}

std::vector<std::string> PlacementManager::Warnings() const {
  std::vector<std::string> warnings;
  for (const auto& [id, why] : pin_failures_) {
    warnings.push_back(absl::StrCat("host copies of '", id, "' are not pinned (", why,
                                    "): moving it onto the device runs at pageable-memory speed"));
  }
  if (!strategy_->footprint_based()) return warnings;
  for (const auto& e : entries_) {
    if (e->group_offload) {
      warnings.push_back(absl::StrCat("footprint strategy manages group-offloaded component '", e->id,
                                      "': it is never moved, and only its working set counts"));
    }
  }
  return warnings;
}

void PlacementManager::SetRequestId(std::string request_id) {
  request_id_ = std::move(request_id);
}

void PlacementManager::BeginRequest(std::string request_id) {
  SetRequestId(std::move(request_id));
  CountRunBegun();
}

void PlacementManager::BeginPeerRun(std::string request_id) {
  // A peer's request runs its components here one call at a time (a transformer's every step):
  // counted once, at its first.
  if (request_id != last_peer_request_) {
    last_peer_request_ = request_id;
    CountRunBegun();
  }
  SetRequestId(std::move(request_id));
}

std::vector<PlacementDecision> PlacementManager::DecisionLog(size_t limit) const {
  absl::MutexLock lock(&log_mu_);
  const size_t n = std::min(limit, log_.size());
  return std::vector<PlacementDecision>(log_.end() - static_cast<std::ptrdiff_t>(n), log_.end());
}

absl::Status PlacementManager::Register(const std::string& pipeline, Component* component) {
  SweepMoved();
  if (Entry* existing = Find(*component)) {
    existing->pipelines.push_back(pipeline);
    // Another pipeline uses it now: it is no longer on its way out.
    if (existing->lifecycle == ComponentLifecycle::kUnloading) Transition(*existing, ComponentLifecycle::kReady);
    return absl::OkStatus();
  }
  auto entry = std::make_unique<Entry>();
  entry->id = absl::StrCat(pipeline, "/", component->name());
  entry->component = component;
  entry->pipelines.push_back(pipeline);
  component->host_weights().OffloadAll();
  entries_.push_back(std::move(entry));
  // Pinning reads the host copies: a component with deferred FP8 weights (made with its int4 copy
  // when group offloading starts, right after registering) would have them written on the host
  // first. It is pinned when it next needs to be (group offloading switched off, or refused).
  if (component->host_weights().has_unwritten()) {
    Record(entries_.back()->id, "pin_deferred", 0, FreeBytes(),
           "host copies not page-locked yet: its FP8 weights are made with their int4 copy, not on the host");
    return absl::OkStatus();
  }
  PinHost(*entries_.back());
  return absl::OkStatus();
}

void PlacementManager::PinHost(Entry& entry) {
  if (!pin_host_copies_ || entry.group_offload) return;
  HostWeights& weights = entry.component->host_weights();
  if (weights.pinned_in_place()) return;
  const int64_t before = FreeBytes();
  const absl::Status pinned = weights.PinInPlace(*backend_);
  if (pinned.ok()) {
    pin_failures_.erase(entry.id);
    const std::string where =
        weights.last_pin_moved_bytes() > 0
            ? absl::StrCat("host copies moved off the heap into their own arena (",
                           weights.last_pin_moved_bytes(), " bytes) and page-locked there")
        : weights.pinned_in_place_bytes() == 0 ? std::string("host copies already page-locked (a pinned arena)")
                                               : std::string("host copies page-locked in place");
    AddLoadBytesPinned(weights.pinned_in_place_bytes());  // A load in progress shows it (ListPipelines).
    Record(entry.id, "pin_host", weights.pinned_in_place_bytes(), before,
           absl::StrCat(where, ": moves onto the device run at the link's speed"));
    return;
  }
  pin_failures_[entry.id] = std::string(pinned.message());
  Record(entry.id, "pin_failed", 0, before,
         absl::StrCat("host copies stay pageable (moves run at pageable-memory speed): ", pinned.message()));
}

void PlacementManager::Unregister(const std::string& pipeline) {
  SweepMoved();
  for (auto it = entries_.begin(); it != entries_.end();) {
    Entry& e = **it;
    e.pipelines.erase(std::remove(e.pipelines.begin(), e.pipelines.end(), pipeline), e.pipelines.end());
    if (!e.pipelines.empty()) {
      ++it;
      continue;
    }
    Release(e, absl::StrCat("pipeline '", pipeline, "' unloaded"));
    it = entries_.erase(it);
  }
}

void PlacementManager::Release(Entry& e, const std::string& reason) {
  DropPrefetch(e);
  const int64_t before = FreeBytes();
  e.group_offload.reset();
  e.component->host_weights().OffloadAll();
  backend_->Synchronize();
  backend_->ReleaseCachedMemory();
  e.component->host_weights().Unpin();
  pin_failures_.erase(e.id);
  Record(e.id, "unregister", e.component->weight_bytes(), before, reason);
}

absl::Status PlacementManager::UnregisterComponent(const std::string& pipeline, const Component& component,
                                                   const std::string& reason) {
  SweepMoved();
  for (auto it = entries_.begin(); it != entries_.end(); ++it) {
    Entry& e = **it;
    if (e.component != &component || !Uses(e.pipelines, pipeline)) continue;
    e.pipelines.erase(std::remove(e.pipelines.begin(), e.pipelines.end(), pipeline), e.pipelines.end());
    if (!e.pipelines.empty()) return absl::OkStatus();
    Release(e, reason);
    entries_.erase(it);
    return absl::OkStatus();
  }
  return absl::NotFoundError(absl::StrCat("component '", component.name(), "' of pipeline '", Truncated(pipeline),
                                          "' is not registered on ", backend_->name()));
}

std::vector<std::string> PlacementManager::PipelinesOf(const Component& component) const {
  const Entry* entry = Find(component);
  return entry == nullptr ? std::vector<std::string>{} : entry->pipelines;
}

std::optional<ComponentState> PlacementManager::StateOf(const Component& component) const {
  const Entry* entry = Find(component);
  if (entry == nullptr) return std::nullopt;
  return entry->state;
}

bool PlacementManager::Hosts(const std::string& pipeline) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const auto& e) { return !e->moved && Uses(e->pipelines, pipeline); });
}

const PlacementManager::Entry* PlacementManager::Find(const Component& component) const {
  for (const auto& entry : entries_) {
    if (entry->component == &component && !entry->moved) return entry.get();
  }
  return nullptr;
}

PlacementManager::Entry* PlacementManager::Find(const Component& component) {
  for (auto& entry : entries_) {
    if (entry->component == &component && !entry->moved) return entry.get();
  }
  return nullptr;
}

void PlacementManager::Prefetch(Component& component) {
  SweepMoved();
  if (!prefetch_next_component_) return;
  Entry* entry = Find(component);
  if (entry == nullptr || !entry->group_offload) return;
  const int64_t free_before = FreeBytes();
  // Only with room for its whole working set: a prefetch never evicts anything.
  if (entry->group_offload->bytes_needed_to_run() > free_before) return;
  absl::StatusOr<int64_t> copied = entry->group_offload->PrefetchNextForward();
  if (!copied.ok() || *copied == 0) return;
  entry->prefetched = true;
  Record(entry->id, "prefetch", *copied, free_before,
         "it runs next: its first groups copy while the current component computes");
}

void PlacementManager::LastRunNext(Component& component) {
  Entry* entry = Find(component);
  if (entry != nullptr && entry->group_offload) entry->group_offload->SkipPrefetchAfterNextForward();
}

absl::Status PlacementManager::SetMemoryBudget(int64_t bytes, std::vector<std::string>* offloaded) {
  SweepMoved();
  const int64_t previous = backend_->MemoryBudget();
  const int64_t before = FreeBytes();
  RETURN_IF_ERROR(backend_->SetMemoryBudget(bytes));
  const std::string why = absl::StrCat("memory budget set to ", bytes, " bytes (was ", previous, ")");
  // A smaller budget: what the allocator caches beyond it goes back to the device whatever happens.
  if (bytes > 0 && (previous == 0 || bytes < previous)) backend_->ReleaseCachedMemory();
  if (FreeBytes() < 0) {
    // What idle components hold besides their weights goes first.
    ReleaseIdleSlots(nullptr, /*keep_prefetched=*/false, why);
    ShrinkCaches(nullptr, INT64_MAX, why);
    ReleaseIdleGraphs(nullptr, why);
    backend_->ReleaseCachedMemory();
  }
  // Refused: the budget as it was.
  const auto refuse = [&](const std::string& message) {
    const absl::Status restored = backend_->SetMemoryBudget(previous);
    return absl::FailedPreconditionError(absl::StrCat(
        message, "; the budget stays ", previous,
        restored.ok() ? "" : absl::StrCat(" (restoring it failed: ", restored.message(), ")")));
  };
  if (FreeBytes() < 0) {
    std::vector<Entry*> movable;
    int64_t movable_bytes = 0;
    std::vector<std::string> staying;
    for (auto& e : entries_) {
      if (e->state == ComponentState::kResident && e->holds == 0) {
        movable.push_back(e.get());
        movable_bytes += e->component->weight_bytes();
      } else if (e->holds > 0) {
        staying.push_back(absl::StrCat(e->id, " (held by a run, ", e->component->weight_bytes(), " bytes)"));
      } else if (e->group_offload && e->group_offload->device_bytes() > 0) {
        staying.push_back(
            absl::StrCat(e->id, " (group-offloaded working set, ", e->group_offload->device_bytes(), " bytes)"));
      }
    }
    if (FreeBytes() + movable_bytes < 0) {
      return refuse(absl::StrCat("a memory budget of ", bytes, " bytes is ", -(FreeBytes() + movable_bytes),
                                 " bytes short of what cannot move off ", backend_->name(), " (its context and ",
                                 staying.empty() ? std::string("nothing else") : absl::StrJoin(staying, ", "), ")"));
    }
    std::sort(movable.begin(), movable.end(), [](const Entry* a, const Entry* b) { return a->last_use < b->last_use; });
    for (Entry* e : movable) {
      if (FreeBytes() >= 0) break;
      Offload(*e, why, "budget");
      offloaded->push_back(e->id);
    }
    SweepMoved();
    if (FreeBytes() < 0) {  // Weights counted as movable did not free what they weigh.
      return refuse(absl::StrCat("a memory budget of ", bytes, " bytes is still ", -FreeBytes(),
                                 " bytes short after moving ", offloaded->size(), " components to the host"));
    }
  }
  Record("", "set_budget", bytes, before, why);
  return absl::OkStatus();
}

void PlacementManager::Arrive(Entry& entry) {
  if (entry.pipeline_prefetched) {
    entry.pipeline_prefetched = false;
    ++counters_.pipeline_prefetches_used;
    counters_.pipeline_prefetch_used_bytes += entry.component->weight_bytes();
  }
  if (entry.arriving == nullptr) return;
  backend_->ComputeStreamWait(*entry.arriving);
  entry.arriving.reset();
}

void PlacementManager::Settle(Entry& entry) {
  if (entry.arriving == nullptr) return;
  entry.arriving->Wait();
  entry.arriving.reset();
}

void PlacementManager::MarkUnused(Entry& entry) {
  if (!entry.pipeline_prefetched) return;
  entry.pipeline_prefetched = false;
  ++counters_.pipeline_prefetches_unused;
}

void PlacementManager::EndPipelineRun(const std::string& pipeline) {
  for (auto& e : entries_) {
    if (e->prefetched_for == pipeline) MarkUnused(*e);
    // First groups prefetched for another pipeline during this request: from now on a component
    // of a third pipeline running first gives them back.
    if (e->group_prefetch_bytes > 0 && e->prefetched_for != pipeline) e->group_prefetch_run_ended = true;
  }
}

void PlacementManager::DropPrefetch(Entry& entry) {
  Settle(entry);
  MarkUnused(entry);
  if (entry.group_prefetch_bytes > 0) ++counters_.pipeline_prefetches_unused;  // Its slots go unrun.
  ClearGroupPrefetch(entry);
}

int64_t PlacementManager::PrefetchPipeline(const std::string& next, const std::vector<const Component*>& next_components,
                                           const std::vector<const Component*>& remaining, const std::string& reason) {
  SweepMoved();
  if (!prefetch_next_pipeline_ || next.empty()) return 0;
  // The running request copies nothing more: every component it has still to run is resident.
  int64_t keep = 0;
  for (const Component* c : remaining) {
    const Entry* e = Find(*c);
    if (e == nullptr || e->group_offload || e->state != ComponentState::kResident) return 0;
    keep = std::max(keep, e->run_headroom);
  }
  // A ready component of the next request that the running one does not run.
  const auto for_next = [&](const Entry* e) {
    return e != nullptr && e->lifecycle == ComponentLifecycle::kReady && Uses(e->pipelines, next) &&
           std::find(remaining.begin(), remaining.end(), e->component) == remaining.end();
  };
  // Whether `bytes` fit beside the running request's headroom; `before`: the free bytes now. Room is
  // counted against what the allocator holds (its cached blocks too: on CUDA the budget caps them,
  // and an allocation past it would flush the cache mid-request).
  const auto fits = [&](int64_t bytes, int64_t* before) {
    const DeviceMemoryStats stats = backend_->GetMemoryStats();
    *before = stats.free_bytes();
    return stats.budget_bytes <= 0 ||
           bytes <= stats.budget_bytes - stats.context_bytes - std::max(stats.reserved_bytes, stats.allocated_bytes) - keep;
  };
  int64_t started = 0;
  for (const Component* c : next_components) {
    Entry* e = Find(*c);
    if (!for_next(e) || e->state != ComponentState::kOffloaded || e->group_offload ||
        e->component->kind() == kLoraAdapterKind || !e->component->host_weights().pinned_in_place()) {
      continue;
    }
    const int64_t bytes = e->component->weight_bytes();
    int64_t before = 0;
    if (!fits(bytes, &before)) continue;  // A smaller one further on may still fit.
    absl::StatusOr<std::unique_ptr<DeviceEvent>> copying = e->component->host_weights().OnloadAllAsync(*backend_);
    if (!copying.ok()) {
      Record(e->id, "prefetch_failed", bytes, before, absl::StrCat(reason, ": ", copying.status().message()));
      continue;
    }
    e->arriving = *std::move(copying);
    e->state = ComponentState::kResident;
    e->pipeline_prefetched = true;
    e->prefetched_for = next;
    e->last_use = absl::Now();
    ++counters_.onloads;
    counters_.onload_bytes += bytes;
    ++counters_.pipeline_prefetches;
    counters_.pipeline_prefetch_bytes += bytes;
    started += bytes;
    Record(e->id, "prefetch_pipeline", bytes, before,
           absl::StrCat(reason, "; ", before - keep, " bytes free beyond the running request's run headroom (", keep, ")"));
  }
  // The first streamed component of the next request: its first groups.
  for (const Component* c : next_components) {
    Entry* e = Find(*c);
    if (!for_next(e) || !e->group_offload) continue;
    if (e->prefetched) break;  // Its first groups are in its slots already.
    const int64_t needed = e->group_offload->bytes_needed_to_run();
    int64_t before = 0;
    if (!fits(needed, &before)) break;
    absl::StatusOr<int64_t> copied = e->group_offload->PrefetchNextForward();
    if (!copied.ok()) {
      Record(e->id, "prefetch_failed", needed, before, absl::StrCat(reason, ": ", copied.status().message()));
      break;
    }
    if (*copied == 0) break;  // Its forward has not run yet (no order recorded), or no streams.
    e->prefetched = true;
    e->prefetched_for = next;
    e->group_prefetch_bytes = *copied;
    e->group_prefetch_run_ended = false;
    ++counters_.pipeline_prefetches;
    counters_.pipeline_prefetch_bytes += *copied;
    started += *copied;
    Record(e->id, "prefetch_pipeline", *copied, before,
           absl::StrCat(reason, "; its first groups into its slots (", needed, " bytes to allocate, ", before - keep,
                        " free beyond the running request's run headroom)"));
    break;
  }
  return started;
}

absl::Status PlacementManager::Run(Component& component, const std::function<void()>& fn) {
  SweepMoved();
  Entry* entry = nullptr;
  int64_t working_set = 0;  // What a group-offloaded one's forward allocates for its groups.
  {
    entry = Find(component);
    if (entry == nullptr) {
      return absl::FailedPreconditionError(
          absl::StrCat("component '", component.name(), "' is not registered with placement"));
    }
    CountRun(*entry);
    // Group-offloaded components that sit idle give their slot rings back while another runs.
    ReleaseIdleSlots(entry, /*keep_prefetched=*/true, absl::StrCat("idle while ", entry->id, " runs"));
    if (entry->group_offload) ReleaseCachesOfOtherPipelines(*entry);
    if (entry->group_offload) {
      // It places itself, but its slots (when released) and its always-on groups are allocated for
      // its forward: make room for them and for what its runs allocate besides.
      working_set = entry->group_offload->bytes_needed_to_run();
      EvictBefore(*entry, working_set + entry->run_headroom,
                  absl::StrCat("make room for group-offloaded ", entry->id, "'s working set",
                               HeadroomNote(entry->run_headroom)));
      GrantGroupCache(*entry, working_set);
    } else if (entry->state == ComponentState::kOffloaded) {
      RETURN_IF_ERROR(MakeResident(*entry));
    } else {
      EvictBefore(*entry, entry->run_headroom,
                  absl::StrCat("before ", entry->id, " runs", HeadroomNote(entry->run_headroom)));
    }
    Arrive(*entry);
    entry->last_use = absl::Now();
    if (entry->group_prefetch_bytes > 0) {  // Its first groups came with the pipeline prefetch.
      ++counters_.pipeline_prefetches_used;
      counters_.pipeline_prefetch_used_bytes += entry->group_prefetch_bytes;
    }
    ClearGroupPrefetch(*entry);
  }
  // What the run allocates beyond what is there now (less the working set a group-offloaded one
  // allocates when its slots were released), for the room made before its next run.
  int64_t window_start = backend_->BeginPeakWindow();
  // The spare-room cache grows during a run, and is not what the run needs: a run whose cache stayed
  // the same (every forward but a request's first) measures the headroom, the larger wins.
  const int64_t cache_before = entry->group_offload ? entry->group_offload->cache_bytes() : 0;
  const auto learn_headroom = [&] {
    const int64_t cache_grown =
        entry->group_offload ? std::max<int64_t>(entry->group_offload->cache_bytes() - cache_before, 0) : 0;
    const int64_t grown = backend_->WindowPeakAllocated() - window_start - working_set - cache_grown;
    entry->run_headroom = std::max(entry->run_headroom, grown);
    entry->ran = true;
  };
  absl::Status status = CatchAsStatus(absl::StrCat("running ", component.name()), fn);
  if (status.ok()) learn_headroom();
  // After room was made: the run once more, its headroom measured from here.
  const auto run_again = [&] {
    window_start = backend_->BeginPeakWindow();
    status = CatchAsStatus(absl::StrCat("running ", component.name()), fn);
    if (status.ok()) learn_headroom();
  };
  if (IsDeviceOom(status)) {
    // The forward itself ran out (activations): free everything else and try once more, then
    // group-offload the component and try again.
    const int64_t before = FreeBytes();
    Record(entry->id, "oom", 0, before, OomReason(status));
    // Spare-room caches first: they hold only room nothing else wanted, so the run tries again
    // with all of it back before any weights move (a kept-resident component stays), and the
    // caches keep a wider margin from then on.
    const int64_t cached = ShrinkCaches(nullptr, INT64_MAX, absl::StrCat("out of memory running ", entry->id));
    if (cached > 0) {
      WidenCacheMargin(absl::StrCat("out of memory running ", entry->id, " while spare-room caches held ",
                                    cached, " bytes"));
      run_again();
    }
    status = RetryAfterEvicting(*entry, absl::StrCat("out of memory running ", entry->id), std::move(status), [&] {
      run_again();
      return status;
    });
    if (IsDeviceOom(status) && !entry->group_offload) {
      entry->component->host_weights().OffloadAll();
      entry->state = ComponentState::kOffloaded;
      GroupOffloadOptions options;
      options.use_stream = backend_->supports_streams();
      const absl::Status enabled = EnableLocked(*entry, options);
      if (enabled.ok()) {
        Record(entry->id, "group_offload", entry->group_offload->stats().working_set_bytes, FreeBytes(),
               "out of memory while running, with every other component offloaded");
        status = CatchAsStatus(absl::StrCat("running ", component.name()), fn);
      }
    }
    if (status.ok()) {
      ++counters_.oom_recoveries;
    } else if (IsDeviceOom(status)) {
      return MakeCannotFitStatus(absl::StrCat(
          "running '", entry->id, "' ran out of device memory; tried: evicting every other component, "
          "releasing cached memory, group-offloading it; last error: ", status.message()));
    }
  }
  if (!status.ok()) return status;
  EvictAfter(*entry);
  SweepMoved();  // `entry` may have moved to a peer: not used below.
  return absl::OkStatus();
}

std::vector<ComponentView> PlacementManager::Snapshot() const {
  std::vector<ComponentView> views;
  for (const auto& entry : entries_) {
    if (entry->moved) continue;
    ComponentView view;
    view.id = entry->id;
    view.name = entry->component->name();
    view.kind = entry->component->kind();
    view.compute = entry->component->compute();
    view.pipelines = entry->pipelines;
    view.weight_bytes = entry->component->weight_bytes();
    view.state = entry->state;
    if (entry->state == ComponentState::kResident) view.device_bytes = view.weight_bytes;
    if (entry->group_offload) {
      view.device_bytes = entry->group_offload->device_bytes();
      view.group_offload = entry->group_offload->stats();
    }
    view.last_use = entry->last_use;
    view.lifecycle = entry->lifecycle;
    view.run_headroom_bytes = entry->run_headroom;
    view.ran = entry->ran;
    views.push_back(std::move(view));
  }
  return views;
}

PlacementSnapshot PlacementManager::TakeSnapshot() const {
  PlacementSnapshot snapshot;
  snapshot.device = backend_->name();
  snapshot.memory = backend_->GetMemoryStats();
  snapshot.strategy = strategy_->name();
  snapshot.components = Snapshot();
  snapshot.warnings = Warnings();
  snapshot.counters = counters_;
  snapshot.cache_margin_bytes = streamed_group_cache_ ? streamed_group_cache_margin_ + learned_cache_margin_ : 0;
  return snapshot;
}

absl::StatusOr<PlacementManager::Entry*> PlacementManager::FindById(const std::string& id) const {
  std::vector<std::string> ids;
  for (const auto& entry : entries_) {
    if (entry->moved) continue;
    if (entry->id == id) return entry.get();
    ids.push_back(entry->id);
  }
  return absl::NotFoundError(absl::StrCat("component '", Truncated(id), "' not found; known: ",
                                          absl::StrJoin(ids, ", ")));
}

namespace {

// True when a host copy is a view of a live safetensors mapping (its pages can be dropped from RSS);
// copies elsewhere (heap, arena, pinned memory) stay in RAM whatever the group offloader stores
// beside them.
bool InMapping(const at::Tensor& host) { return !MappedFilesContaining({host.data_ptr()}).empty(); }

}  // namespace

int64_t PlacementManager::EstimateHostBytes(const Entry& entry, CompressFormat format) {
  HostWeights& weights = entry.component->host_weights();
  if (format == CompressFormat::kNone) return weights.bytes();
  int64_t bytes = 0;
  for (const HostWeights::Entry& e : weights.entries()) {
    const int64_t compressed = TensorScratchBytes(format, e.host.scalar_type(), e.host.sizes());
    const auto original = static_cast<int64_t>(e.host.nbytes());
    // A copy in the packed buffer (compressed, or the tensor itself, aligned), and the original
    // where it stays in RAM (not a view of a safetensors mapping, whose pages are dropped).
    // A deferred FP8 weight not written yet: the compressed store makes its copy from the source, so
    // the host copy's pages are never taken.
    // (int4 only: other formats do not take the FP8 codes, so the store writes them into RAM.)
    const bool in_ram = !InMapping(e.host) && (!weights.unwritten(e) || format != CompressFormat::kInt4);
    bytes += (compressed > 0 ? compressed : AlignScratch(original)) + (in_ram ? original : 0);
  }
  return bytes;
}

int64_t PlacementManager::HostBytesOf(const Entry& entry) const {
  if (entry.group_offload == nullptr || entry.group_offload->stats().compress == "none") {
    return entry.component->host_weights().bytes();
  }
  int64_t bytes = entry.group_offload->stats().compressed_host_bytes;
  const HostWeights& weights = entry.component->host_weights();
  for (const HostWeights::Entry& e : entry.component->host_weights().entries()) {
    if (!InMapping(e.host) && !weights.unwritten(e)) bytes += static_cast<int64_t>(e.host.nbytes());
  }
  return bytes;
}

int64_t PlacementManager::HostBytes() const {
  int64_t bytes = 0;
  for (const auto& e : entries_) {
    if (!e->moved) bytes += HostBytesOf(*e);
  }
  return bytes;
}

CompressFormat PlacementManager::ChooseCompress(const Entry& entry) {
  const int64_t others = HostBytes() - HostBytesOf(entry);
  const CompressFormat order[] = {CompressFormat::kNone, CompressFormat::kInt8Grouped, CompressFormat::kInt4};
  std::string estimates;
  CompressFormat smallest = CompressFormat::kNone;
  int64_t smallest_bytes = INT64_MAX;
  for (CompressFormat format : order) {
    const int64_t bytes = EstimateHostBytes(entry, format);
    absl::StrAppend(&estimates, estimates.empty() ? "" : ", ", CompressFormatName(format), " ", bytes);
    if (host_budget_ <= 0 || others + bytes <= host_budget_) {
      Record(entry.id, "compress", bytes, FreeBytes(),
             host_budget_ <= 0
                 ? std::string("compress AUTO without a host memory budget: none")
                 : absl::StrCat(CompressFormatName(format), ": ", others, " host bytes of other components + ", bytes,
                                " fit the host budget of ", host_budget_, " (estimates: ", estimates, ")"));
      return format;
    }
    if (bytes < smallest_bytes) {
      smallest = format;
      smallest_bytes = bytes;
    }
  }
  Record(entry.id, "compress", smallest_bytes, FreeBytes(),
         absl::StrCat(CompressFormatName(smallest), ", over the host budget: ", others,
                      " host bytes of other components + the fewest estimated (", estimates, ") exceed ",
                      host_budget_));
  return smallest;
}

absl::Status PlacementManager::EnableLocked(Entry& entry, const GroupOffloadOptions& options) {
  if (entry.component->kind() == kLoraAdapterKind) {
    return absl::FailedPreconditionError(absl::StrCat("component '", entry.id, "' is a LoRA adapter: adapters "
                                                      "move whole (every adapted layer reads them), never group by group"));
  }
  if (entry.holds > 0) {
    return absl::FailedPreconditionError(absl::StrCat("component '", entry.id, "' is held on the device by a run"));
  }
  if (entry.group_offload) {
    return absl::FailedPreconditionError(absl::StrCat(
        "component '", entry.id, "' is already group-offloaded; disable it before changing options"));
  }
  DropPrefetch(entry);  // Its device copies go: the copies of a pipeline prefetch complete first.
  GroupOffloadOptions effective = options;
  Component& component = *entry.component;
  if (effective.choose_compress) {
    effective.compress = ChooseCompress(entry);
    effective.choose_compress = false;
  }
  if (effective.compress != CompressFormat::kNone && effective.prequantized == nullptr &&
      component.prequantized() != nullptr && component.prequantized_format() == effective.compress) {
    effective.prequantized = component.prequantized();  // The checkpoint's own 8-bit bytes.
  }
  // One directory per component under the configured one.
  std::string name = entry.id;
  std::replace(name.begin(), name.end(), '/', '_');
  component.host_weights().Unpin();  // The group offloader's host store manages the host memory now.
  auto applied = GroupOffloader::Apply(name, component.module(), component.host_weights(), *backend_, effective);
  if (!applied.ok() && IsDeviceOom(applied.status())) {
    // Its resident groups and slots do not fit beside what is resident now: make room as for an
    // out-of-memory onload (every other movable component leaves), then try once more.
    const int64_t before = FreeBytes();
    Record(entry.id, "oom", 0, before, OomReason(applied.status()));
    EvictAllBut(entry, absl::StrCat("make room for group offloading ", entry.id));
    backend_->ReleaseCachedMemory();
    applied = GroupOffloader::Apply(name, component.module(), component.host_weights(), *backend_, effective);
  }
  if (!applied.ok()) {
    PinHost(entry);
    return applied.status();
  }
  entry.group_offload = *std::move(applied);
  entry.state = entry.group_offload->stats().resident_groups > 0 ? ComponentState::kPartiallyResident
                                                                 : ComponentState::kGroupOffloaded;
  ++run_changes_;
  return absl::OkStatus();
}

absl::Status PlacementManager::EnableGroupOffload(const std::string& id,
                                                  const GroupOffloadOptions& options) {
  ASSIGN_OR_RETURN(Entry * entry, FindById(id));
  return EnableLocked(*entry, options);
}

absl::Status PlacementManager::EnablePipelineGroupOffload(const std::string& pipeline,
                                                          const PipelineGroupOffloadOptions& options) {
  std::vector<Entry*> targets;
  std::set<std::string> names;
  for (auto& entry : entries_) {
    if (std::find(entry->pipelines.begin(), entry->pipelines.end(), pipeline) == entry->pipelines.end()) continue;
    // The pipeline's LoRA adapters move whole: a whole-pipeline call leaves them as they are.
    if (entry->component->kind() == kLoraAdapterKind) continue;
    names.insert(entry->component->name());
    if (std::find(options.exclude.begin(), options.exclude.end(), entry->component->name()) !=
        options.exclude.end()) {
      continue;
    }
    targets.push_back(entry.get());
  }
  if (names.empty()) return absl::NotFoundError(absl::StrCat("pipeline '", Truncated(pipeline), "' not found"));
  for (const std::string& excluded : options.exclude) {
    if (names.count(excluded) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("exclude: pipeline '", Truncated(pipeline),
                                                     "' has no component '", Truncated(excluded), "'"));
    }
  }
  for (const auto& [name, unused] : options.overrides) {
    if (names.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("overrides: pipeline '", Truncated(pipeline),
                                                     "' has no component '", Truncated(name), "'"));
    }
  }
  for (size_t i = 0; i < targets.size(); ++i) {
    auto it = options.overrides.find(targets[i]->component->name());
    absl::Status status = EnableLocked(*targets[i], it != options.overrides.end() ? it->second : options.defaults);
    if (!status.ok()) {
      for (size_t j = 0; j < i; ++j) {  // All or nothing.
        targets[j]->group_offload.reset();
        targets[j]->state = ComponentState::kOffloaded;
        PinHost(*targets[j]);
      }
      return status;
    }
  }
  return absl::OkStatus();
}

absl::Status PlacementManager::DisableGroupOffload(const std::string& id) {
  ASSIGN_OR_RETURN(Entry * entry, FindById(id));
  if (!entry->group_offload) {
    return absl::FailedPreconditionError(absl::StrCat("component '", id, "' is not group-offloaded"));
  }
  DropPrefetch(*entry);
  entry->group_offload.reset();
  entry->state = ComponentState::kOffloaded;
  PinHost(*entry);
  ++run_changes_;
  return absl::OkStatus();
}

absl::StatusOr<GroupOffloadStats> PlacementManager::GroupOffloadStatsOf(const std::string& id) const {
  ASSIGN_OR_RETURN(Entry * entry, FindById(id));
  if (!entry->group_offload) {
    return absl::FailedPreconditionError(absl::StrCat("component '", id, "' is not group-offloaded"));
  }
  return entry->group_offload->stats();
}

}  // namespace stowage
