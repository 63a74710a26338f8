#include "runtime/device_worker.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <iostream>
#include <map>

#include "absl/strings/str_cat.h"

namespace stowage {

// One posted task and its completion. Lock order: DeviceWorker::mu_ before TaskState::mu.
struct DeviceWorker::TaskState {
  enum class Phase { kQueued, kRunning, kDone, kWithdrawn };
  std::function<absl::Status(WorkerScope&)> fn;
  absl::Mutex mu;
  Phase phase ABSL_GUARDED_BY(mu) = Phase::kQueued;
  absl::Status status ABSL_GUARDED_BY(mu);
};

// Wakes a worker that waits in Call: bumped when a call it made completes or a call arrives in its
// lane. Shared with the calls it made, so completing one never touches a worker that has moved on.
struct DeviceWorker::Waker {
  absl::Mutex mu;
  uint64_t seq ABSL_GUARDED_BY(mu) = 0;
  void Bump() {
    absl::MutexLock lock(&mu);
    ++seq;
  }
  uint64_t Seq() {
    absl::MutexLock lock(&mu);
    return seq;
  }
};

// One remote call and its completion. Lock order: DeviceWorker::mu_ (the callee's) before
// CallState::mu; Waker::mu is never held with either.
struct DeviceWorker::CallState {
  enum class Phase { kQueued, kRunning, kDone, kWithdrawn };
  std::function<absl::Status(WorkerScope&)> fn;
  std::shared_ptr<Waker> caller;  // Woken on completion; null for callers that are not workers.
  absl::Mutex mu;
  Phase phase ABSL_GUARDED_BY(mu) = Phase::kQueued;
  absl::Status status ABSL_GUARDED_BY(mu);
};

DeviceWorker::DeviceWorker(Options options)
    : options_(std::move(options)),
      scheduler_(options_.scheduler),
      tenant_queue_limit_(options_.tenant_queue_limit),
      waker_(std::make_shared<Waker>()) {
  absl::MutexLock lock(&mu_);
  thread_ = std::thread([this] { ThreadMain(); });
}

void DeviceWorker::ThreadMain() {
  worker_id_.store(std::this_thread::get_id());
  std::thread replaced;
  {
    absl::MutexLock lock(&mu_);
    replaced = std::move(retired_);
  }
  // The replaced thread only returns from its loop: a short wait.
  if (replaced.joinable()) replaced.join();
  Loop();
}

bool DeviceWorker::HandOver(const std::string& reason) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return false;
  renewal_reason_ = reason;
  // Started before the handles move (a failed start throws with nothing changed); it waits for mu_
  // before it runs anything of the loop.
  std::thread fresh([this] { ThreadMain(); });
  retired_ = std::move(thread_);
  thread_ = std::move(fresh);
  ++renewals_;
  return true;
}

int DeviceWorker::thread_renewals() const {
  absl::MutexLock lock(&mu_);
  return renewals_;
}

DeviceWorker::~DeviceWorker() { Stop(); }

void DeviceWorker::Stop() {
  std::deque<std::shared_ptr<CallState>> failed;
  std::thread joined[2];
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    failed.swap(calls_);
    // No hand-over from here on: the thread now is the last one.
    if (!OnWorkerThread()) {
      joined[0] = std::move(thread_);
      joined[1] = std::move(retired_);
    }
  }
  for (const std::shared_ptr<CallState>& call : failed) {
    Complete(*call, absl::UnavailableError(absl::StrCat("device ", options_.device,
                                                        " is stopping (server shutting down); its remote call did not run")));
  }
  for (std::thread& thread : joined) {
    if (thread.joinable()) thread.join();
  }
}

void DeviceWorker::Complete(CallState& call, const absl::Status& status) {
  std::shared_ptr<Waker> caller;
  {
    absl::MutexLock lock(&call.mu);
    call.status = status;
    call.phase = CallState::Phase::kDone;
    caller = call.caller;
  }
  if (caller != nullptr) caller->Bump();
}

void DeviceWorker::AwaitWake(uint64_t seen, absl::Duration timeout) {
  struct Wait {
    Waker* waker;
    uint64_t seen;
  } wait{waker_.get(), seen};
  absl::MutexLock lock(&waker_->mu);
  waker_->mu.AwaitWithTimeout(
      absl::Condition(+[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->waker->seq != w->seen; }, &wait),
      timeout);
}

namespace {

// The held waits of every worker (CallHoldingLane): caller → callee, at most one per caller (a
// worker waits in one call at a time), with the callee's device name for messages (the walk never
// dereferences a worker: a callee may be gone before its caller erased the edge). Process-wide:
// workers are the keys, so devices of several servers in one process never meet.
struct HeldWaits {
  absl::Mutex mu;
  std::map<const DeviceWorker*, std::pair<const DeviceWorker*, std::string>> edges ABSL_GUARDED_BY(mu);
};

HeldWaits& Held() {
  static HeldWaits* held = new HeldWaits();
  return *held;
}

}  // namespace

absl::Status DeviceWorker::CallHoldingLane(std::function<absl::Status(WorkerScope&)> fn, DeviceWorker& caller) {
  if (!caller.OnWorkerThread()) {
    std::cerr << "DeviceWorker::CallHoldingLane: called off the worker thread of " << caller.device() << std::endl;
    std::abort();
  }
  if (&caller == this) {
    WorkerScope scope(*this);
    return fn(scope);
  }
  HeldWaits& held = Held();
  {
    absl::MutexLock lock(&held.mu);
    std::string chain = options_.device;
    for (const DeviceWorker* w = this;;) {
      auto next = held.edges.find(w);
      if (next == held.edges.end()) break;
      w = next->second.first;
      absl::StrAppend(&chain, " -> ", next->second.second);
      if (w == &caller) {
        return absl::AbortedError(absl::StrCat("device ", caller.device(), " cannot wait on ", options_.device,
                                               ", which waits on it (", chain,
                                               ") with its own state mid-change; the caller takes another way"));
      }
    }
    held.edges[&caller] = {this, options_.device};
  }
  // The edge goes when the wait ends, however it ends.
  struct Erase {
    HeldWaits& held;
    const DeviceWorker* caller;
    ~Erase() {
      absl::MutexLock lock(&held.mu);
      held.edges.erase(caller);
    }
  } erase{held, &caller};
  return Call(std::move(fn), nullptr, nullptr);
}

absl::Status DeviceWorker::RunCall(CallState& call, WorkerScope& scope) {
  absl::Status status;
  try {
    status = call.fn(scope);
  } catch (const std::exception& e) {
    status = absl::InternalError(absl::StrCat("remote call threw: ", e.what()));
  }
  call.fn = nullptr;  // What it captured goes before the caller is released.
  return status;
}

void DeviceWorker::ServeCalls(WorkerScope& scope) {
  if (&scope.worker() != this) {
    // A scope is made only on its own worker's thread: another worker's scope here is a bug.
    std::cerr << "DeviceWorker::ServeCalls: the scope of device " << scope.worker().device() << " on device "
              << options_.device << std::endl;
    std::abort();
  }
  for (;;) {
    std::shared_ptr<CallState> call;
    {
      absl::MutexLock lock(&mu_);
      if (calls_.empty()) break;
      call = std::move(calls_.front());
      calls_.pop_front();
      absl::MutexLock call_lock(&call->mu);
      call->phase = CallState::Phase::kRunning;
    }
    const absl::Status status = RunCall(*call, scope);
    // Published before the caller wakes, as after a job: it reads a snapshot with the call's effect.
    if (options_.after_each) options_.after_each(scope);
    Complete(*call, status);
  }
}

absl::Status DeviceWorker::Call(std::function<absl::Status(WorkerScope&)> fn,
                                const std::function<absl::Status()>& interrupt, WorkerScope* caller_scope) {
  if (OnWorkerThread()) {
    // A call to one's own device runs in place, in the scope the worker holds now.
    WorkerScope scope(*this);
    return fn(scope);
  }
  DeviceWorker* caller = caller_scope != nullptr ? &caller_scope->worker() : nullptr;
  auto state = std::make_shared<CallState>();
  state->fn = std::move(fn);
  if (caller != nullptr) state->caller = caller->waker_;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) {
      return absl::UnavailableError(
          absl::StrCat("device ", options_.device, " is stopping (server shutting down); its remote call did not run"));
    }
    calls_.push_back(state);
  }
  waker_->Bump();  // In case this worker itself waits in a call of its own.
  // Everything but the interrupt wakes the wait (see the header).
  const absl::Duration poll = interrupt ? absl::Milliseconds(20) : absl::InfiniteDuration();
  for (;;) {
    const uint64_t seen = caller != nullptr ? caller->waker_->Seq() : 0;
    {
      absl::MutexLock lock(&state->mu);
      if (caller == nullptr) {
        state->mu.AwaitWithTimeout(
            absl::Condition(
                +[](CallState* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->phase == CallState::Phase::kDone; },
                state.get()),
            poll);
      }
      if (state->phase == CallState::Phase::kDone) return state->status;
    }
    if (caller != nullptr) {
      // Serve what others ask of the caller's device while it waits: they may be waiting on it.
      caller->ServeCalls(*caller_scope);
      caller->AwaitWake(seen, poll);
    }
    {
      absl::MutexLock lock(&state->mu);
      if (state->phase != CallState::Phase::kQueued) continue;  // Running or done: wait for its result.
    }
    const absl::Status interrupted = interrupt ? interrupt() : absl::OkStatus();
    if (interrupted.ok()) continue;
    absl::MutexLock lock(&mu_);
    absl::MutexLock call_lock(&state->mu);
    if (state->phase != CallState::Phase::kQueued) continue;  // Taken (or failed) meanwhile.
    state->phase = CallState::Phase::kWithdrawn;
    calls_.erase(std::find(calls_.begin(), calls_.end(), state));
    return interrupted;
  }
}

int DeviceWorker::QueuedJobs() const {
  return static_cast<int>(std::count_if(queue_.begin(), queue_.end(),
                                        [](const Item& item) { return item.task == nullptr; }));
}

DeviceWorker::Waiting DeviceWorker::waiting() const {
  absl::MutexLock lock(&mu_);
  Waiting w;
  w.jobs = QueuedJobs();
  w.tasks = static_cast<int>(queue_.size()) - w.jobs;
  w.calls = static_cast<int>(calls_.size());
  w.collecting_batch = collecting_batch_;
  return w;
}

void DeviceWorker::ReportDepth() {
  if (options_.on_queue_depth) options_.on_queue_depth(QueuedJobs());
}

void DeviceWorker::TakeCancelled(std::vector<Item>& dropped) {
  for (auto it = queue_.begin(); it != queue_.end();) {
    if (it->task == nullptr && it->job.cancelled && it->job.cancelled()) {
      dropped.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      ++it;
    }
  }
}

void DeviceWorker::SetScheduling(SchedulerOptions scheduler, int tenant_queue_limit) {
  absl::MutexLock lock(&mu_);
  scheduler_ = Scheduler(std::move(scheduler));
  tenant_queue_limit_ = tenant_queue_limit;
}

absl::Status DeviceWorker::Submit(Job job) {
  std::vector<Item> dropped;
  absl::Status status;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("server is shutting down");
    if (QueuedJobs() >= options_.queue_depth) TakeCancelled(dropped);
    int tenant_waiting = 0;
    if (tenant_queue_limit_ > 0) {
      for (const Item& i : queue_) tenant_waiting += i.task == nullptr && i.job.schedule.tenant == job.schedule.tenant;
    }
    if (QueuedJobs() >= options_.queue_depth) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "the request queue of ", options_.device, " is full (", options_.queue_depth,
          " waiting); retry later or raise queue_depth in the server config"));
    } else if (tenant_queue_limit_ > 0 && tenant_waiting >= tenant_queue_limit_) {
      status = absl::ResourceExhaustedError(absl::StrCat(
          "tenant '", job.schedule.tenant.empty() ? std::string("(default)") : job.schedule.tenant, "' has ",
          tenant_waiting, " requests waiting on ", options_.device,
          ", its limit (scheduler.tenant_queue_limit); retry later"));
    } else {
      const absl::Time now = absl::Now();
      job.schedule.enqueued = now;
      queue_.push_back(Item{std::move(job), nullptr, now});
    }
    ReportDepth();
  }
  for (Item& item : dropped) {
    if (item.job.drop) item.job.drop();
  }
  return status;
}

absl::Status DeviceWorker::RunTask(std::function<absl::Status(WorkerScope&)> task,
                                   const std::function<absl::Status()>& interrupt, TaskOrder order) {
  if (OnWorkerThread()) {
    return absl::InternalError("a device task may not wait for another task on the same worker");
  }
  auto state = std::make_shared<TaskState>();
  state->fn = std::move(task);
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return absl::UnavailableError("server is shutting down");
    Item item{Job{}, state, absl::Now()};
    if (order == TaskOrder::kAfterQueuedJobs) {
      queue_.push_back(std::move(item));
    } else {
      // Behind the tasks already waiting at the front, before every job.
      auto it = std::find_if(queue_.begin(), queue_.end(), [](const Item& i) { return i.task == nullptr; });
      queue_.insert(it, std::move(item));
    }
  }
  const absl::Duration poll = interrupt ? absl::Milliseconds(20) : absl::InfiniteDuration();
  for (;;) {
    {
      absl::MutexLock lock(&state->mu);
      // Poll the interrupt while waiting: the caller's deadline or cancellation. (Await evaluates
      // the condition with the lock held.)
      state->mu.AwaitWithTimeout(
          absl::Condition(
              +[](TaskState* s) ABSL_NO_THREAD_SAFETY_ANALYSIS { return s->phase == TaskState::Phase::kDone; },
              state.get()),
          poll);
      if (state->phase == TaskState::Phase::kDone) return state->status;
      if (state->phase == TaskState::Phase::kRunning) continue;  // Started: wait for its result.
    }
    const absl::Status interrupted = interrupt ? interrupt() : absl::OkStatus();
    if (interrupted.ok()) continue;
    absl::MutexLock lock(&mu_);
    absl::MutexLock task_lock(&state->mu);
    if (state->phase != TaskState::Phase::kQueued) continue;  // The worker took it meanwhile.
    state->phase = TaskState::Phase::kWithdrawn;
    queue_.erase(std::find_if(queue_.begin(), queue_.end(), [&](const Item& i) { return i.task == state; }));
    return interrupted;
  }
}

void DeviceWorker::TakeMatching(const std::string& key, size_t limit, std::vector<Item>& members,
                                std::vector<Item>& dropped) {
  for (auto it = queue_.begin(); it != queue_.end() && members.size() < limit;) {
    if (it->task != nullptr || it->job.batch_key != key) {
      ++it;
    } else if (it->job.cancelled && it->job.cancelled()) {
      dropped.push_back(std::move(*it));
      it = queue_.erase(it);
    } else {
      members.push_back(std::move(*it));
      it = queue_.erase(it);
    }
  }
}

void DeviceWorker::CollectBatch(WorkerScope& scope, std::vector<Item>& members, std::vector<Item>& dropped) {
  // Copies: `members` grows below.
  const std::string key = members.front().job.batch_key;
  const size_t limit = static_cast<size_t>(std::max(1, members.front().job.max_batch_size));
  // Measured from now, when the batch would start: a first request that waited in the queue behind
  // a running batch still gets the chance to gather the requests that arrive right after it (clients
  // whose replies just went out), which brings clients that drifted apart back into step.
  const absl::Time deadline = batch_policy_.HoldUntil(key, absl::Now(), members.front().job.max_batch_delay);
  // As many as last time (and those that queued behind it) are here: no need to wait out the delay.
  const size_t gathered = batch_policy_.Gathered(key);
  struct Wait {
    DeviceWorker* worker;
    const std::string* key;
  } wait{this, &key};
  collecting_batch_ = true;
  for (;;) {
    TakeMatching(key, limit, members, dropped);
    if (members.size() >= limit || stopping_ || absl::Now() >= deadline) break;
    if (gathered > 1 && members.size() >= gathered) break;
    // Sleep until a job of this key arrives, the worker stops, or the delay is over; wake every
    // 20 ms to see whether the first member's caller has gone.
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](Wait* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
                                if (w->worker->stopping_ || !w->worker->calls_.empty()) return true;
                                return std::any_of(w->worker->queue_.begin(), w->worker->queue_.end(),
                                                   [&](const Item& i) {
                                                     return i.task == nullptr && i.job.batch_key == *w->key;
                                                   });
                              },
                              &wait),
                          std::min(deadline, absl::Now() + absl::Milliseconds(20)));
    if (!calls_.empty()) {
      // Other devices' calls do not wait for this batch to fill.
      mu_.Unlock();
      ServeCalls(scope);
      mu_.Lock();
    }
    // The first member's caller may have gone while the batch waited: it gives up its place.
    if (members.front().job.cancelled && members.front().job.cancelled()) {
      dropped.push_back(std::move(members.front()));
      members.erase(members.begin());
      break;  // The rest run now, without waiting longer for a batch their head left.
    }
  }
  collecting_batch_ = false;
  ReportDepth();
}

std::string DeviceWorker::NextWaitingPipeline(const WorkerScope& scope, const std::string& running) const {
  (void)scope;  // Proof of the caller's thread; the queue is read under its lock.
  absl::MutexLock lock(&mu_);
  std::vector<const ScheduleEntry*> entries;
  for (const Item& item : queue_) {
    if (item.task != nullptr) break;
    const ScheduleEntry& s = item.job.schedule;
    if (s.pipeline.empty() || s.pipeline == running) continue;
    if (item.job.cancelled && item.job.cancelled()) continue;
    entries.push_back(&s);
  }
  if (entries.empty()) return "";
  // The scheduler's own choice among them (priority, tenant fairness, residency), asked of a copy:
  // asking changes nothing.
  Scheduler preview = scheduler_;
  return entries[preview.Pick(entries, options_.move_bytes, absl::Now()).index]->pipeline;
}

std::string DeviceWorker::ScheduleFront(absl::Time now) {
  // The jobs before the first waiting task: a task queued behind jobs (kAfterQueuedJobs) keeps
  // every job queued before it ahead of it, and jobs queued after it behind it.
  std::vector<const ScheduleEntry*> entries;
  std::vector<std::deque<Item>::iterator> positions;
  for (auto it = queue_.begin(); it != queue_.end() && it->task == nullptr; ++it) {
    entries.push_back(&it->job.schedule);
    positions.push_back(it);
  }
  if (entries.size() <= 1) {
    if (!entries.empty()) (void)scheduler_.Pick(entries, nullptr, now);  // Tracks who waits.
    return "";
  }
  const ScheduleChoice choice = scheduler_.Pick(entries, options_.move_bytes, now);
  if (choice.index != 0) {
    Item chosen = std::move(*positions[choice.index]);
    queue_.erase(positions[choice.index]);
    queue_.push_front(std::move(chosen));
  }
  return choice.reason;
}

void DeviceWorker::RunJobs(WorkerScope& scope, std::vector<Item>& jobs, bool batching, absl::Duration batch_wait,
                           const std::string& reason,
                           const std::function<void(WorkerScope&, const Job&, const std::string&)>& log) {
  if (!reason.empty() && log) log(scope, jobs.front().job, reason);
  {
    absl::MutexLock lock(&mu_);
    for (const Item& item : jobs) scheduler_.Charge(item.job.schedule);
  }
  const Job* outer = running_job_;
  const ScheduleEntry outer_entry = running_entry_;
  const absl::Duration outer_paused = job_paused_;
  running_job_ = &jobs.front().job;
  // A batch as one request: its work in all, its highest priority, its earliest deadline.
  running_entry_ = jobs.front().job.schedule;
  running_entry_.cost = 0;
  for (const Item& item : jobs) {
    running_entry_.cost += item.job.schedule.cost;
    running_entry_.priority = std::max(running_entry_.priority, item.job.schedule.priority);
    running_entry_.deadline = std::min(running_entry_.deadline, item.job.schedule.deadline);
  }
  const double cost = running_entry_.cost;
  job_paused_ = absl::ZeroDuration();
  const absl::Time began = absl::Now();
  if (batching) {
    const absl::Time start = absl::Now();
    std::vector<BatchMember> members;
    for (Item& item : jobs) members.push_back(BatchMember{&item.job, start - item.enqueued, batch_wait});
    members.front().job->run_batch(scope, members);
    absl::MutexLock lock(&mu_);
    const std::string& key = jobs.front().job.batch_key;
    const size_t queued = static_cast<size_t>(std::count_if(queue_.begin(), queue_.end(), [&](const Item& i) {
      return i.task == nullptr && i.job.batch_key == key;
    }));
    batch_policy_.Ran(key, jobs.size(), queued);
  } else {
    jobs.front().job.run(scope, absl::Now() - jobs.front().enqueued);
  }
  // The device's time for this much work of this pipeline (the pauses for preempting jobs aside).
  LearnRunTime(jobs.front().job.schedule.pipeline, absl::ToDoubleSeconds(absl::Now() - began - job_paused_), cost);
  running_job_ = outer;
  running_entry_ = outer_entry;
  job_paused_ = outer_paused;
  if (options_.after_each) options_.after_each(scope);
  for (Item& item : jobs) {
    if (item.job.finish) item.job.finish();
  }
}

void DeviceWorker::LearnRunTime(const std::string& pipeline, double seconds, double cost) {
  // A job that ended at once (its caller went, its pipeline was unloaded while it waited) says
  // nothing about the pipeline's runs.
  if (pipeline.empty() || !(seconds >= 1e-3) || !(cost > 0)) return;
  if (run_rates_.size() >= 256 && run_rates_.count(pipeline) == 0) run_rates_.clear();
  std::deque<double>& rates = run_rates_[pipeline];
  rates.push_back(seconds / cost);
  if (rates.size() > kLearnedRuns) rates.pop_front();
}

double DeviceWorker::ExpectedSeconds(const std::string& pipeline, double cost) const {
  const auto it = run_rates_.find(pipeline);
  if (it == run_rates_.end() || it->second.empty()) return 0;
  // The median of the recent runs: one outlier (a first run that loaded kernels, a cancelled
  // one) moves it little, and it follows a lasting change within a few runs.
  std::vector<double> sorted(it->second.begin(), it->second.end());
  std::sort(sorted.begin(), sorted.end());
  const size_t n = sorted.size();
  const double median = n % 2 == 1 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
  return median * cost;
}

bool DeviceWorker::PreemptBetweenSteps(WorkerScope& scope, double remaining_fraction,
                                       const std::function<void()>& before) {
  if (&scope.worker() != this) {
    std::cerr << "DeviceWorker::PreemptBetweenSteps: the scope of device " << scope.worker().device() << " on device "
              << options_.device << std::endl;
    std::abort();
  }
  // Only between the steps of a job of this worker's own, and one level deep: a preempting job
  // runs to its end.
  if (running_job_ == nullptr || preempting_) return false;
  bool residency = false;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || scheduler_.options().preemption == Preemption::kNone) return false;
    if (queue_.empty() || queue_.front().task != nullptr) return false;
    // Bytes to move decide the choice only with residency reordering or residency preemption.
    residency = scheduler_.options().max_reorder_delay > absl::ZeroDuration() ||
                scheduler_.options().preemption == Preemption::kResident;
  }
  // Residency as it is now, not as the last job left it (this one may have moved weights): the
  // snapshot move_bytes reads is published first — only when bytes matter (not at every step).
  if (residency && options_.after_each) options_.after_each(scope);
  std::vector<Item> jobs;
  std::vector<Item> dropped;
  bool batching = false;
  bool preempt = false;
  std::string reason;
  std::string reorder_reason;
  {
    absl::MutexLock lock(&mu_);
    // Jobs whose callers went give up their places now (dropped below, whatever is decided): the
    // scheduler chooses among the others, as it will at the front.
    TakeCancelled(dropped);
    do {
      if (stopping_) break;
      std::vector<const ScheduleEntry*> entries;
      for (auto it = queue_.begin(); it != queue_.end() && it->task == nullptr; ++it) {
        entries.push_back(&it->job.schedule);
      }
      if (entries.empty()) break;
      const absl::Time now = absl::Now();
      // The scheduler's own choice among the waiting jobs, asked of a copy: not preempting changes nothing.
      Scheduler preview = scheduler_;
      const size_t chosen = preview.Pick(entries, options_.move_bytes, now).index;
      const Item& item = queue_[chosen];
      // The candidate as it would run: with the members of its batch key queued now (up to its
      // batch size), their work in all.
      ScheduleEntry candidate = item.job.schedule;
      if (!item.job.batch_key.empty()) {
        const size_t limit = static_cast<size_t>(std::max(1, item.job.max_batch_size));
        size_t members = 1;
        for (const Item& other : queue_) {
          if (members >= limit) break;
          if (&other == &item || other.task != nullptr || other.job.batch_key != item.job.batch_key) continue;
          candidate.cost += other.job.schedule.cost;
          ++members;
        }
      }
      // Unknown residency (no move_bytes) is never "nothing to move".
      const int64_t move = options_.move_bytes ? options_.move_bytes(candidate.pipeline) : INT64_MAX;
      Scheduler::PreemptionCase c;
      c.running = &running_entry_;
      c.remaining_cost = running_entry_.cost * std::clamp(remaining_fraction, 0.0, 1.0);
      c.paused = job_paused_;
      c.candidate = &candidate;
      c.candidate_move_bytes = move;
      c.remaining_seconds = ExpectedSeconds(running_entry_.pipeline, c.remaining_cost);
      c.candidate_seconds = ExpectedSeconds(candidate.pipeline, candidate.cost);
      c.now = now;
      if (!scheduler_.Preempts(c, &reason)) break;
      // The same choice for real (same state, same time): it moves to the front and is charged.
      reorder_reason = ScheduleFront(now);
      Item next = std::move(queue_.front());
      queue_.pop_front();
      batching = !next.job.batch_key.empty();
      const std::string key = next.job.batch_key;
      const size_t limit = static_cast<size_t>(std::max(1, next.job.max_batch_size));
      jobs.push_back(std::move(next));
      // A batch takes the members queued now; it does not wait for more (the paused request waits).
      if (batching) TakeMatching(key, limit, jobs, dropped);
      preempt = true;
    } while (false);
    ReportDepth();
  }
  for (Item& item : dropped) {
    if (item.job.drop) item.job.drop();
  }
  if (!preempt) return false;
  if (!reorder_reason.empty()) absl::StrAppend(&reason, "; ", reorder_reason);
  if (before) before();
  preempting_ = true;
  const absl::Time began = absl::Now();
  RunJobs(scope, jobs, batching, absl::ZeroDuration(), reason, options_.on_preempt);
  job_paused_ += absl::Now() - began;
  preempting_ = false;
  return true;
}

void DeviceWorker::Loop() {
  if (options_.on_start) options_.on_start();
  // The one scope of this worker: everything it runs gets it.
  WorkerScope scope(*this);
  std::string renewed_for;
  {
    absl::MutexLock lock(&mu_);
    renewed_for = std::move(renewal_reason_);
    renewal_reason_.clear();
  }
  if (!renewed_for.empty() && options_.on_renewed) options_.on_renewed(scope, renewed_for);
  bool ran_item = false;  // On this thread: its first item runs before any hand-over.
  for (;;) {
    Item next;
    bool batching = false;
    std::vector<Item> batch;
    std::vector<Item> dropped;
    absl::Duration batch_wait;
    bool calls_waiting = false;
    bool stopping = false;
    std::string reorder_reason;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](DeviceWorker* w) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return w->stopping_ || !w->queue_.empty() || !w->calls_.empty();
          },
          this));
      calls_waiting = !calls_.empty();
      stopping = stopping_;
    }
    // Before the next item, whatever happened since the last one (the item stays queued for the
    // thread that takes over).
    if (options_.renew_thread && ran_item && !stopping) {
      const std::string reason = options_.renew_thread(scope);
      if (!reason.empty() && HandOver(reason)) return;
    }
    ran_item = true;
    if (calls_waiting) {
      // The lane first: its callers hold a job or task of their own device open meanwhile.
      ServeCalls(scope);
      continue;
    }
    {
      absl::MutexLock lock(&mu_);
      if (queue_.empty()) {
        if (stopping_) return;
        continue;
      }
      if (queue_.front().task == nullptr) reorder_reason = ScheduleFront(absl::Now());
      next = std::move(queue_.front());
      queue_.pop_front();
      if (next.task != nullptr) {
        absl::MutexLock task_lock(&next.task->mu);
        next.task->phase = TaskState::Phase::kRunning;
      } else {
        ReportDepth();
        batching = !next.job.batch_key.empty() && !(next.job.cancelled && next.job.cancelled());
        if (batching) {
          const absl::Time taken = absl::Now();
          batch.push_back(std::move(next));
          CollectBatch(scope, batch, dropped);
          batch_wait = absl::Now() - taken;
        }
      }
    }
    for (Item& item : dropped) {
      if (item.job.drop) item.job.drop();
    }
    if (batching) {
      if (batch.empty()) continue;  // Its only member left while it waited.
      RunJobs(scope, batch, /*batching=*/true, batch_wait, reorder_reason, /*on_reorder=*/options_.on_reorder);
    } else if (next.task != nullptr) {
      const absl::Status status = next.task->fn(scope);
      if (options_.after_each) options_.after_each(scope);
      absl::MutexLock task_lock(&next.task->mu);
      next.task->status = status;
      next.task->phase = TaskState::Phase::kDone;
    } else if (next.job.cancelled && next.job.cancelled()) {
      if (next.job.drop) next.job.drop();
    } else {
      std::vector<Item> one;
      one.push_back(std::move(next));
      RunJobs(scope, one, /*batching=*/false, absl::ZeroDuration(), reorder_reason, options_.on_reorder);
    }
  }
}

}  // namespace stowage
