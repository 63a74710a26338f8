// DeviceWorker: the one thread that owns a device's state.
//
// Ownership model (ARCHITECTURE.md, "Who may change device state"): every forward on the device and
// every change to what is on it — placement moves, enabling or disabling group offload, registering
// and unregistering a pipeline's components, strategy changes, OOM recovery — runs on this worker's
// thread, one at a time. Other threads never touch device state: they post work here and wait for
// it, and read the snapshot the owner publishes after each item (`after_each`).
//
// Two kinds of work share one queue:
//   * Jobs (generation requests): bounded by `queue_depth` (and per tenant by
//     `tenant_queue_limit`); Submit fails with RESOURCE_EXHAUSTED when that many jobs wait. Which
//     waiting job runs next is the scheduler's choice (runtime/scheduler.h: priority, tenant
//     fairness, residency within max_reorder_delay) among the jobs before the first waiting task. A job whose caller has gone is dropped when it reaches the front,
//     or when a new job finds the queue full.
//     Jobs may batch: jobs with the same non-empty `batch_key` that are queued together run as one
//     batch (see Job::batch_key).
//   * Tasks (admin changes): RunTask waits until the task ran and returns its status. A task runs
//     between jobs, never during one: kNext puts it before every queued job (after tasks already
//     waiting), kAfterQueuedJobs behind the jobs queued now (an unload lets accepted requests
//     finish). A task whose caller's interrupt fires before it started is withdrawn and never runs,
//     so a refused or timed-out change changes nothing; once started it runs to completion and the
//     caller gets its real result.
//
// A third kind, remote calls (Call), is the lane through which another device's worker gets work
// done on this device while its own job or task waits for it: a split pipeline running a component
// that lives here, a component moving between devices. Calls do not queue behind jobs: the worker
// serves its lane when idle, before each job or task, while a batch waits for members, and — through
// ServeCalls, which the runner of a job calls between component runs — during its own jobs. A
// worker waiting in Call serves its own lane meanwhile. A call's function must not make a call
// itself; then no cycle of workers can wait forever: every waiting worker keeps serving the calls
// made to it, and every call runs without waiting on another device.
//
// The capability: every job, task and call runs with the worker's WorkerScope, which only the
// worker can make (on its own thread) and which cannot be copied. Code that changes device state
// takes a WorkerScope& (DeviceRuntime's device accessors, SplitRunner, ServeCalls), so "worker
// only" is a type the compiler checks: another thread has no scope to pass.
//
// Thread-safety: Submit and RunTask may be called from any thread except the worker's own (a task
// that posted another task and waited would deadlock; RunTask refuses that with INTERNAL). Call may
// be called from any thread; on the worker's own thread it runs the function in place.
#ifndef STOWAGE_RUNTIME_DEVICE_WORKER_H_
#define STOWAGE_RUNTIME_DEVICE_WORKER_H_

#include <any>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "runtime/batch_policy.h"
#include "runtime/scheduler.h"

namespace stowage {

class DeviceWorker;

// Proof that the code holding it runs on a device's worker thread, inside a job, task or call of
// that worker. Made only by DeviceWorker, handed by reference, neither copyable nor movable.
class WorkerScope {
 public:
  WorkerScope(const WorkerScope&) = delete;
  WorkerScope& operator=(const WorkerScope&) = delete;

  // The worker whose thread holds this scope.
  DeviceWorker& worker() const { return worker_; }

 private:
  friend class DeviceWorker;
  explicit WorkerScope(DeviceWorker& worker) : worker_(worker) {}
  DeviceWorker& worker_;
};

class DeviceWorker {
 public:
  struct Job;
  // A job as one member of a batch: the job, how long it waited in the queue, and how long of that
  // the worker held the batch open waiting for more members.
  struct BatchMember {
    Job* job;
    absl::Duration queue_wait;
    absl::Duration batch_wait;
  };

  struct Job {
    // Called on the worker thread with the worker's scope and the time the job waited in the queue.
    std::function<void(WorkerScope& scope, absl::Duration queue_wait)> run;
    // Optional: true once the job's caller has gone (cancelled, deadline passed). A cancelled job
    // gives up its place: it is dropped when it reaches the front, or when a new job finds the
    // queue full.
    std::function<bool()> cancelled;
    // Called instead of `run` for a dropped job (on the worker or the submitting thread).
    std::function<void()> drop;
    // Optional: called on the worker after `run` and after `after_each` published the state the
    // job left, so a caller woken here reads a snapshot that already includes its request.
    std::function<void()> finish;

    // Optional batching. When a job with a non-empty batch_key reaches the front, the worker
    // takes with it the queued jobs of the same key, in queue order, up to max_batch_size in all
    // (tasks and other jobs keep their places). If fewer are there and the key has concurrent
    // demand, it waits for more until max_batch_delay after the batch would have started, or until
    // the batch is full; tasks posted meanwhile run after the batch. A key has concurrent demand
    // once one of its batches ran with several members or ended with a job of the key queued, and
    // loses it when a batch runs alone with none queued: a key seen for the first time (a new
    // image size) and a lone client's requests never wait for company that does not come, while
    // overlapping clients, whose requests queue together, are held together. Then it calls the first job's run_batch once with every
    // member (the first job first) instead of each job's run; then after_each; then each member's
    // finish. Members whose caller went away meanwhile are dropped as usual. A job with a
    // batch_key must set run_batch; `payload` carries what run_batch needs of each member.
    std::string batch_key;
    int max_batch_size = 1;
    absl::Duration max_batch_delay = absl::ZeroDuration();
    std::function<void(WorkerScope& scope, const std::vector<BatchMember>& members)> run_batch;
    std::any payload;

    // What the scheduler weighs (priority, tenant, pipeline, cost); `enqueued` is set by Submit.
    ScheduleEntry schedule;
  };

  enum class TaskOrder { kNext, kAfterQueuedJobs };

  struct Options {
    std::string device;     // For messages: "cuda:0", "sim:0".
    int queue_depth = 16;   // Jobs that may wait (>= 1).
    // Optional: called under the queue's lock, so reports never go stale, with the number of
    // waiting jobs whenever it changes. Must be quick and must not call Submit.
    std::function<void(int)> on_queue_depth;
    // Optional: called on the worker thread after every job, task and call (publishes snapshots).
    std::function<void(WorkerScope& scope)> after_each;
    // How the next job is chosen (runtime/scheduler.h).
    SchedulerOptions scheduler;
    // Jobs one tenant may have waiting (0: only queue_depth bounds them).
    int tenant_queue_limit = 0;
    // Optional (needed for residency reordering): bytes running `pipeline` now would move onto the
    // device. Called under the queue's lock: must be quick and must not call into this worker.
    std::function<int64_t(const std::string& pipeline)> move_bytes;
    // Optional: called on the worker thread, before the job runs, when the scheduler chose a job
    // other than the oldest of its tenant and priority for residency, with its reason.
    std::function<void(WorkerScope& scope, const Job& job, const std::string& reason)> on_reorder;
    // Optional: called on the worker thread, before a job runs between the denoising steps of
    // another (PreemptBetweenSteps), with the scheduler's reason.
    std::function<void(WorkerScope& scope, const Job& job, const std::string& reason)> on_preempt;
    // Optional: called first on the worker thread, before any job, task or call (the device's
    // compute stream is chosen there: DeviceBackend::EnterComputeThread).
    std::function<void()> on_start;
    // Optional: called on the worker thread before each item it takes (a job, a batch, a task or the
    // calls of its lane) except a thread's first, never while stopping. A non-empty reason makes the
    // worker go on on a fresh thread: that thread runs on_start, then on_renewed with the reason,
    // then the loop, with everything queued kept in its order; the old thread ends. For libraries
    // whose caches are per thread and can go stale (LibTorch's cuDNN convolution plans: one chosen
    // while memory was short stays with its thread). A thread always runs an item before it can be
    // replaced, so a reason on every look still makes progress.
    std::function<std::string(WorkerScope& scope)> renew_thread;
    // Optional: called on a fresh thread after on_start with the reason renew_thread gave.
    std::function<void(WorkerScope& scope, const std::string& reason)> on_renewed;
  };

  explicit DeviceWorker(Options options);
  // Runs the jobs and tasks already queued, then stops.
  ~DeviceWorker();

  const std::string& device() const { return options_.device; }
  absl::Status Submit(Job job);
  // Replaces Options::scheduler and Options::tenant_queue_limit (the admin SetScheduler): the next
  // choice among the waiting jobs, and the next Submit's limit, are under the new settings; fair
  // shares start afresh.
  void SetScheduling(SchedulerOptions scheduler, int tenant_queue_limit);

  // Runs `task` on the worker and returns its status. `interrupt` (optional) is polled while the
  // task waits; when it returns non-OK before the task started, the task is withdrawn and that
  // status returned. UNAVAILABLE when the worker is stopping.
  absl::Status RunTask(std::function<absl::Status(WorkerScope& scope)> task,
                       const std::function<absl::Status()>& interrupt,
                       TaskOrder order = TaskOrder::kNext);

  // Runs `fn` on this worker through its remote-call lane and returns its status. `caller` is the
  // scope of the worker whose thread calls (null for other threads): it serves its own lane while
  // it waits, so two workers calling each other both make progress. The wait is woken by events
  // (the call's completion, a call arriving in the caller's lane); only an `interrupt` (optional: a
  // request's caller, whose cancellation gRPC's synchronous API reports to no one) is polled, every
  // 20 ms while the call has not started: when it returns non-OK the call is withdrawn, never runs,
  // and that status is returned; once started it runs to completion. UNAVAILABLE when this worker is
  // stopping (Stop fails the calls still waiting in the lane with it, so a caller never hangs).
  // `fn` must not call Call itself.
  absl::Status Call(std::function<absl::Status(WorkerScope& scope)> fn,
                    const std::function<absl::Status()>& interrupt, WorkerScope* caller);
  // A call from another worker whose device state is mid-change, so that it cannot serve its own
  // lane while it waits (placement's peer eviction: `caller`'s worker, which must be the calling
  // thread, moves a component here). Two such waits could wait on each other forever, so the
  // workers order them: each held wait is an edge caller → callee in one wait graph, and a call that
  // would close a cycle (this worker waits, directly or through others, on `caller` the same way)
  // is refused at once with ABORTED, before anything ran — the caller takes another way (the host).
  // Otherwise the call waits, without a timeout, until this worker runs it: every other wait of a
  // worker serves its lane. On `caller`'s own device the function runs in place.
  absl::Status CallHoldingLane(std::function<absl::Status(WorkerScope& scope)> fn, DeviceWorker& caller);
  // Runs the calls waiting in this worker's lane now; `scope` must be this worker's own. Jobs call
  // it between component runs.
  void ServeCalls(WorkerScope& scope);

  // Stops taking work: new jobs, tasks and calls get UNAVAILABLE, calls waiting in the lane fail
  // with UNAVAILABLE at once; the jobs and tasks already queued still run; returns when the thread
  // has ended. Idempotent; the destructor calls it.
  void Stop();

  // What waits on this worker now — a snapshot, stale as soon as it returns (tests wait for a state
  // with it instead of sleeping; diagnostics). `collecting_batch`: a batch holds the worker open for
  // more members (its jobs taken so far are no longer queued).
  struct Waiting {
    int jobs = 0;
    int tasks = 0;
    int calls = 0;
    bool collecting_batch = false;
  };
  Waiting waiting() const;

  // The pipeline whose job is likely to run after the current one, for prefetching its weights
  // (a hint: the scheduler decides when the time comes): among the waiting jobs before the first
  // waiting task, those whose pipeline is not `running`, the one the scheduler would choose now
  // (asked of a copy of it: nothing changes); "" when there is none. `scope` must be this worker's
  // own (jobs ask between component runs).
  std::string NextWaitingPipeline(const WorkerScope& scope, const std::string& running) const;

  // Preemption (SchedulerOptions::preemption): called by the job running now between two of its
  // denoising steps, with the share of its work it has left (0..1). When the scheduler's next
  // choice among the waiting jobs (before the first waiting task) preempts it (Scheduler::Preempts:
  // the pause so far, and the expected seconds of both — each pipeline's device seconds per unit of
  // work, learned from its recent jobs here, their pauses aside), that job runs now, in place, to
  // its end — a batch with the members of its key queued now, without waiting for more — and true
  // is returned; otherwise nothing changes and false. A preempting job is never preempted itself
  // (false inside it), and tasks never run here. `scope` must be this worker's own. `before`
  // (optional) is called just before the preempting job runs (the paused job tells its callers).
  bool PreemptBetweenSteps(WorkerScope& scope, double remaining_fraction,
                           const std::function<void()>& before = nullptr) ABSL_LOCKS_EXCLUDED(mu_);

  // True on the worker's own thread (for contracts that say "worker only").
  bool OnWorkerThread() const { return std::this_thread::get_id() == worker_id_.load(); }

  // How many times the worker went on on a fresh thread (Options::renew_thread).
  int thread_renewals() const ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct TaskState;
  struct CallState;
  struct Waker;
  struct Item {
    Job job;                            // Set for jobs.
    std::shared_ptr<TaskState> task;    // Set for tasks.
    absl::Time enqueued;
  };
  // The body of every worker thread: marks it the worker's, joins the thread it replaced, runs Loop.
  void ThreadMain() ABSL_LOCKS_EXCLUDED(mu_);
  // Runs items until stopping, or until renew_thread asked for a fresh thread and one took over.
  void Loop();
  // Worker only: starts the fresh thread that takes over, for `reason` (false when stopping:
  // nothing changes).
  bool HandOver(const std::string& reason) ABSL_LOCKS_EXCLUDED(mu_);
  // Adds to `members` (holding the batch's first job) the queued jobs that may join it, waiting for
  // them as Job::batch_key says; cancelled ones go to `dropped`.
  void CollectBatch(WorkerScope& scope, std::vector<Item>& members, std::vector<Item>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the queued jobs of `key` into `members` (in queue order, until it holds `limit`), the
  // cancelled ones into `dropped`.
  void TakeMatching(const std::string& key, size_t limit, std::vector<Item>& members, std::vector<Item>& dropped)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves cancelled jobs out of the queue into `dropped`.
  void TakeCancelled(std::vector<Item>& dropped) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  int QueuedJobs() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Moves the job the scheduler picks at `now` among those before the first waiting task (the
  // front is a job) to the front of the queue; returns the scheduler's reason ("" for none).
  std::string ScheduleFront(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Runs taken jobs: one alone, or a batch (`batching`: run_batch with every member), after
  // logging `reason` with `log` when both are set; charges them, then after_each, then each one's
  // finish. Worker only, without mu_.
  void RunJobs(WorkerScope& scope, std::vector<Item>& jobs, bool batching, absl::Duration batch_wait,
               const std::string& reason,
               const std::function<void(WorkerScope&, const Job&, const std::string&)>& log)
      ABSL_LOCKS_EXCLUDED(mu_);
  // Runs one call's function and returns its status (without mu_).
  static absl::Status RunCall(CallState& call, WorkerScope& scope);
  // Completes `call` with `status` and wakes its waiting caller.
  static void Complete(CallState& call, const absl::Status& status);
  // Worker only, waiting in Call: sleeps until a call it made completes, a call arrives in its
  // lane, or `timeout`; `seen` is waker_'s count read before it last looked.
  void AwaitWake(uint64_t seen, absl::Duration timeout);
  void ReportDepth() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Options options_;
  mutable absl::Mutex mu_;
  std::deque<Item> queue_ ABSL_GUARDED_BY(mu_);
  // How long a batch waits for more members (runtime/batch_policy.h).
  BatchPolicy batch_policy_ ABSL_GUARDED_BY(mu_);
  Scheduler scheduler_ ABSL_GUARDED_BY(mu_);
  int tenant_queue_limit_ ABSL_GUARDED_BY(mu_);  // Options::tenant_queue_limit until SetScheduling.
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  bool collecting_batch_ ABSL_GUARDED_BY(mu_) = false;
  // The remote-call lane, in arrival order.
  std::deque<std::shared_ptr<CallState>> calls_ ABSL_GUARDED_BY(mu_);
  // Worker only: a job's device seconds per unit of work (ScheduleEntry::cost) for `pipeline`
  // (LearnRunTime: the last kLearnedRuns jobs; one that ended within a millisecond is left out),
  // and the expectation for `cost` of it, the median of those (0: unknown).
  static constexpr size_t kLearnedRuns = 8;
  void LearnRunTime(const std::string& pipeline, double seconds, double cost);
  double ExpectedSeconds(const std::string& pipeline, double cost) const;

  // Worker thread only (no lock): the job running now (a batch's first member; null between
  // jobs) and what the scheduler weighs of it (a batch's work in all, its highest priority and
  // earliest deadline), how long it has been paused for preempting jobs, whether it preempted
  // another, and each pipeline's recent seconds per unit of work.
  const Job* running_job_ = nullptr;
  ScheduleEntry running_entry_;
  absl::Duration job_paused_;
  bool preempting_ = false;
  std::map<std::string, std::deque<double>> run_rates_;
  // Wakes this worker while it waits in Call (see Waker).
  const std::shared_ptr<Waker> waker_;
  // The worker's thread now (each thread stores its own id first thing; the old one does nothing
  // after handing over), the handle of its thread, the one it replaced until the new one joins it,
  // and why the current one replaced it ("" for the first).
  std::atomic<std::thread::id> worker_id_{std::thread::id()};
  std::thread thread_ ABSL_GUARDED_BY(mu_);
  std::thread retired_ ABSL_GUARDED_BY(mu_);
  std::string renewal_reason_ ABSL_GUARDED_BY(mu_);
  int renewals_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_DEVICE_WORKER_H_
