#include "server/device_worker.h"

#include <atomic>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/notification.h"

namespace stowage {
namespace {

TEST(DeviceWorkerTest, RunsJobsInOrderOneAtATimeAndRejectsWhenFull) {
  std::vector<int> depths;
  absl::Mutex depth_mu;
  DeviceWorker worker("sim:0", /*queue_depth=*/2, [&](int d) {
    absl::MutexLock lock(&depth_mu);
    depths.push_back(d);
  });
  absl::Notification started, release;
  std::vector<int> order;
  absl::Mutex order_mu;
  std::atomic<int> running{0};
  std::atomic<int> max_running{0};
  auto job = [&](int id) {
    DeviceWorker::Job j;
    j.run = [&, id](absl::Duration) {
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
  final_job.run = [&](absl::Duration) { last.Notify(); };
  while (!worker.Submit(final_job).ok()) absl::SleepFor(absl::Milliseconds(1));
  last.WaitForNotification();
  absl::MutexLock lock(&order_mu);
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(max_running.load(), 1);
}

TEST(DeviceWorkerTest, ReportsQueueWait) {
  DeviceWorker worker("sim:0", 4, nullptr);
  absl::Notification release, done;
  absl::Duration waited;
  DeviceWorker::Job blocker, measured;
  blocker.run = [&](absl::Duration) { release.WaitForNotification(); };
  measured.run = [&](absl::Duration wait) {
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
  DeviceWorker worker("sim:0", 1, nullptr);
  absl::Notification started, release, ran_last;
  std::atomic<bool> gone{false};
  std::atomic<int> dropped{0};
  std::atomic<bool> cancelled_ran{false};
  DeviceWorker::Job blocker, doomed, last;
  blocker.run = [&](absl::Duration) {
    started.Notify();
    release.WaitForNotification();
  };
  doomed.run = [&](absl::Duration) { cancelled_ran = true; };
  doomed.cancelled = [&] { return gone.load(); };
  doomed.drop = [&] { ++dropped; };
  last.run = [&](absl::Duration) { ran_last.Notify(); };
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

}  // namespace
}  // namespace stowage
