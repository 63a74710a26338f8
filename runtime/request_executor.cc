#include "runtime/request_executor.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include <ATen/ThreadLocalState.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "base/log.h"
#include "base/process_memory.h"
#include "base/status_macros.h"
#include "runtime/device_runtime.h"
#include "runtime/reply.h"

namespace stowage {
namespace {

// Cross-pipeline prefetch during one run (PlacementManager::PrefetchPipeline): before each of the
// running request's components runs on this device, asks the worker which pipeline waits next and
// hands placement the components that pipeline's request will run and those this request has still
// to run — both known from the order each pipeline ran its components last time — so the next
// pipeline's weights copy while this one computes, when nothing the request still needs would wait
// behind them. Also records this run's order for the next run of the pipeline.
class NextPipelinePrefetch {
 public:
  // The components a pipeline's request runs, in the order its last run first used them; empty
  // when it has not run since it loaded (then nothing of it is prefetched).
  using OrderOf = std::function<std::vector<const Component*>(const std::string& pipeline)>;

  // `learned`: this pipeline's order (indices into components()); empty before its first run (then
  // nothing is prefetched while it runs).
  NextPipelinePrefetch(Pipeline& pipeline, std::vector<size_t> learned, OrderOf order_of, PlacementManager& placement,
                       WorkerScope& scope)
      : pipeline_(pipeline.name()),
        components_(pipeline.components()),
        learned_(std::move(learned)),
        order_of_(std::move(order_of)),
        placement_(placement),
        scope_(scope) {}

  void BeforeRun(const Component& component) {
    const auto it = std::find(components_.begin(), components_.end(), &component);
    if (it == components_.end()) return;  // Not one of the pipeline's own (an adapter): no order.
    const auto index = static_cast<size_t>(it - components_.begin());
    if (std::find(seen_.begin(), seen_.end(), index) == seen_.end()) seen_.push_back(index);
    if (!placement_.prefetch_next_pipeline()) return;
    const auto at = std::find(learned_.begin(), learned_.end(), index);
    if (at == learned_.end()) return;
    const std::string next = scope_.worker().NextWaitingPipeline(scope_, pipeline_);
    if (next.empty()) return;
    // One attempt per position in the order and next pipeline: a component that runs again (the
    // transformer, every step) meets the same resident components and the same room.
    if (index == tried_index_ && next == tried_next_) return;
    tried_index_ = index;
    tried_next_ = next;
    const std::vector<const Component*> next_components = order_of_(next);
    if (next_components.empty()) return;
    std::vector<const Component*> remaining;
    for (auto i = at; i != learned_.end(); ++i) {
      if (*i < components_.size()) remaining.push_back(components_[*i]);
    }
    (void)placement_.PrefetchPipeline(
        next, next_components, remaining,
        absl::StrCat("pipeline '", next, "' waits next in the queue: copied while '", pipeline_, "' runs ",
                     component.name()));
  }

  // The order this run first used the pipeline's components in.
  const std::vector<size_t>& seen() const { return seen_; }

 private:
  const std::string pipeline_;
  const std::vector<Component*> components_;
  const std::vector<size_t> learned_;
  const OrderOf order_of_;
  PlacementManager& placement_;
  WorkerScope& scope_;
  std::vector<size_t> seen_;
  size_t tried_index_ = SIZE_MAX;  // The last attempt's position and next pipeline.
  std::string tried_next_;
};

// The ComponentRunner of one run on this device: components of the pipeline that live here run
// through this device's placement, those of a split pipeline that live on a peer run on the peer's
// worker (DeviceRuntime::RunForPeer). Between component runs the worker serves its remote-call
// lane, so peers waiting on this device are not held up for a whole request.
class SplitRunner : public ComponentRunner {
 public:
  // `home` is the device running the request; where each component runs is looked up at each call
  // (peer eviction may move one during the run).
  // `next` (optional): the cross-pipeline prefetch of a request's run.
  SplitRunner(PlacementManager& local, WorkerScope& scope, const DeviceRuntime& home, std::string pipeline,
              std::string request_id, Interrupt interrupt, NextPipelinePrefetch* next = nullptr)
      : local_(local),
        scope_(scope),
        home_(home),
        pipeline_(std::move(pipeline)),
        request_id_(std::move(request_id)),
        interrupt_(std::move(interrupt)),
        next_(next) {}

  absl::Status Run(Component& component, const std::function<void()>& fn) override {
    scope_.worker().ServeCalls(scope_);
    DeviceRuntime* peer = home_.PeerFor(pipeline_, component);
    if (peer == nullptr) {
      if (next_ != nullptr) next_->BeforeRun(component);
      // The last-run hint, given now: a peer's call served just above may have run the component.
      if (last_run_next_ == &component) local_.LastRunNext(component);
      last_run_next_ = nullptr;
      return local_.Run(component, fn);
    }
    last_run_next_ = nullptr;
    return peer->RunForPeer(component, fn, /*prefetch_only=*/false, request_id_, &scope_, interrupt_, &UsageOf(*peer));
  }
  void Prefetch(Component& component) override {
    DeviceRuntime* peer = home_.PeerFor(pipeline_, component);
    if (peer == nullptr) return local_.Prefetch(component);
    // A hint: a peer that cannot take it (stopping) changes nothing.
    (void)peer->RunForPeer(component, nullptr, /*prefetch_only=*/true, request_id_, &scope_, interrupt_,
                           &UsageOf(*peer));
  }
  // Held until the component's next Run here (only this device's placement prefetches within its
  // forwards; a component on a peer keeps its ring there, and its copies serve the next request).
  void LastRunNext(Component& component) override { last_run_next_ = &component; }
  // Preemption between steps (RequestExecutor::Run sets it for requests; a warm-up has none).
  void BetweenSteps(int done, int total) override {
    if (between_steps_) between_steps_(done, total);
  }
  void set_between_steps(std::function<void(int done, int total)> fn) { between_steps_ = std::move(fn); }
  c10::Device DeviceOf(const Component& component, const c10::Device& home) const override {
    DeviceRuntime* peer = home_.PeerFor(pipeline_, component);
    return peer == nullptr ? home : peer->torch_device();
  }
  // What the run did on each peer, in the order it first used them.
  const std::vector<v1::DeviceUsage>& peer_usage() const { return usage_; }

 private:
  v1::DeviceUsage& UsageOf(const DeviceRuntime& peer) {
    for (v1::DeviceUsage& u : usage_) {
      if (u.device() == peer.device_name()) return u;
    }
    usage_.emplace_back();
    usage_.back().set_device(peer.device_name());
    return usage_.back();
  }

  PlacementManager& local_;
  WorkerScope& scope_;
  const DeviceRuntime& home_;
  const std::string pipeline_;
  const std::string request_id_;
  const Interrupt interrupt_;
  NextPipelinePrefetch* const next_;
  std::function<void(int done, int total)> between_steps_;
  std::vector<v1::DeviceUsage> usage_;
  Component* last_run_next_ = nullptr;  // LastRunNext's component, until its next Run.
};

// Set aside for the context's growth during a warm-up's first run (DeviceRuntime::WarmUp), and
// during the first request after a change on the device.
constexpr int64_t kWarmupContextReserve = int64_t{1} << 30;

// The reserve: 1 GiB, at most a quarter of what the context leaves of the budget.
int64_t ContextReserve(const DeviceMemoryStats& stats) {
  return std::min(kWarmupContextReserve, std::max<int64_t>(0, stats.budget_bytes - stats.context_bytes) / 4);
}
constexpr std::array<const char*, 12> kWarmupWords = {"a", "red", "fox", "in", "a", "snowy", "forest", "under",
                                                      "the", "northern", "lights", "painted"};

}  // namespace

RequestExecutor::RequestExecutor(DeviceRuntime& device, ServerMetrics* metrics)
    : device_(device), metrics_(metrics) {}

void RequestExecutor::EndContextReserve(WorkerScope& scope, int64_t reserve, const std::string& what) {
  DeviceBackend& backend = device_.Backend(scope);
  backend.SetContextReserve(0);
  const int64_t context_before = backend.GetMemoryStats().context_bytes;
  device_.RefreshContext(scope);
  const int64_t grew = backend.GetMemoryStats().context_bytes - context_before;
  if (grew > reserve) {
    LogWarning(absl::StrCat(what, " device=", device_.device_name(), " context_grew_mib=", grew / (int64_t{1} << 20),
                            " reserved_mib=", reserve / (int64_t{1} << 20),
                            " (more than set aside: the budget may have been exceeded by the difference)"));
  }
}

void RequestExecutor::KeepPeakFloor(const DeviceMemoryStats& before) {
  peak_floor_allocated_ = std::max(peak_floor_allocated_, before.peak_allocated_bytes);
  peak_floor_reserved_ = std::max(peak_floor_reserved_, before.peak_process_bytes());
}

void RequestExecutor::WarmUp(WorkerScope& scope, Pipeline& pipeline, const Interrupt& interrupt) {
  GenerationParams params;
  // About as long as a typical prompt, so the text encoder meets the shapes requests bring.
  params.prompt = "warm-up: a lighthouse on a rocky cliff above the sea at dusk, warm light, oil painting";
  params.negative_prompt = "";
  params.width = pipeline.limits().default_width;
  params.height = pipeline.limits().default_height;
  params.steps = std::min(2, pipeline.limits().max_steps);
  params.guidance_scale = pipeline.limits().default_guidance_scale;
  params.seed = 0;
  const std::string request_id = absl::StrCat("warmup-", pipeline.name());
  device_.Placement(scope).SetRequestId(request_id);
  RunContext context(interrupt, nullptr);
  const absl::Time start = absl::Now();
  absl::StatusOr<Image> image = absl::InternalError("warm-up did not run");
  // The warm-up teaches the order the pipeline runs its components in (nothing is prefetched while
  // it runs), so its first request may already be prefetched.
  NextPipelinePrefetch learn(pipeline, {}, [](const std::string&) { return std::vector<const Component*>{}; },
                             device_.Placement(scope), scope);
  SplitRunner runner(device_.Placement(scope), scope, device_, pipeline.name(), request_id, interrupt, &learn);
  // The first run loads the kernels and library workspaces the pipeline uses (0.7 GB measured on an
  // H200 for Z-Image): placement and the allocator keep a reserve (1 GiB, at most a quarter of what
  // the context leaves of the budget) out of the budget for them until the context is measured again
  // after it, so the warm-up stays within the budget.
  const int64_t reserve = ContextReserve(device_.Backend(scope).GetMemoryStats());
  device_.Backend(scope).SetContextReserve(reserve);
  absl::Status thrown = CatchAsStatus("warm-up", [&] { image = pipeline.Run(params, runner, context); });
  device_.Backend(scope).Synchronize();
  EndContextReserve(scope, reserve, absl::StrCat("warmup pipeline=", LogValue(pipeline.name())));
  run_changes_seen_ = device_.Placement(scope).run_changes();  // The warm-up ran under them.
  // Then one step for prompts of other lengths: each caption length the text encoder and the
  // transformer meet first builds attention plans and allocator blocks of its own, which the first
  // request of that length would otherwise pay for (seen on the H200: 2.1x the warm latency).
  int extra = 0;
  for (const int words : {3, 8, 16, 32, 64, 120}) {
    if (!thrown.ok() || !image.ok() || (interrupt && !interrupt().ok())) break;
    std::string prompt;
    for (int w = 0; w < words; ++w) absl::StrAppend(&prompt, w == 0 ? "" : " ", kWarmupWords[w % kWarmupWords.size()]);
    GenerationParams short_run = params;
    short_run.prompt = prompt;
    short_run.steps = 1;
    // A run of its own in the placement log, so placement counts each run's component runs apart
    // (how many times a request runs a component ranks the spare-room caches).
    device_.Placement(scope).SetRequestId(absl::StrCat(request_id, "-", words, "-words"));
    thrown = CatchAsStatus("warm-up", [&] { image = pipeline.Run(short_run, runner, context); });
    ++extra;
  }
  device_.Backend(scope).Synchronize();
  device_.RefreshContext(scope);
  if (!learn.seen().empty()) run_order_[pipeline.name()] = LearnedOrder{&pipeline, learn.seen()};
  const absl::Status status = thrown.ok() ? image.status() : thrown;
  if (status.ok()) {
    LogInfo(absl::StrCat("warmup pipeline=", LogValue(pipeline.name()), " device=", device_.device_name(), " phase=warmed_up size=",
                         params.width, "x", params.height, " steps=", params.steps, " prompt_lengths=", extra + 1,
                         absl::StrFormat(" seconds=%.3f", absl::ToDoubleSeconds(absl::Now() - start))));
  } else {
    LogWarning(absl::StrCat("warmup pipeline=", LogValue(pipeline.name()), " device=", device_.device_name(),
                            " phase=failed error=", LogValue(status.ToString(), 300)));
  }
}

void RequestExecutor::Run(WorkerScope& scope, const std::vector<Request*>& requests, bool batching) {
  // Requests whose pipeline went, or whose caller went, while they waited get their status now.
  std::vector<Request*> running;
  for (Request* r : requests) {
    if (!device_.pipelines_.StillHosted(r->pipeline->name(), r->pipeline.get())) {
      r->result = absl::NotFoundError(
          absl::StrCat("pipeline '", r->pipeline->name(), "' was unloaded while the request waited"));
      continue;
    }
    const absl::Status interrupted = r->control->interrupt ? r->control->interrupt() : absl::OkStatus();
    if (!interrupted.ok()) {
      r->result = interrupted;
      continue;
    }
    running.push_back(r);
  }
  if (running.empty()) return;
  // Every member is hosted now, so all name the one hosted pipeline object.
  Pipeline& pipeline = *running.front()->pipeline;
  const int batch_size = static_cast<int>(running.size());
  // stowage_requests_running: set while the members run (replies are set below, before the
  // worker wakes their callers).
  struct Running {
    ServerMetrics* metrics;
    const std::string& device;
    std::atomic<int>& count;
    ~Running() {
      count.store(0, std::memory_order_relaxed);
      if (metrics != nullptr) metrics->SetRunning(device, 0);
    }
  } running_gauge{metrics_, device_.device_name(), running_};
  running_.store(batch_size, std::memory_order_relaxed);
  if (metrics_ != nullptr) metrics_->SetRunning(device_.device_name(), batch_size);
  const absl::Time start = absl::Now();

  std::vector<std::string> ids;
  for (Request* r : running) {
    ids.push_back(r->request->request_id().empty() ? absl::StrCat("req-", ++request_counter_)
                                                   : r->request->request_id());
  }
  PlacementManager& placement = device_.Placement(scope);
  DeviceBackend& backend = device_.Backend(scope);
  // The placement log names the request (or the batch) its decisions were made for.
  placement.BeginRequest(batch_size == 1 ? ids.front() : absl::StrCat("batch(", absl::StrJoin(ids, ","), ")"));
  backend.ResetPeakStats();
  peak_floor_allocated_ = 0;
  peak_floor_reserved_ = 0;
  peak_floor_rss_ = 0;
  // Peak RSS falls back to the lifetime peak where clear_refs is not writable (still an upper
  // bound, never an under-report).
  (void)ResetPeakRss();
  // The first request after a component's way of running changed (group offloading enabled or
  // disabled since the last run) may run kernels and streams no warm-up ran: the context grows
  // while it runs (700 MiB measured on the H200 after Flux went int4-streamed), so it gets the
  // warm-up's reserve.
  const bool first_after_change = placement.run_changes() != run_changes_seen_;
  run_changes_seen_ = placement.run_changes();
  const int64_t context_reserve = first_after_change ? ContextReserve(backend.GetMemoryStats()) : 0;
  if (context_reserve > 0) backend.SetContextReserve(context_reserve);
  const DeviceMemoryStats before = backend.GetMemoryStats();

  std::vector<std::unique_ptr<RunContext>> contexts;
  std::vector<BatchMember> members;
  for (Request* r : running) {
    const CallControl* control = r->control;
    const google::protobuf::Duration queue_wait = ToProto(r->queue_wait);
    contexts.push_back(std::make_unique<RunContext>(
        control->interrupt, [control, queue_wait, start](const std::string& stage, int step, int total) {
          if (!control->on_progress) return;
          v1::Progress progress;
          progress.set_stage(stage);
          progress.set_step(step);
          progress.set_total_steps(total);
          *progress.mutable_elapsed() = ToProto(absl::Now() - start);
          *progress.mutable_queue_wait() = queue_wait;
          control->on_progress(progress);
        }));
    contexts.back()->set_shared(batch_size > 1);
    // The compute stream only: copies on the copy stream (prefetches, streamed groups) run on.
    contexts.back()->set_synchronize([&backend] { backend.RecordOnComputeStream()->Wait(); });
    if (r->request->partial_images() > 0 && control->on_preview) {
      contexts.back()->set_previews(PreviewSteps(r->request->partial_images(), r->params.steps - StartStep(r->params)), control->on_preview);
    }
    members.push_back(BatchMember{&r->params, contexts.back().get()});
  }

  // A remote call of a split pipeline waits for its caller while any member still waits.
  Interrupt all_gone = [&running]() -> absl::Status {
    absl::Status last = absl::OkStatus();
    for (Request* r : running) {
      if (!r->control->interrupt) return absl::OkStatus();
      last = r->control->interrupt();
      if (last.ok()) return last;
    }
    return last;
  };
  LearnedOrder& order = run_order_[pipeline.name()];
  if (order.pipeline != &pipeline) order = LearnedOrder{&pipeline, {}};  // Loaded again since: learn afresh.
  // Another pipeline's order, when the object it was learned from is the one hosted now (its
  // components live while it is hosted: an unload runs on this worker, never during this run).
  const auto order_of = [this](const std::string& name) -> std::vector<const Component*> {
    const auto it = run_order_.find(name);
    if (it == run_order_.end()) return {};
    const absl::StatusOr<std::shared_ptr<Pipeline>> hosted = device_.pipelines_.Resolve(name);
    if (!hosted.ok() || hosted->get() != it->second.pipeline) return {};
    const std::vector<Component*> all = (*hosted)->components();
    std::vector<const Component*> out;
    for (size_t i : it->second.components) {
      if (i < all.size()) out.push_back(all[i]);
    }
    return out;
  };
  NextPipelinePrefetch next(pipeline, order.components, order_of, placement, scope);
  const std::string run_id = batch_size == 1 ? ids.front() : absl::StrCat("batch(", absl::StrJoin(ids, ","), ")");
  SplitRunner runner(placement, scope, device_, pipeline.name(), run_id, all_gone, &next);
  // Preemption (SchedulerConfig.preemption): between two denoising steps a waiting request the
  // scheduler prefers runs to its end on this worker (DeviceWorker::PreemptBetweenSteps), this
  // run's tensors kept on the device. It resets the device's peaks, the RSS peak, the placement
  // log's request id and the running gauge for itself: this run keeps the peaks it had reached
  // and the larger of the preempting run's (the device held both), its own id and gauge, and
  // leaves out of its stages and byte counts the pause and what the preempting run moved. Not
  // during a first run after a change (its context reserve measures the context's growth).
  Paused paused;
  if (context_reserve == 0) {
    runner.set_between_steps([&](int done, int total) {
      // Read only when a request preempts this one (`before`, just before it runs): with nothing
      // waiting a step boundary costs no device synchronisation and no /proc read.
      DeviceMemoryStats at;
      int64_t floor_allocated = 0, floor_reserved = 0, floor_rss = 0;
      absl::Time pause_start;
      const auto before = [&] {
        // This run's own queued kernels finish first: they are not the pause.
        backend.RecordOnComputeStream()->Wait();
        at = backend.GetMemoryStats();
        floor_allocated = std::max(peak_floor_allocated_, at.peak_allocated_bytes);
        floor_reserved = std::max(peak_floor_reserved_, at.peak_process_bytes());
        const absl::StatusOr<ProcessMemory> rss = ReadProcessMemory();
        floor_rss = std::max(peak_floor_rss_, rss.ok() ? rss->peak_rss_bytes : 0);
        for (const std::unique_ptr<RunContext>& context : contexts) context->ReportPaused(done, total);
        pause_start = absl::Now();
      };
      const double remaining = total > 0 ? static_cast<double>(total - done) / total : 0.0;
      if (!scope.worker().PreemptBetweenSteps(scope, remaining, before)) return;
      const absl::Duration pause = absl::Now() - pause_start;
      const DeviceMemoryStats resumed = backend.GetMemoryStats();
      const absl::StatusOr<ProcessMemory> rss_after = ReadProcessMemory();
      paused.time += pause;
      ++paused.count;
      paused.host_to_device_bytes += resumed.host_to_device_bytes - at.host_to_device_bytes;
      paused.device_to_host_bytes += resumed.device_to_host_bytes - at.device_to_host_bytes;
      paused.allocator_retries += resumed.allocator_retries - at.allocator_retries;
      paused.allocator_ooms += resumed.allocator_ooms - at.allocator_ooms;
      // The preempting run's peaks: the device's since its reset, and the floors a peer's run
      // during it kept (KeepPeakFloor), which its Run left in the members.
      peak_floor_allocated_ = std::max({floor_allocated, resumed.peak_allocated_bytes, peak_floor_allocated_});
      peak_floor_reserved_ = std::max({floor_reserved, resumed.peak_process_bytes(), peak_floor_reserved_});
      peak_floor_rss_ = std::max({floor_rss, rss_after.ok() ? rss_after->peak_rss_bytes : 0, peak_floor_rss_});
      placement.SetRequestId(run_id);
      running_.store(batch_size, std::memory_order_relaxed);
      if (metrics_ != nullptr) metrics_->SetRunning(device_.device_name(), batch_size);
      for (const std::unique_ptr<RunContext>& context : contexts) context->ExcludeFromStage(pause);
    });
  }
  std::vector<absl::StatusOr<Image>> images;
  absl::Status files = pipeline.CheckSourceFiles();
  if (files.ok()) {
    // Work a pipeline does outside its components' runs (noise, the scheduler step, the image's
    // quantisation on the device) may throw too, e.g. a device out of memory: every member gets it.
    // The members' adapters still attached? An unload may have run since the requests were
    // accepted. A member whose adapter went fails alone; the others run.
    std::vector<absl::Status> adapters(running.size());
    // Each member's adapter components (to hold on the device while the batch runs).
    std::vector<std::vector<AdapterTable::Use>> uses(running.size());
    for (size_t i = 0; i < running.size(); ++i) {
      absl::StatusOr<std::vector<AdapterTable::Use>> used = device_.adapters_.Uses(pipeline.name(), running[i]->request->loras());
      if (used.ok()) {
        uses[i] = std::move(*used);
      } else {
        adapters[i] = used.status();
      }
    }
    // Adapters are placed like components: each one a member uses is made resident and held there
    // (no other move evicts it) for the batch. One that cannot be placed fails the members using it.
    AdapterHolds holds(placement);
    for (size_t i = 0; i < running.size(); ++i) {
      for (const AdapterTable::Use& use : uses[i]) {
        if (!adapters[i].ok()) break;
        const absl::Status held =
            holds.Hold(*use.component, absl::StrCat("adapter '", use.name, "' used by ",
                                                    batch_size == 1 ? ids[i] : absl::StrCat("batch member ", ids[i])));
        if (!held.ok()) {
          adapters[i] = absl::Status(held.code(), absl::StrCat("adapter '", use.name, "': ", held.message()));
        }
      }
    }
    // The members that may run, and each one's adapters per batch row (the same for every row
    // unless the pipeline mixes adapters: then it installs the rows of each batched forward itself).
    std::vector<size_t> runnable;
    std::vector<BatchMember> run_members;
    LoraRows rows;
    images.assign(running.size(), absl::InternalError("batch member did not run"));
    for (size_t i = 0; i < running.size(); ++i) {
      if (!adapters[i].ok()) {
        images[i] = adapters[i];
        continue;
      }
      runnable.push_back(i);
      run_members.push_back(members[i]);
      rows.push_back(&running[i]->params.loras);
    }
    if (!run_members.empty()) {
      const ScopedLoraRows loras(&rows);
      std::vector<absl::StatusOr<Image>> got;
      const absl::Status thrown = CatchAsStatus(absl::StrCat("running pipeline '", pipeline.name(), "'"),
                                                [&] { got = pipeline.RunBatch(run_members, runner); });
      for (size_t k = 0; k < runnable.size(); ++k) {
        images[runnable[k]] = !thrown.ok() ? absl::StatusOr<Image>(thrown)
                              : k < got.size() ? std::move(got[k])
                                               : absl::StatusOr<Image>(absl::InternalError("batch member without a result"));
      }
    }
    files = pipeline.CheckSourceFiles();  // Changed during the run: discard it.
  }
  if (!files.ok()) images.assign(running.size(), files);
  // What was prefetched for this pipeline and not used by this run may move again.
  placement.EndPipelineRun(pipeline.name());
  // A run that succeeded teaches the order; components earlier runs used and this one did not (an
  // image encoder) stay at the end, so a prefetch waits for them too.
  if (std::all_of(images.begin(), images.end(), [](const absl::StatusOr<Image>& i) { return i.ok(); }) &&
      !next.seen().empty()) {
    std::vector<size_t> merged = next.seen();
    for (size_t i : order.components) {
      if (std::find(merged.begin(), merged.end(), i) == merged.end()) merged.push_back(i);
    }
    order.components = std::move(merged);
  }
  backend.Synchronize();
  if (metrics_ != nullptr && batching) {
    metrics_->RecordBatch(pipeline.name(), batch_size, running.front()->batch_wait);
  }

  // Kernels and workspaces a request used for the first time grew the context: the reply's peak
  // and the budget count it from now on.
  if (context_reserve > 0) {
    EndContextReserve(scope, context_reserve, absl::StrCat("first request after a change pipeline=", LogValue(pipeline.name())));
  } else {
    device_.RefreshContext(scope);
  }
  const DeviceMemoryStats after = backend.GetMemoryStats();
  absl::StatusOr<ProcessMemory> memory = ReadProcessMemory();
  const absl::Duration run_time = absl::Now() - start;
  for (size_t i = 0; i < running.size(); ++i) {
    Request& r = *running[i];
    if (!images[i].ok()) {
      r.result = images[i].status();
      continue;
    }
    ReplyFacts facts;
    facts.pipeline = pipeline.name();
    facts.request_id = ids[i];
    facts.device = device_.device_name();
    facts.batch_size = batch_size;
    facts.queue_wait = r.queue_wait;
    facts.batch_wait = r.batch_wait;
    facts.run_time = run_time;
    facts.before = before;
    facts.after = after;
    facts.peak_floor_allocated = peak_floor_allocated_;
    facts.peak_floor_reserved = peak_floor_reserved_;
    if (memory.ok()) facts.peak_cpu_rss_bytes = std::max(memory->peak_rss_bytes, peak_floor_rss_);
    facts.preempted_time = paused.time;
    facts.preemptions = paused.count;
    facts.preempted_host_to_device_bytes = paused.host_to_device_bytes;
    facts.preempted_device_to_host_bytes = paused.device_to_host_bytes;
    facts.preempted_allocator_retries = paused.allocator_retries;
    facts.preempted_allocator_ooms = paused.allocator_ooms;
    v1::GenerateResponse response =
        BuildReply(*images[i], r.params, facts, contexts[i]->stage_times(), runner.peer_usage());
    r.result = std::move(response);
    r.image = *std::move(images[i]);
  }
}

}  // namespace stowage
