#include "runtime/device_worker.h"

#include <algorithm>
#include <any>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"

namespace stowage {
namespace {

DeviceWorker::Options Options(std::string device, int queue_depth, std::function<void(int)> on_depth = nullptr) {
  DeviceWorker::Options options;
  options.device = std::move(device);
  options.queue_depth = queue_depth;
  options.on_queue_depth = std::move(on_depth);
  return options;
}

// Waits until the worker's waiting state satisfies `ready` (polled every millisecond, at most 30 s):
// tests wait for a state instead of sleeping for it.
void WaitUntil(const DeviceWorker& worker, const std::function<bool(const DeviceWorker::Waiting&)>& ready) {
  const absl::Time give_up = absl::Now() + absl::Seconds(30);
  while (!ready(worker.waiting())) {
    ASSERT_LT(absl::Now(), give_up) << "the worker never reached the awaited state";
    absl::SleepFor(absl::Milliseconds(1));
  }
}

TEST(DeviceWorkerTest, RunsJobsInOrderOneAtATimeAndRejectsWhenFull) {
  std::vector<int> depths;
  absl::Mutex depth_mu;
  DeviceWorker worker(Options("sim:0", /*queue_depth=*/2, [&](int d) {
    absl::MutexLock lock(&depth_mu);
    depths.push_back(d);
  }));
  absl::Notification started, release;
  std::vector<int> order;
  absl::Mutex order_mu;
  std::atomic<int> running{0};
  std::atomic<int> max_running{0};
  auto job = [&](int id) {
    DeviceWorker::Job j;
    j.run = [&, id](WorkerScope&, absl::Duration) {
      const int now = ++running;
      max_running = std::max(max_running.load(), now);
      if (id == 0) {
        started.Notify();
        release.WaitForNotification();
      }
      {
        absl::MutexLock lock(&order_mu);
        order.push_back(id);
      }
      --running;
    };
    return j;
  };
  ASSERT_TRUE(worker.Submit(job(0)).ok());
  started.WaitForNotification();  // Job 0 runs; the queue is empty again.
  ASSERT_TRUE(worker.Submit(job(1)).ok());
  ASSERT_TRUE(worker.Submit(job(2)).ok());
  const absl::Status full = worker.Submit(job(3));
  EXPECT_EQ(full.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(std::string(full.message()).find("queue of sim:0 is full"), std::string::npos) << full;
  release.Notify();
  absl::Notification last;
  // Job 0 has left the queue, so this fits once 1 and 2 drain.
  DeviceWorker::Job final_job;
  final_job.run = [&](WorkerScope&, absl::Duration) { last.Notify(); };
  while (!worker.Submit(final_job).ok()) absl::SleepFor(absl::Milliseconds(1));
  last.WaitForNotification();
  absl::MutexLock lock(&order_mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(max_running.load(), 1);
}

// on_start runs once, on the worker's own thread, before the first job (the device's compute stream
// is chosen there).
TEST(DeviceWorkerTest, OnStartRunsOnTheWorkerThreadBeforeAnyJob) {
  std::atomic<int> starts{0};
  std::thread::id start_thread;
  bool started_before_job = false;
  DeviceWorker::Options options = Options("sim:0", /*queue_depth=*/4, nullptr);
  options.on_start = [&] {
    start_thread = std::this_thread::get_id();
    ++starts;
  };
  DeviceWorker worker(std::move(options));
  absl::Notification done;
  std::thread::id job_thread;
  for (int i = 0; i < 2; ++i) {
    DeviceWorker::Job j;
    j.run = [&, i](WorkerScope&, absl::Duration) {
      if (i == 0) {
        started_before_job = starts.load() == 1;
        job_thread = std::this_thread::get_id();
      }
      if (i == 1) done.Notify();
    };
    ASSERT_TRUE(worker.Submit(std::move(j)).ok());
  }
  done.WaitForNotification();
  EXPECT_EQ(starts.load(), 1);
  EXPECT_TRUE(started_before_job);
  EXPECT_EQ(start_thread, job_thread);
  EXPECT_NE(start_thread, std::this_thread::get_id());
}

// renew_thread: a reason between items hands the loop to a fresh thread — on_start runs there
// again, the queued work keeps its order, the new thread is the worker's (OnWorkerThread, tasks and
// calls run on it) and the old one is gone.
TEST(DeviceWorkerTest, RenewThreadHandsTheLoopToAFreshThread) {
  std::atomic<int> starts{0};
  std::atomic<bool> renew{false};
  DeviceWorker::Options options = Options("sim:0", /*queue_depth=*/8, nullptr);
  options.on_start = [&] { ++starts; };
  options.renew_thread = [&](WorkerScope&) -> std::string { return renew.exchange(false) ? "stale caches" : ""; };
  DeviceWorker worker(std::move(options));
  absl::Mutex mu;
  std::vector<std::thread::id> threads;
  std::vector<int> order;
  absl::Notification hold, done;
  for (int i = 0; i < 3; ++i) {
    DeviceWorker::Job j;
    j.run = [&, i](WorkerScope& scope, absl::Duration) {
      if (i == 0) {
        hold.WaitForNotification();
        renew = true;  // Asked while the first job runs: the second runs on the fresh thread.
      }
      EXPECT_TRUE(scope.worker().OnWorkerThread());
      absl::MutexLock lock(&mu);
      threads.push_back(std::this_thread::get_id());
      order.push_back(i);
      if (i == 2) done.Notify();
    };
    ASSERT_TRUE(worker.Submit(std::move(j)).ok());
  }
  hold.Notify();
  done.WaitForNotification();
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
    ASSERT_EQ(threads.size(), 3u);
    EXPECT_NE(threads[0], threads[1]);
    EXPECT_EQ(threads[1], threads[2]);
  }
  EXPECT_EQ(starts.load(), 2);
  EXPECT_EQ(worker.thread_renewals(), 1);
  EXPECT_FALSE(worker.OnWorkerThread());
  std::thread::id task_thread;
  ASSERT_TRUE(worker
                  .RunTask(
                      [&](WorkerScope& scope) {
                        task_thread = std::this_thread::get_id();
                        return scope.worker().OnWorkerThread() ? absl::OkStatus() : absl::InternalError("not the worker");
                      },
                      nullptr)
                  .ok());
  EXPECT_EQ(task_thread, threads[2]);
  ASSERT_TRUE(worker.Call([](WorkerScope& scope) {
                      return scope.worker().OnWorkerThread() ? absl::OkStatus() : absl::InternalError("not the worker");
                    },
                    nullptr, nullptr)
                  .ok());
}

// A worker that renews its thread after every item (whatever ran since it last looked), under jobs, tasks and calls from several
// threads, runs them all and stops cleanly (the sanitizers watch the hand-overs).
TEST(DeviceWorkerTest, RenewThreadAfterEveryItemUnderLoadAndStop) {
  std::atomic<int> starts{0};
  std::atomic<int> ran{0};
  int seen = 0;  // Worker threads only, one after another.
  DeviceWorker::Options options = Options("sim:0", /*queue_depth=*/64, nullptr);
  options.on_start = [&] { ++starts; };
  options.renew_thread = [&](WorkerScope&) -> std::string {
    const int now = ran.load();
    if (now == seen) return "";
    seen = now;
    return "an item ran";
  };
  auto worker = std::make_unique<DeviceWorker>(std::move(options));
  std::vector<std::thread> clients;
  for (int c = 0; c < 3; ++c) {
    clients.emplace_back([&, c] {
      for (int i = 0; i < 10; ++i) {
        absl::Status status;
        if (c == 0) {
          status = worker->RunTask([&](WorkerScope&) { ++ran; return absl::OkStatus(); }, nullptr);
        } else if (c == 1) {
          status = worker->Call([&](WorkerScope&) { ++ran; return absl::OkStatus(); }, nullptr, nullptr);
        } else {
          absl::Notification finished;
          DeviceWorker::Job j;
          j.run = [&](WorkerScope&, absl::Duration) { ++ran; };
          j.finish = [&] { finished.Notify(); };
          status = worker->Submit(std::move(j));
          if (status.ok()) finished.WaitForNotification();
        }
        EXPECT_TRUE(status.ok()) << status;
      }
    });
  }
  for (std::thread& t : clients) t.join();
  EXPECT_EQ(ran.load(), 30);
  worker->Stop();
  EXPECT_GE(worker->thread_renewals(), 10);  // Each client's ten items alone would renew ten times.
  EXPECT_EQ(starts.load(), worker->thread_renewals() + 1);  // Every thread ran on_start, then stopped.
  worker.reset();
}

// A reason on every look: each thread still runs an item before it hands over (no livelock), the
// fresh thread reports the reason (on_renewed), and Stop from another thread while the worker hands
// over, again and again, ends every thread (the sanitizers watch).
TEST(DeviceWorkerTest, RenewThreadOnEveryLookMakesProgressAndStopsWhileHandingOver) {
  for (int round = 0; round < 20; ++round) {
    std::atomic<int> ran{0};
    std::atomic<int> renewed{0};
    DeviceWorker::Options options = Options("sim:0", /*queue_depth=*/64, nullptr);
    options.renew_thread = [](WorkerScope&) -> std::string { return "always"; };
    options.on_renewed = [&](WorkerScope& scope, const std::string& reason) {
      EXPECT_TRUE(scope.worker().OnWorkerThread());
      EXPECT_EQ(reason, "always");
      ++renewed;
    };
    auto worker = std::make_unique<DeviceWorker>(std::move(options));
    for (int i = 0; i < 16; ++i) {
      DeviceWorker::Job j;
      j.run = [&](WorkerScope&, absl::Duration) { ++ran; };
      ASSERT_TRUE(worker->Submit(std::move(j)).ok());
    }
    std::thread stopper([&] {
      if (round % 2 == 1) absl::SleepFor(absl::Microseconds(50 * round));
      worker->Stop();
    });
    stopper.join();
    EXPECT_EQ(ran.load(), 16);  // Queued jobs still run when stopping.
    EXPECT_EQ(renewed.load(), worker->thread_renewals());  // Every fresh thread reported, then ended.
    worker.reset();
  }
}

TEST(DeviceWorkerTest, ReportsQueueWait) {
  DeviceWorker worker(Options("sim:0", 4));
  absl::Notification release, done;
  absl::Duration waited;
  DeviceWorker::Job blocker, measured;
  blocker.run = [&](WorkerScope&, absl::Duration) { release.WaitForNotification(); };
  measured.run = [&](WorkerScope&, absl::Duration wait) {
    waited = wait;
    done.Notify();
  };
  ASSERT_TRUE(worker.Submit(blocker).ok());
  ASSERT_TRUE(worker.Submit(measured).ok());
  absl::SleepFor(absl::Milliseconds(50));
  release.Notify();
  done.WaitForNotification();
  EXPECT_GE(waited, absl::Milliseconds(45));
}

TEST(DeviceWorkerTest, CancelledJobsGiveUpTheirPlace) {
  DeviceWorker worker(Options("sim:0", 1));
  absl::Notification started, release, ran_last;
  std::atomic<bool> gone{false};
  std::atomic<int> dropped{0};
  std::atomic<bool> cancelled_ran{false};
  DeviceWorker::Job blocker, doomed, last;
  blocker.run = [&](WorkerScope&, absl::Duration) {
    started.Notify();
    release.WaitForNotification();
  };
  doomed.run = [&](WorkerScope&, absl::Duration) { cancelled_ran = true; };
  doomed.cancelled = [&] { return gone.load(); };
  doomed.drop = [&] { ++dropped; };
  last.run = [&](WorkerScope&, absl::Duration) { ran_last.Notify(); };
  ASSERT_TRUE(worker.Submit(blocker).ok());
  started.WaitForNotification();
  ASSERT_TRUE(worker.Submit(doomed).ok());
  EXPECT_EQ(worker.Submit(last).code(), absl::StatusCode::kResourceExhausted);
  gone = true;  // The doomed job's caller leaves: its place is free for the next one.
  EXPECT_TRUE(worker.Submit(last).ok());
  EXPECT_EQ(dropped.load(), 1);
  release.Notify();
  ran_last.WaitForNotification();
  EXPECT_FALSE(cancelled_ran.load());
}

// A job that blocks until `release`, reporting when it started.
DeviceWorker::Job Blocker(absl::Notification& started, absl::Notification& release) {
  DeviceWorker::Job job;
  job.run = [&](WorkerScope&, absl::Duration) {
    started.Notify();
    release.WaitForNotification();
  };
  return job;
}

TEST(DeviceWorkerTest, TasksRunBetweenJobsBeforeQueuedOnesOrAfterThemAsAsked) {
  DeviceWorker worker(Options("sim:0", 8));
  absl::Notification started, release;
  absl::Mutex mu;
  std::vector<std::string> order;
  auto record = [&](const std::string& what) {
    absl::MutexLock lock(&mu);
    order.push_back(what);
  };
  ASSERT_TRUE(worker.Submit(Blocker(started, release)).ok());
  started.WaitForNotification();
  DeviceWorker::Job queued;
  queued.run = [&](WorkerScope&, absl::Duration) { record("queued job"); };
  ASSERT_TRUE(worker.Submit(queued).ok());
  std::thread next([&] {
    EXPECT_TRUE(worker.RunTask([&](WorkerScope&) { record("next task"); return absl::OkStatus(); }, nullptr).ok());
  });
  std::thread after([&] {
    EXPECT_TRUE(worker
                    .RunTask([&](WorkerScope&) { record("after task"); return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                    .ok());
  });
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.tasks == 2; });  // Both wait behind the job.
  {
    absl::MutexLock lock(&mu);
    EXPECT_TRUE(order.empty());  // Never during a job.
  }
  release.Notify();
  next.join();
  after.join();
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<std::string>{"next task", "queued job", "after task"}));
}

TEST(DeviceWorkerTest, ATaskWithdrawnBeforeItStartsNeverRuns) {
  DeviceWorker worker(Options("sim:0", 4));
  absl::Notification started, release;
  ASSERT_TRUE(worker.Submit(Blocker(started, release)).ok());
  started.WaitForNotification();
  std::atomic<bool> ran{false};
  const absl::Time deadline = absl::Now() + absl::Milliseconds(80);
  const absl::Status status = worker.RunTask(
      [&](WorkerScope&) {
        ran = true;
        return absl::OkStatus();
      },
      [&] { return absl::Now() > deadline ? absl::DeadlineExceededError("too late") : absl::OkStatus(); });
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  release.Notify();
  // A later task runs, so the withdrawn one would have run by now had it stayed queued.
  EXPECT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr).ok());
  EXPECT_FALSE(ran.load());
}

TEST(DeviceWorkerTest, AStartedTaskRunsToTheEndAndReportsItsOwnStatus) {
  DeviceWorker worker(Options("sim:0", 4));
  // The caller's interrupt fires from the moment the task starts: a started task is not withdrawn,
  // and the caller gets the task's own status, not the interrupt's.
  std::atomic<bool> inside{false};
  const absl::Status status = worker.RunTask(
      [&](WorkerScope&) {
        inside = true;
        return absl::InvalidArgumentError("the task's own verdict");
      },
      [&] { return inside.load() ? absl::CancelledError("caller gone") : absl::OkStatus(); });
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "the task's own verdict");
}

TEST(DeviceWorkerTest, StateIsPublishedBeforeACallerIsWoken) {
  std::atomic<int> published{0};
  DeviceWorker::Options options = Options("sim:0", 4);
  options.after_each = [&](WorkerScope&) { ++published; };
  DeviceWorker worker(std::move(options));
  EXPECT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr).ok());
  EXPECT_EQ(published.load(), 1);
  absl::Notification finished;
  int seen_at_finish = -1;
  DeviceWorker::Job job;
  job.run = [](WorkerScope&, absl::Duration) {};
  job.finish = [&] {
    seen_at_finish = published.load();
    finished.Notify();
  };
  ASSERT_TRUE(worker.Submit(job).ok());
  finished.WaitForNotification();
  EXPECT_EQ(seen_at_finish, 2);
}

TEST(DeviceWorkerTest, ATaskCannotWaitForAnotherOnTheSameWorker) {
  DeviceWorker worker(Options("sim:0", 4));
  absl::Status inner;
  EXPECT_TRUE(worker
                  .RunTask(
                      [&](WorkerScope&) {
                        inner = worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr);
                        return absl::OkStatus();
                      },
                      nullptr)
                  .ok());
  EXPECT_EQ(inner.code(), absl::StatusCode::kInternal);
}

// Records the batches run_batch saw, as lists of job ids.
struct BatchLog {
  absl::Mutex mu;
  std::vector<std::vector<int>> batches ABSL_GUARDED_BY(mu);
  std::vector<absl::Duration> batch_waits ABSL_GUARDED_BY(mu);
  std::vector<std::vector<int>> Get() {
    absl::MutexLock lock(&mu);
    return batches;
  }
};

DeviceWorker::Job BatchJob(BatchLog& log, const std::string& key, int id, int max_size, absl::Duration delay,
                           absl::Notification* done = nullptr) {
  DeviceWorker::Job j;
  j.batch_key = key;
  j.max_batch_size = max_size;
  j.max_batch_delay = delay;
  j.payload = id;
  j.run = [](WorkerScope&, absl::Duration) { ADD_FAILURE() << "a batching job runs through run_batch"; };
  j.run_batch = [&log](WorkerScope&, const std::vector<DeviceWorker::BatchMember>& members) {
    std::vector<int> ids;
    for (const auto& m : members) ids.push_back(std::any_cast<int>(m.job->payload));
    absl::MutexLock lock(&log.mu);
    log.batches.push_back(ids);
    log.batch_waits.push_back(members.front().batch_wait);
  };
  if (done != nullptr) j.finish = [done] { done->Notify(); };
  return j;
}

// Jobs of one key queued together run as one batch, in queue order, at most max_batch_size at a
// time; other keys and tasks keep their places.
TEST(DeviceWorkerTest, QueuedJobsOfOneKeyRunAsBatchesUpToTheirSize) {
  DeviceWorker worker(Options("sim:0", 16));
  absl::Notification started, release;
  DeviceWorker::Job blocker;
  blocker.run = [&](WorkerScope&, absl::Duration) {
    started.Notify();
    release.WaitForNotification();
  };
  ASSERT_TRUE(worker.Submit(blocker).ok());
  started.WaitForNotification();
  BatchLog log;
  absl::Notification last;
  for (int id : {1, 2}) ASSERT_TRUE(worker.Submit(BatchJob(log, "a", id, 3, absl::ZeroDuration())).ok());
  ASSERT_TRUE(worker.Submit(BatchJob(log, "b", 3, 3, absl::ZeroDuration())).ok());
  for (int id : {4, 5}) ASSERT_TRUE(worker.Submit(BatchJob(log, "a", id, 3, absl::ZeroDuration())).ok());
  // Job 6 runs in the last batch: its finish means every batch ran.
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 6, 3, absl::ZeroDuration(), &last)).ok());
  ASSERT_TRUE(worker.Submit(BatchJob(log, "b", 7, 3, absl::ZeroDuration())).ok());
  release.Notify();
  last.WaitForNotification();
  EXPECT_EQ(log.Get(), (std::vector<std::vector<int>>{{1, 2, 4}, {3, 7}, {5, 6}}));
}

// With fewer jobs queued than the batch holds, the worker waits until max_batch_delay after the
// first was queued, taking those that arrive meanwhile; it never waits past the delay.
std::thread BlockWorker(DeviceWorker& worker, absl::Notification& started, absl::Notification& release);

// Queues jobs 10 and 11 of `key` behind a blocking task, so that they run as one batch: the key
// then has concurrent demand (its next batches may wait for members).
void MakeConcurrent(DeviceWorker& worker, BatchLog& log, const std::string& key, absl::Duration delay) {
  absl::Notification started, release, done;
  std::thread blocker = BlockWorker(worker, started, release);
  ASSERT_TRUE(worker.Submit(BatchJob(log, key, 10, 4, delay)).ok());
  ASSERT_TRUE(worker.Submit(BatchJob(log, key, 11, 4, delay)).ok());
  ASSERT_TRUE(worker.Submit(BatchJob(log, key, 12, 4, delay, &done)).ok());
  release.Notify();
  blocker.join();
  done.WaitForNotification();
  ASSERT_EQ(log.Get().back(), (std::vector<int>{10, 11, 12}));
}

TEST(DeviceWorkerTest, ABatchWaitsUpToItsDelayForMoreMembers) {
  DeviceWorker worker(Options("sim:0", 16));
  BatchLog log;
  MakeConcurrent(worker, log, "a", absl::Milliseconds(400));
  absl::Notification first_done, second_done;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 1, 4, absl::Milliseconds(400), &first_done)).ok());
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.collecting_batch; });
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 2, 4, absl::Milliseconds(400))).ok());
  first_done.WaitForNotification();
  const absl::Duration took = absl::Now() - start;
  EXPECT_GE(took, absl::Milliseconds(390));  // Held open for the delay: the batch was not full.
  EXPECT_EQ(log.Get(), (std::vector<std::vector<int>>{{10, 11, 12}, {1, 2}}));
  {
    absl::MutexLock lock(&log.mu);
    EXPECT_GE(log.batch_waits[1], absl::Milliseconds(300));
  }
  // A full batch does not wait.
  const absl::Time full_start = absl::Now();
  absl::Notification full_done;
  DeviceWorker::Job a = BatchJob(log, "c", 3, 1, absl::Seconds(30), &full_done);
  ASSERT_TRUE(worker.Submit(a).ok());
  full_done.WaitForNotification();
  EXPECT_LT(absl::Now() - full_start, absl::Seconds(10));
  EXPECT_EQ(log.Get().back(), (std::vector<int>{3}));
}

// Clients that ran together and came back together start at once: a held batch that gathered as
// many members as its key's last batch (three) does not wait out its delay; one short of that does.
TEST(DeviceWorkerTest, AHeldBatchStartsOnceItGatheredAsManyAsLastTime) {
  DeviceWorker worker(Options("sim:0", 16));
  BatchLog log;
  MakeConcurrent(worker, log, "a", absl::Seconds(30));  // A batch of three ran.
  absl::Notification done;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 1, 8, absl::Seconds(30))).ok());
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.collecting_batch; });
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 2, 8, absl::Seconds(30))).ok());
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 3, 8, absl::Seconds(30), &done)).ok());
  done.WaitForNotification();
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));  // Not the 30 s delay: the batch of 8 was not full.
  EXPECT_EQ(log.Get().back(), (std::vector<int>{1, 2, 3}));
}

// A member whose caller has gone is dropped, not run; a head that leaves while the batch waits
// ends the wait.
TEST(DeviceWorkerTest, CancelledJobsLeaveTheirBatch) {
  DeviceWorker worker(Options("sim:0", 16));
  BatchLog log;
  MakeConcurrent(worker, log, "a", absl::Seconds(30));
  std::atomic<bool> gone{false};
  absl::Notification dropped, head_dropped, last;
  DeviceWorker::Job head = BatchJob(log, "a", 1, 4, absl::Seconds(30));
  head.cancelled = [&] { return gone.load(); };
  head.drop = [&] { head_dropped.Notify(); };
  const absl::Time start = absl::Now();
  ASSERT_TRUE(worker.Submit(head).ok());
  DeviceWorker::Job member = BatchJob(log, "a", 2, 4, absl::Seconds(30), &last);
  ASSERT_TRUE(worker.Submit(member).ok());
  DeviceWorker::Job leaving = BatchJob(log, "a", 3, 4, absl::Seconds(30));
  leaving.cancelled = [] { return true; };
  leaving.drop = [&] { dropped.Notify(); };
  ASSERT_TRUE(worker.Submit(leaving).ok());
  // The batch took its members and waits for a fourth.
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.collecting_batch && w.jobs == 0; });
  gone = true;  // The head's caller leaves while the batch waits for a fourth member.
  dropped.WaitForNotification();
  head_dropped.WaitForNotification();
  last.WaitForNotification();
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  EXPECT_EQ(log.Get(), (std::vector<std::vector<int>>{{10, 11, 12}, {2}}));
}

// A key seen for the first time, and one whose last batch ran alone with nothing of its kind
// queued when it ended, does not hold the next batch open: a lone client pays no delay, not even
// for its first request of a new size. Once requests overlap, batches wait.
TEST(DeviceWorkerTest, ALoneClientDoesNotWaitForCompanyThatDoesNotCome) {
  DeviceWorker worker(Options("sim:0", 16));
  BatchLog log;
  const absl::Duration delay = absl::Milliseconds(1500);
  absl::Notification first_done;
  const absl::Time first_start = absl::Now();
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 1, 4, delay, &first_done)).ok());
  first_done.WaitForNotification();
  EXPECT_LT(absl::Now() - first_start, absl::Milliseconds(1000));  // No history: ran at once.
  absl::Notification second_done;
  const absl::Time start = absl::Now();
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 2, 4, delay, &second_done)).ok());
  second_done.WaitForNotification();
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(1000));  // Ran at once.

  // Job 3 runs long; job 4 arrives meanwhile: demand is concurrent again, so job 4's batch waits
  // and takes job 5.
  absl::Notification started, release, last;
  DeviceWorker::Job long_job = BatchJob(log, "a", 3, 4, delay);
  auto record = long_job.run_batch;
  long_job.run_batch = [&, record](WorkerScope& scope, const std::vector<DeviceWorker::BatchMember>& members) {
    started.Notify();
    release.WaitForNotification();
    record(scope, members);
  };
  ASSERT_TRUE(worker.Submit(long_job).ok());
  started.WaitForNotification();
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 4, 4, delay)).ok());
  release.Notify();
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.collecting_batch; });  // 4 holds for more.
  ASSERT_TRUE(worker.Submit(BatchJob(log, "a", 5, 4, delay, &last)).ok());
  last.WaitForNotification();
  EXPECT_EQ(log.Get(), (std::vector<std::vector<int>>{{1}, {2}, {3}, {4, 5}}));
}

// ---- The remote-call lane ----

// Runs on `worker` a task that blocks until `release`; returns once it started.
std::thread BlockWorker(DeviceWorker& worker, absl::Notification& started, absl::Notification& release) {
  std::thread t([&] {
    (void)worker.RunTask(
        [&](WorkerScope&) {
          started.Notify();
          release.WaitForNotification();
          return absl::OkStatus();
        },
        nullptr);
  });
  started.WaitForNotification();
  return t;
}

TEST(DeviceWorkerCallTest, ACallRunsOnTheWorkerThreadAndReturnsItsStatus) {
  DeviceWorker worker(Options("sim:1", 4));
  std::thread::id ran_on;
  const absl::Status status = worker.Call(
      [&](WorkerScope&) {
        ran_on = std::this_thread::get_id();
        return absl::NotFoundError("from the lane");
      },
      nullptr, nullptr);
  EXPECT_EQ(status, absl::NotFoundError("from the lane"));
  EXPECT_NE(ran_on, std::this_thread::get_id());
  // Only the worker itself: the ran_on thread is the worker's (it answers OnWorkerThread there).
  bool on_worker = false;
  ASSERT_TRUE(worker.Call([&](WorkerScope&) { on_worker = worker.OnWorkerThread(); return absl::OkStatus(); }, nullptr, nullptr).ok());
  EXPECT_TRUE(on_worker);
}

TEST(DeviceWorkerCallTest, StateIsPublishedBeforeACallReturns) {
  std::atomic<int> published{0};
  DeviceWorker::Options options = Options("sim:1", 4);
  options.after_each = [&](WorkerScope&) { ++published; };
  DeviceWorker worker(std::move(options));
  for (int i = 1; i <= 3; ++i) {
    ASSERT_TRUE(worker.Call([](WorkerScope&) { return absl::OkStatus(); }, nullptr, nullptr).ok());
    EXPECT_EQ(published.load(), i);
  }
}

// A call made on the worker's own thread runs in place, with that worker's scope. (A caller that is
// not the calling thread's worker cannot be named any more: Call takes the caller's WorkerScope,
// which only that worker makes.)
TEST(DeviceWorkerCallTest, OnItsOwnThreadACallRunsInPlaceWithItsOwnScope) {
  DeviceWorker a(Options("sim:0", 4));
  absl::Status in_place;
  ASSERT_TRUE(a.RunTask(
                   [&](WorkerScope& scope) {
                     bool ran = false;
                     in_place = a.Call(
                         [&](WorkerScope& inner) {
                           ran = &inner.worker() == &a && a.OnWorkerThread();
                           return absl::OkStatus();
                         },
                         nullptr, &scope);
                     EXPECT_TRUE(ran);
                     return absl::OkStatus();
                   },
                   nullptr)
                  .ok());
  EXPECT_TRUE(in_place.ok()) << in_place;
}

// Every job, task and call gets the scope of the worker that runs it, on that worker's thread.
TEST(DeviceWorkerCallTest, JobsTasksAndCallsRunWithTheirWorkersScope) {
  DeviceWorker a(Options("sim:0", 4));
  std::atomic<int> right{0};
  absl::Notification job_done;
  DeviceWorker::Job job;
  job.run = [&](WorkerScope& scope, absl::Duration) {
    if (&scope.worker() == &a && a.OnWorkerThread()) ++right;
  };
  job.finish = [&] { job_done.Notify(); };
  ASSERT_TRUE(a.Submit(std::move(job)).ok());
  job_done.WaitForNotification();
  ASSERT_TRUE(a.RunTask(
                   [&](WorkerScope& scope) {
                     if (&scope.worker() == &a && a.OnWorkerThread()) ++right;
                     return absl::OkStatus();
                   },
                   nullptr)
                  .ok());
  ASSERT_TRUE(a.Call(
                   [&](WorkerScope& scope) {
                     if (&scope.worker() == &a && a.OnWorkerThread()) ++right;
                     return absl::OkStatus();
                   },
                   nullptr, nullptr)
                  .ok());
  EXPECT_EQ(right.load(), 3);
}

// Two workers whose jobs call each other, many times at once (a split pipeline each way): every
// call runs on its target's thread and nothing waits forever.
TEST(DeviceWorkerCallTest, WorkersWhoseJobsCallEachOtherDoNotDeadlock) {
  DeviceWorker a(Options("sim:0", 64));
  DeviceWorker b(Options("sim:1", 64));
  constexpr int kJobs = 20;
  constexpr int kCallsPerJob = 25;
  std::atomic<int> wrong_thread{0};
  std::atomic<int> calls_done{0};
  std::atomic<int> jobs_done{0};
  absl::Notification all_done;
  auto job = [&](DeviceWorker& self, DeviceWorker& peer) {
    DeviceWorker::Job j;
    j.run = [&](WorkerScope& scope, absl::Duration) {
      for (int i = 0; i < kCallsPerJob; ++i) {
        self.ServeCalls(scope);  // Between "component runs".
        const absl::Status s = peer.Call(
            [&](WorkerScope& peer_scope) {
              if (!peer.OnWorkerThread() || &peer_scope.worker() != &peer) ++wrong_thread;
              return absl::OkStatus();
            },
            nullptr, &scope);
        if (s.ok()) ++calls_done;
      }
      if (++jobs_done == 2 * kJobs) all_done.Notify();
    };
    return j;
  };
  for (int i = 0; i < kJobs; ++i) {
    ASSERT_TRUE(a.Submit(job(a, b)).ok());
    ASSERT_TRUE(b.Submit(job(b, a)).ok());
  }
  ASSERT_TRUE(all_done.WaitForNotificationWithTimeout(absl::Seconds(60))) << "deadlock: " << jobs_done.load()
                                                                          << " jobs finished";
  EXPECT_EQ(calls_done.load(), 2 * kJobs * kCallsPerJob);
  EXPECT_EQ(wrong_thread.load(), 0);
}

// Held waits (a worker whose state is mid-change waits on a peer without serving its lane) are
// ordered by the workers: the one that would close a cycle is refused at once, the others wait
// until served. Here a waits on b, which waits on c; c's wait on a is refused, naming the chain,
// and then every held call runs.
TEST(DeviceWorkerCallTest, AHeldWaitThatWouldCloseACycleIsRefusedAtOnceAndTheOthersRun) {
  DeviceWorker a(Options("sim:0", 4));
  DeviceWorker b(Options("sim:1", 4));
  DeviceWorker c(Options("sim:2", 4));
  absl::Notification c_busy, go_c, a_done, b_done, c_done;
  absl::Status a_status, b_status, c_status;
  std::atomic<int> ran_on_b{0}, ran_on_c{0}, ran_on_a{0};
  DeviceWorker::Job c_job;  // Busy until the test lets it go, then waits on a: refused.
  c_job.run = [&](WorkerScope&, absl::Duration) {
    c_busy.Notify();
    go_c.WaitForNotification();
    c_status = a.CallHoldingLane([&](WorkerScope&) { ++ran_on_a; return absl::OkStatus(); }, c);
    c_done.Notify();
  };
  ASSERT_TRUE(c.Submit(std::move(c_job)).ok());
  c_busy.WaitForNotification();  // Else c would serve b's call before its job.
  DeviceWorker::Job b_job;  // Waits on c (busy): held, queued in c's lane.
  b_job.run = [&](WorkerScope&, absl::Duration) {
    b_status = c.CallHoldingLane([&](WorkerScope& s) { ran_on_c += &s.worker() == &c; return absl::OkStatus(); }, b);
    b_done.Notify();
  };
  ASSERT_TRUE(b.Submit(std::move(b_job)).ok());
  WaitUntil(c, [](const DeviceWorker::Waiting& w) { return w.calls == 1; });
  DeviceWorker::Job a_job;  // Waits on b (itself holding): held, queued in b's lane.
  a_job.run = [&](WorkerScope&, absl::Duration) {
    a_status = b.CallHoldingLane([&](WorkerScope& s) { ran_on_b += &s.worker() == &b; return absl::OkStatus(); }, a);
    a_done.Notify();
  };
  ASSERT_TRUE(a.Submit(std::move(a_job)).ok());
  WaitUntil(b, [](const DeviceWorker::Waiting& w) { return w.calls == 1; });
  go_c.Notify();
  c_done.WaitForNotification();
  EXPECT_EQ(c_status.code(), absl::StatusCode::kAborted) << c_status;
  EXPECT_NE(c_status.message().find("sim:0 -> sim:1 -> sim:2"), std::string::npos) << c_status;
  EXPECT_EQ(ran_on_a.load(), 0);  // Refused before anything ran.
  b_done.WaitForNotification();
  a_done.WaitForNotification();
  EXPECT_TRUE(b_status.ok()) << b_status;
  EXPECT_TRUE(a_status.ok()) << a_status;
  EXPECT_EQ(ran_on_c.load(), 1);
  EXPECT_EQ(ran_on_b.load(), 1);
  // The waits ended: the same calls in the other direction now run.
  absl::Notification again;
  absl::Status again_status;
  DeviceWorker::Job retry;
  retry.run = [&](WorkerScope&, absl::Duration) {
    again_status = a.CallHoldingLane([&](WorkerScope&) { ++ran_on_a; return absl::OkStatus(); }, c);
    again.Notify();
  };
  ASSERT_TRUE(c.Submit(std::move(retry)).ok());
  again.WaitForNotification();
  EXPECT_TRUE(again_status.ok()) << again_status;
  EXPECT_EQ(ran_on_a.load(), 1);
}

// Two workers evicting to each other at the same moment: whichever registers second is refused.
TEST(DeviceWorkerCallTest, TwoWorkersHoldingTowardEachOtherOneMovesAndOneIsRefused) {
  DeviceWorker a(Options("sim:0", 4));
  DeviceWorker b(Options("sim:1", 4));
  absl::Notification b_busy, go_b, a_done, b_done;
  absl::Status a_status, b_status;
  DeviceWorker::Job b_job;
  b_job.run = [&](WorkerScope&, absl::Duration) {
    b_busy.Notify();
    go_b.WaitForNotification();
    b_status = a.CallHoldingLane([](WorkerScope&) { return absl::OkStatus(); }, b);
    b_done.Notify();
  };
  ASSERT_TRUE(b.Submit(std::move(b_job)).ok());
  b_busy.WaitForNotification();
  DeviceWorker::Job a_job;
  a_job.run = [&](WorkerScope&, absl::Duration) {
    a_status = b.CallHoldingLane([](WorkerScope&) { return absl::OkStatus(); }, a);
    a_done.Notify();
  };
  ASSERT_TRUE(a.Submit(std::move(a_job)).ok());
  WaitUntil(b, [](const DeviceWorker::Waiting& w) { return w.calls == 1; });
  go_b.Notify();
  b_done.WaitForNotification();
  a_done.WaitForNotification();
  EXPECT_EQ(b_status.code(), absl::StatusCode::kAborted) << b_status;
  EXPECT_TRUE(a_status.ok()) << a_status;
}

// A worker busy in a long job serves its lane at the job's component boundaries (ServeCalls).
TEST(DeviceWorkerCallTest, ABusyWorkerServesCallsBetweenComponentRuns) {
  DeviceWorker worker(Options("sim:1", 4));
  std::atomic<bool> stop{false};
  absl::Notification started, finished;
  DeviceWorker::Job j;
  j.run = [&](WorkerScope& scope, absl::Duration) {
    started.Notify();
    while (!stop) {
      worker.ServeCalls(scope);
      absl::SleepFor(absl::Milliseconds(1));
    }
  };
  j.finish = [&] { finished.Notify(); };
  ASSERT_TRUE(worker.Submit(std::move(j)).ok());
  started.WaitForNotification();
  std::atomic<bool> job_still_running{false};
  ASSERT_TRUE(worker.Call([&](WorkerScope&) { job_still_running = !stop; return absl::OkStatus(); }, nullptr, nullptr).ok());
  EXPECT_TRUE(job_still_running.load());
  stop = true;
  finished.WaitForNotification();
}

// A batch holding itself open for members still serves calls.
TEST(DeviceWorkerCallTest, ABatchWaitingForMembersServesCalls) {
  DeviceWorker worker(Options("sim:1", 8));
  BatchLog log;
  MakeConcurrent(worker, log, "k", absl::Seconds(30));
  absl::Notification done;
  ASSERT_TRUE(worker.Submit(BatchJob(log, "k", 1, 4, absl::Seconds(30), &done)).ok());
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.collecting_batch; });  // Waits up to 30 s.
  const absl::Time start = absl::Now();
  ASSERT_TRUE(worker.Call([](WorkerScope&) { return absl::OkStatus(); }, nullptr, nullptr).ok());
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
  EXPECT_EQ(log.Get().size(), 1u) << "the batch ran before the call";
  // The batch starts once it has the three members its key had at once before (not the 30 s delay).
  for (int id = 2; id <= 3; ++id) ASSERT_TRUE(worker.Submit(BatchJob(log, "k", id, 4, absl::Seconds(30))).ok());
  done.WaitForNotification();
  EXPECT_EQ(log.Get(), (std::vector<std::vector<int>>{{10, 11, 12}, {1, 2, 3}}));
}

TEST(DeviceWorkerCallTest, AQueuedCallIsWithdrawnWhenItsCallerGoesAndNeverRuns) {
  DeviceWorker worker(Options("sim:1", 4));
  absl::Notification started, release;
  std::thread blocker = BlockWorker(worker, started, release);
  std::atomic<bool> ran{false};
  const absl::Time deadline = absl::Now() + absl::Milliseconds(100);
  const absl::Status status = worker.Call([&](WorkerScope&) { ran = true; return absl::OkStatus(); },
                                          [&] {
                                            return absl::Now() < deadline ? absl::OkStatus()
                                                                          : absl::DeadlineExceededError("caller gone");
                                          },
                                          nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kDeadlineExceeded);
  release.Notify();
  blocker.join();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr).ok());  // The lane was served by now.
  EXPECT_FALSE(ran.load());
}

TEST(DeviceWorkerCallTest, StoppingFailsWaitingCallsWithUnavailableInsteadOfHanging) {
  DeviceWorker worker(Options("sim:1", 4));
  absl::Notification started, release;
  std::thread blocker = BlockWorker(worker, started, release);
  std::atomic<bool> ran{false};
  absl::Status waiting;
  absl::Notification returned;
  std::thread caller([&] {
    waiting = worker.Call([&](WorkerScope&) { ran = true; return absl::OkStatus(); }, nullptr, nullptr);
    returned.Notify();
  });
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.calls == 1; });  // In the lane, behind the task.
  std::thread stopper([&] { worker.Stop(); });  // Joins only once the task ends.
  EXPECT_TRUE(returned.WaitForNotificationWithTimeout(absl::Seconds(10))) << "the call hung";
  caller.join();
  EXPECT_EQ(waiting.code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(std::string(waiting.message()).find("sim:1 is stopping"), std::string::npos) << waiting;
  release.Notify();
  blocker.join();
  stopper.join();
  EXPECT_FALSE(ran.load());
  const absl::Status after = worker.Call([](WorkerScope&) { return absl::OkStatus(); }, nullptr, nullptr);
  EXPECT_EQ(after.code(), absl::StatusCode::kUnavailable);
}

// --- Scheduling: the worker asks runtime/scheduler.h which waiting job runs next ----------------

namespace scheduling {

// A job that records `name` when it runs.
DeviceWorker::Job Named(const std::string& name, int priority, const std::string& tenant, const std::string& pipeline,
                        absl::Mutex& mu, std::vector<std::string>& order) {
  DeviceWorker::Job job;
  job.schedule.priority = priority;
  job.schedule.tenant = tenant;
  job.schedule.pipeline = pipeline;
  job.run = [&mu, &order, name](WorkerScope&, absl::Duration) {
    absl::MutexLock lock(&mu);
    order.push_back(name);
  };
  return job;
}

// Holds the worker in a task while jobs are queued behind it, then lets it go and waits for all.
void RunQueued(DeviceWorker& worker, const std::vector<DeviceWorker::Job>& jobs) {
  absl::Notification started, release;
  std::thread blocker = BlockWorker(worker, started, release);
  for (const DeviceWorker::Job& job : jobs) ASSERT_TRUE(worker.Submit(job).ok());
  release.Notify();
  blocker.join();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
}

TEST(DeviceWorkerSchedulingTest, HigherPrioritiesAndFairTenantsGoFirst) {
  DeviceWorker worker(Options("sim:0", 16));
  absl::Mutex mu;
  std::vector<std::string> order;
  RunQueued(worker, {Named("flood-1", 0, "flood", "p", mu, order), Named("flood-2", 0, "flood", "p", mu, order),
                     Named("flood-3", 0, "flood", "p", mu, order), Named("quiet-1", 0, "quiet", "p", mu, order),
                     Named("urgent", 5, "flood", "p", mu, order)});
  absl::MutexLock lock(&mu);
  // Priority first; then, at priority 0, the tenants alternate (first come, first served would run
  // quiet-1 last). Fair shares are kept per priority level: "urgent" does not count against flood's
  // priority-0 share.
  EXPECT_EQ(order, (std::vector<std::string>{"urgent", "flood-1", "quiet-1", "flood-2", "flood-3"}));
}

TEST(DeviceWorkerSchedulingTest, AResidentPipelineGoesFirstAndTheReorderIsReported) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.scheduler.max_reorder_delay = absl::Seconds(30);
  options.move_bytes = [](const std::string& pipeline) -> int64_t { return pipeline == "cold" ? 1 << 30 : 0; };
  std::vector<std::string> reasons;
  options.on_reorder = [&reasons](WorkerScope&, const DeviceWorker::Job& job, const std::string& reason) {
    reasons.push_back(job.schedule.pipeline + ": " + reason);
  };
  DeviceWorker worker(std::move(options));
  absl::Mutex mu;
  std::vector<std::string> order;
  RunQueued(worker, {Named("cold-1", 0, "", "cold", mu, order), Named("hot-1", 0, "", "hot", mu, order),
                     Named("hot-2", 0, "", "hot", mu, order)});
  {
    absl::MutexLock lock(&mu);
    EXPECT_EQ(order, (std::vector<std::string>{"hot-1", "hot-2", "cold-1"}));
  }
  ASSERT_EQ(reasons.size(), 2u);  // on_reorder runs on the worker, before the job: done by now.
  EXPECT_NE(reasons[0].find("hot: ran before an older request of pipeline 'cold' (1024 MiB to move"),
            std::string::npos)
      << reasons[0];
}

TEST(DeviceWorkerSchedulingTest, ATenantOverItsQueueLimitIsRefusedByName) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.tenant_queue_limit = 2;
  DeviceWorker worker(std::move(options));
  absl::Mutex mu;
  std::vector<std::string> order;
  absl::Notification started, release;
  std::thread blocker = BlockWorker(worker, started, release);
  ASSERT_TRUE(worker.Submit(Named("a-1", 0, "a", "p", mu, order)).ok());
  ASSERT_TRUE(worker.Submit(Named("a-2", 0, "a", "p", mu, order)).ok());
  const absl::Status refused = worker.Submit(Named("a-3", 0, "a", "p", mu, order));
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.message().find("tenant 'a' has 2 requests waiting on sim:0"), std::string::npos) << refused;
  EXPECT_TRUE(worker.Submit(Named("b-1", 0, "b", "p", mu, order)).ok());  // Another tenant still gets in.
  release.Notify();
  blocker.join();
  // The queued jobs write `order`: they finish before it goes.
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order.size(), 3u);
}

// The hint for the cross-pipeline prefetch: among the jobs waiting before the first task, those of
// another pipeline, the scheduler's choice (here strict priority: the oldest of the highest; then
// the tenant served least); cancelled ones and jobs behind a task do not count; asking changes
// nothing (the jobs then run in the scheduler's order); nothing waiting gives "".
TEST(DeviceWorkerSchedulingTest, TheNextWaitingPipelineIsTheSchedulersChoiceBeforeATask) {
  DeviceWorker worker(Options("sim:0", 16));
  absl::Notification started, release;
  std::vector<std::string> seen;  // Written on the worker; read after a task behind it returned.
  const auto probe = [&](const std::string& pipeline, bool block) {
    DeviceWorker::Job job;
    job.schedule.pipeline = pipeline;
    job.run = [&, pipeline, block](WorkerScope& scope, absl::Duration) {
      if (block) {
        started.Notify();
        release.WaitForNotification();
      }
      seen.push_back(scope.worker().NextWaitingPipeline(scope, pipeline));
    };
    return job;
  };
  ASSERT_TRUE(worker.Submit(probe("running", true)).ok());
  started.WaitForNotification();
  absl::Mutex mu;
  std::vector<std::string> order;
  ASSERT_TRUE(worker.Submit(Named("same", 5, "", "running", mu, order)).ok());  // Its own pipeline.
  ASSERT_TRUE(worker.Submit(Named("cold", 0, "", "cold", mu, order)).ok());
  DeviceWorker::Job gone = Named("gone", 4, "", "gone", mu, order);
  gone.cancelled = [] { return true; };
  ASSERT_TRUE(worker.Submit(gone).ok());
  ASSERT_TRUE(worker.Submit(Named("warm", 2, "", "warm", mu, order)).ok());
  ASSERT_TRUE(worker.Submit(Named("warm-younger", 2, "", "younger", mu, order)).ok());
  std::thread task([&] {
    EXPECT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                               DeviceWorker::TaskOrder::kAfterQueuedJobs)
                    .ok());
  });
  WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.tasks == 1; });
  ASSERT_TRUE(worker.Submit(Named("urgent-behind-the-task", 9, "", "urgent", mu, order)).ok());
  release.Notify();
  task.join();
  ASSERT_TRUE(worker.Submit(probe("last", false)).ok());
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  EXPECT_EQ(seen, (std::vector<std::string>{"warm", ""}));
  absl::MutexLock lock(&mu);
  EXPECT_EQ(order, (std::vector<std::string>{"same", "warm", "warm-younger", "cold", "urgent-behind-the-task"}));
}


// Preemption between steps (SchedulerOptions::preemption): a job of 4 "steps" asks the worker at
// each boundary. The waiting job the scheduler picks runs in place when it preempts (a higher
// priority; under kResident also a shorter job of a pipeline that moves nothing, within the
// bound), is reported through on_preempt, and cannot itself be preempted; a task waiting before
// the jobs is never run inside a job, and with preemption off nothing runs inside.
struct StepLog {
  absl::Mutex mu;
  std::vector<std::string> events;
  void Add(const std::string& e) {
    absl::MutexLock lock(&mu);
    events.push_back(e);
  }
  std::vector<std::string> Get() {
    absl::MutexLock lock(&mu);
    return events;
  }
};

// A job of `steps` steps (each `step_time` long) that records each and asks to be preempted
// between them; the first boundary waits for `gate` (so the test queues jobs meanwhile). Records
// what PreemptBetweenSteps returned ("+" ran something, "-" nothing).
// The steps of a stepping job, logged as `label`.
void RunSteps(WorkerScope& scope, const std::string& label, int steps, StepLog& log, absl::Notification* at_first,
              absl::Notification* gate, absl::Duration step_time = absl::ZeroDuration()) {
  for (int step = 1; step <= steps; ++step) {
    log.Add(absl::StrCat(label, ":", step));
    if (step_time > absl::ZeroDuration()) absl::SleepFor(step_time);
    if (step == steps) break;
    if (step == 1 && at_first != nullptr) {
      at_first->Notify();
      gate->WaitForNotification();
    }
    const bool ran = scope.worker().PreemptBetweenSteps(scope, double(steps - step) / steps);
    log.Add(absl::StrCat(label, ran ? "+" : "-"));
  }
}

DeviceWorker::Job Stepping(const std::string& name, int priority, const std::string& pipeline, double cost, int steps,
                           StepLog& log, absl::Notification* at_first, absl::Notification* gate,
                           absl::Duration step_time = absl::ZeroDuration()) {
  DeviceWorker::Job job;
  job.schedule.priority = priority;
  job.schedule.pipeline = pipeline;
  job.schedule.cost = cost;
  job.run = [=, &log](WorkerScope& scope, absl::Duration) { RunSteps(scope, name, steps, log, at_first, gate, step_time); };
  return job;
}

TEST(DeviceWorkerSchedulingTest, AHigherPriorityJobRunsBetweenTheStepsOfTheRunningOne) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.scheduler.preemption = Preemption::kPriority;
  std::vector<std::string> preempts;  // Written on the worker before the job runs.
  options.on_preempt = [&preempts](WorkerScope&, const DeviceWorker::Job& job, const std::string& reason) {
    preempts.push_back(job.schedule.pipeline + ": " + reason);
  };
  DeviceWorker worker(std::move(options));
  StepLog log;
  absl::Notification at_first, gate;
  ASSERT_TRUE(worker.Submit(Stepping("long", 0, "flux", 8, 4, log, &at_first, &gate)).ok());
  at_first.WaitForNotification();
  ASSERT_TRUE(worker.Submit(Stepping("same", 0, "flux", 8, 2, log, nullptr, nullptr)).ok());
  ASSERT_TRUE(worker.Submit(Stepping("urgent", 5, "zimage", 8, 3, log, nullptr, nullptr)).ok());
  gate.Notify();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  // "urgent" ran inside the first boundary, to its end, without being preempted by "same" (nor
  // could it be: one level deep); "same" (priority 0, like "long") waited for "long" to end.
  EXPECT_EQ(log.Get(), (std::vector<std::string>{"long:1", "urgent:1", "urgent-", "urgent:2", "urgent-", "urgent:3",
                                                  "long+", "long:2", "long-", "long:3", "long-", "long:4", "same:1",
                                                  "same-", "same:2"}));
  ASSERT_EQ(preempts.size(), 1u);
  EXPECT_EQ(preempts[0],
            "zimage: priority 5 preempts the running request of pipeline 'flux' (priority 0) between its denoising steps");
}

// A flood of higher priorities pauses a running job at most once per step boundary: one
// preempting job, then one of its own steps, then the next.
TEST(DeviceWorkerSchedulingTest, ARunningJobMakesAStepBetweenPreemptions) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.scheduler.preemption = Preemption::kPriority;
  DeviceWorker worker(std::move(options));
  StepLog log;
  absl::Notification at_first, gate;
  ASSERT_TRUE(worker.Submit(Stepping("long", 0, "flux", 8, 3, log, &at_first, &gate)).ok());
  at_first.WaitForNotification();
  for (const char* name : {"u1", "u2", "u3"}) {
    ASSERT_TRUE(worker.Submit(Stepping(name, 5, "zimage", 1, 1, log, nullptr, nullptr)).ok());
  }
  gate.Notify();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  EXPECT_EQ(log.Get(), (std::vector<std::string>{"long:1", "u1:1", "long+", "long:2", "u2:1", "long+", "long:3",
                                                  "u3:1"}));
}

// A waiting job whose caller went gives up its place at the step boundary (dropped, its caller
// told) instead of standing in the way of the next one.
TEST(DeviceWorkerSchedulingTest, ACancelledJobIsDroppedAtTheStepBoundaryAndTheNextPreempts) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.scheduler.preemption = Preemption::kPriority;
  DeviceWorker worker(std::move(options));
  StepLog log;
  absl::Notification at_first, gate;
  ASSERT_TRUE(worker.Submit(Stepping("long", 0, "flux", 8, 3, log, &at_first, &gate)).ok());
  at_first.WaitForNotification();
  DeviceWorker::Job gone = Stepping("gone", 9, "zimage", 1, 1, log, nullptr, nullptr);
  gone.cancelled = [] { return true; };
  gone.drop = [&log] { log.Add("gone dropped"); };
  ASSERT_TRUE(worker.Submit(gone).ok());
  ASSERT_TRUE(worker.Submit(Stepping("urgent", 5, "zimage", 1, 1, log, nullptr, nullptr)).ok());
  gate.Notify();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  EXPECT_EQ(log.Get(), (std::vector<std::string>{"long:1", "gone dropped", "urgent:1", "long+", "long:2", "long-",
                                                  "long:3"}));
}

TEST(DeviceWorkerSchedulingTest, AShortResidentJobPreemptsALongOneOnlyWithinTheBound) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.scheduler.preemption = Preemption::kResident;
  options.scheduler.max_reorder_delay = absl::Milliseconds(150);
  options.move_bytes = [](const std::string& pipeline) -> int64_t { return pipeline == "cold" ? 1 << 30 : 0; };
  DeviceWorker worker(std::move(options));
  StepLog log;
  absl::Notification at_first, gate;
  ASSERT_TRUE(worker.Submit(Stepping("long", 0, "flux", 8, 4, log, &at_first, &gate)).ok());
  at_first.WaitForNotification();
  // The scheduler's pick at the first boundary is "hot-1" (the oldest): short (2 < the 6 left)
  // and resident, it preempts. It runs 200 ms; at the next boundaries "hot-2" (as short, as
  // resident) does not: the long job has been paused for longer than max_reorder_delay.
  DeviceWorker::Job hot1 = Stepping("hot-1", 0, "hot", 2, 1, log, nullptr, nullptr);
  const auto slow = hot1.run;
  hot1.run = [slow](WorkerScope& scope, absl::Duration waited) {
    absl::SleepFor(absl::Milliseconds(200));  // Longer than the bound: the long job is not paused again.
    slow(scope, waited);
  };
  ASSERT_TRUE(worker.Submit(hot1).ok());
  ASSERT_TRUE(worker.Submit(Stepping("hot-2", 0, "hot", 2, 1, log, nullptr, nullptr)).ok());
  ASSERT_TRUE(worker.Submit(Stepping("cold", 0, "cold", 1, 1, log, nullptr, nullptr)).ok());
  gate.Notify();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  const std::vector<std::string> events = log.Get();
  ASSERT_GE(events.size(), 4u);
  EXPECT_EQ(std::vector<std::string>(events.begin(), events.begin() + 3),
            (std::vector<std::string>{"long:1", "hot-1:1", "long+"}));
  // Paused 200 ms > the 150 ms bound: hot-2 waits for the long job's end.
  EXPECT_EQ(std::vector<std::string>(events.begin() + 3, events.begin() + 8),
            (std::vector<std::string>{"long:2", "long-", "long:3", "long-", "long:4"}));
}

// Which one is shorter goes by time once the worker has seen both pipelines run: "hot" requests of
// 8 units of work take ~5 ms, "flux" ones of 8 units ~400 ms (4 steps of 100 ms). Equal work, so
// by work "hot" would not preempt; by the learned times (5 ms against ~300 ms left) it does.
TEST(DeviceWorkerSchedulingTest, ShorterGoesByTheLearnedRunTimesOnceBothPipelinesRan) {
  DeviceWorker::Options options = Options("sim:0", 16);
  options.scheduler.preemption = Preemption::kResident;
  options.scheduler.max_reorder_delay = absl::Seconds(30);
  options.move_bytes = [](const std::string&) -> int64_t { return 0; };
  std::vector<std::string> reasons;  // Written on the worker.
  options.on_preempt = [&reasons](WorkerScope&, const DeviceWorker::Job&, const std::string& reason) {
    reasons.push_back(reason);
  };
  DeviceWorker worker(std::move(options));
  StepLog log;
  ASSERT_TRUE(worker.Submit(Stepping("hot-0", 0, "hot", 8, 1, log, nullptr, nullptr, absl::Milliseconds(5))).ok());
  ASSERT_TRUE(
      worker.Submit(Stepping("flux-0", 0, "flux", 8, 4, log, nullptr, nullptr, absl::Milliseconds(100))).ok());
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  absl::Notification at_first, gate;
  ASSERT_TRUE(
      worker.Submit(Stepping("flux-1", 0, "flux", 8, 4, log, &at_first, &gate, absl::Milliseconds(100))).ok());
  at_first.WaitForNotification();
  ASSERT_TRUE(worker.Submit(Stepping("hot-1", 0, "hot", 8, 1, log, nullptr, nullptr, absl::Milliseconds(5))).ok());
  gate.Notify();
  ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                             DeviceWorker::TaskOrder::kAfterQueuedJobs)
                  .ok());
  const std::vector<std::string> events = log.Get();
  const auto at = std::find(events.begin(), events.end(), "flux-1:1");
  ASSERT_NE(at, events.end());
  ASSERT_GE(events.end() - at, 3);
  EXPECT_EQ(std::vector<std::string>(at, at + 3), (std::vector<std::string>{"flux-1:1", "hot-1:1", "flux-1+"}));
  ASSERT_EQ(reasons.size(), 1u);
  EXPECT_NE(reasons[0].find("pipeline 'hot' moves nothing and its run ("), std::string::npos) << reasons[0];
  EXPECT_NE(reasons[0].find(" s expected) is shorter than the running request of pipeline 'flux' has left ("),
            std::string::npos)
      << reasons[0];
}

// A stepping job of batch key `key` (up to `max` members): its run_batch records each member and
// asks to be preempted between its `steps` steps, as the first job's Stepping does.
DeviceWorker::Job SteppingBatch(const std::string& name, int priority, const std::string& key, int max, double cost,
                                int steps, StepLog& log, absl::Notification* at_first, absl::Notification* gate) {
  DeviceWorker::Job job = Stepping(name, priority, "p-" + key, cost, steps, log, at_first, gate);
  job.batch_key = key;
  job.max_batch_size = max;
  job.payload = name;
  job.run_batch = [=, &log](WorkerScope& scope, const std::vector<DeviceWorker::BatchMember>& members) {
    std::string names;
    for (const DeviceWorker::BatchMember& m : members) names += std::any_cast<std::string>(m.job->payload) + ";";
    RunSteps(scope, names, steps, log, at_first, gate);
  };
  return job;
}

// Batches are weighed as they would run. A waiting batch counts the work of every member it would
// take (up to its size): 3 queued jobs of 2 units are more than the 6 a running job of 8 has left
// after its first step, 2 of them are not. A running batch counts its earliest deadline (and its
// highest priority): a priority-3 job does not pause a batch one of whose members has a deadline
// (the run times are not known yet), though its first member has none.
TEST(DeviceWorkerSchedulingTest, BatchesAreWeighedAsTheyRun) {
  for (const int size : {3, 2}) {
    SCOPED_TRACE(absl::StrCat("batches of ", size));
    DeviceWorker::Options options = Options("sim:0", 16);
    options.scheduler.preemption = Preemption::kResident;
    options.scheduler.max_reorder_delay = absl::Seconds(30);
    options.move_bytes = [](const std::string&) -> int64_t { return 0; };
    DeviceWorker worker(std::move(options));
    StepLog log;
    absl::Notification at_first, gate;
    ASSERT_TRUE(worker.Submit(Stepping("long", 0, "flux", 8, 4, log, &at_first, &gate)).ok());
    at_first.WaitForNotification();
    for (const char* name : {"s1", "s2", "s3"}) {
      ASSERT_TRUE(worker.Submit(SteppingBatch(name, 0, "short", size, 2, 1, log, nullptr, nullptr)).ok());
    }
    gate.Notify();
    ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                               DeviceWorker::TaskOrder::kAfterQueuedJobs)
                    .ok());
    const std::vector<std::string> events = log.Get();
    ASSERT_GE(events.size(), 3u);
    if (size == 3) {
      EXPECT_EQ(std::vector<std::string>(events.begin(), events.begin() + 3),
                (std::vector<std::string>{"long:1", "long-", "long:2"}));
    } else {
      EXPECT_EQ(std::vector<std::string>(events.begin(), events.begin() + 3),
                (std::vector<std::string>{"long:1", "s1;s2;:1", "long+"}));
    }
  }
  {
    DeviceWorker::Options options = Options("sim:0", 16);
    options.scheduler.preemption = Preemption::kPriority;
    DeviceWorker worker(std::move(options));
    StepLog log;
    absl::Notification started, release, at_first, gate;
    std::thread blocker = BlockWorker(worker, started, release);
    ASSERT_TRUE(worker.Submit(SteppingBatch("first", 0, "b", 2, 1, 3, log, &at_first, &gate)).ok());
    DeviceWorker::Job tight = SteppingBatch("tight", 0, "b", 2, 1, 3, log, &at_first, &gate);
    tight.schedule.deadline = absl::Now() + absl::Hours(1);  // No run times known yet: never paused.
    ASSERT_TRUE(worker.Submit(tight).ok());
    release.Notify();
    blocker.join();
    at_first.WaitForNotification();
    ASSERT_TRUE(worker.Submit(Stepping("middle", 3, "other", 1, 1, log, nullptr, nullptr)).ok());
    gate.Notify();
    ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                               DeviceWorker::TaskOrder::kAfterQueuedJobs)
                    .ok());
    // The batch ran as one, never paused for "middle" (its second member has a deadline).
    EXPECT_EQ(log.Get(), (std::vector<std::string>{"first;tight;:1", "first;tight;-", "first;tight;:2",
                                                    "first;tight;-", "first;tight;:3", "middle:1"}));
  }
}

TEST(DeviceWorkerSchedulingTest, NothingRunsInsideAJobWithPreemptionOffOrBeforeAWaitingTask) {
  for (const bool off : {true, false}) {
    SCOPED_TRACE(off ? "preemption off" : "a task waits first");
    DeviceWorker::Options options = Options("sim:0", 16);
    if (!off) options.scheduler.preemption = Preemption::kPriority;
    DeviceWorker worker(std::move(options));
    StepLog log;
    absl::Notification at_first, gate;
    ASSERT_TRUE(worker.Submit(Stepping("long", 0, "flux", 8, 3, log, &at_first, &gate)).ok());
    at_first.WaitForNotification();
    std::thread task;
    if (!off) {
      task = std::thread([&] {
        EXPECT_TRUE(worker.RunTask([&log](WorkerScope&) {
                            log.Add("task");
                            return absl::OkStatus();
                          },
                          nullptr)
                        .ok());
      });
      WaitUntil(worker, [](const DeviceWorker::Waiting& w) { return w.tasks == 1; });
    }
    ASSERT_TRUE(worker.Submit(Stepping("urgent", 9, "zimage", 1, 1, log, nullptr, nullptr)).ok());
    gate.Notify();
    if (task.joinable()) task.join();
    ASSERT_TRUE(worker.RunTask([](WorkerScope&) { return absl::OkStatus(); }, nullptr,
                               DeviceWorker::TaskOrder::kAfterQueuedJobs)
                    .ok());
    std::vector<std::string> want = {"long:1", "long-", "long:2", "long-", "long:3"};
    if (!off) want.push_back("task");
    want.push_back("urgent:1");
    EXPECT_EQ(log.Get(), want);
  }
}

}  // namespace scheduling

}  // namespace
}  // namespace stowage
