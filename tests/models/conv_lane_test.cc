// The convolution lane (models/core/conv_lane.h): functions run on its own thread, one at a time,
// with the caller's modes; what they throw comes back; Renew moves the next run to a fresh thread;
// Conv2d runs through the lane installed on its thread and computes what it computes without one.
#include "models/core/conv_lane.h"

#include <atomic>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "models/core/layers.h"
#include "models/core/weight_init.h"

namespace stowage {
namespace {

// A number for the thread the lane runs on, its own from the first time it runs there: a thread-local,
// as LibTorch's plan caches are — a fresh thread has none yet, whatever id the system reuses for it.
int LaneThread(ConvLane& lane) {
  static std::atomic<int> next{1};
  static thread_local int mark = 0;
  int seen = 0;
  lane.Run([&] {
    if (mark == 0) mark = next++;
    seen = mark;
  });
  return seen;
}

std::thread::id LaneThreadId(ConvLane& lane) {
  std::thread::id id;
  lane.Run([&] { id = std::this_thread::get_id(); });
  return id;
}

TEST(ConvLaneTest, RunsOnItsOwnThreadUntilRenewed) {
  ConvLane lane;
  lane.Renew();  // Nothing to renew yet.
  EXPECT_EQ(lane.threads_started(), 0);  // Started on first use.
  EXPECT_NE(LaneThreadId(lane), std::this_thread::get_id());
  const int first = LaneThread(lane);
  EXPECT_EQ(LaneThread(lane), first);
  EXPECT_EQ(lane.threads_started(), 1);
  lane.Renew();
  EXPECT_EQ(lane.threads_started(), 2);  // At once: the old thread ended, a fresh one waits.
  const int second = LaneThread(lane);
  EXPECT_NE(second, first);
  EXPECT_NE(LaneThreadId(lane), std::this_thread::get_id());
  EXPECT_EQ(LaneThread(lane), second);
  lane.Renew();
  lane.Renew();  // Twice before a run: two fresh threads, the first never ran anything.
  const int third = LaneThread(lane);
  EXPECT_NE(third, second);
  EXPECT_EQ(lane.threads_started(), 4);
  EXPECT_EQ(lane.runs(), 7);
}

TEST(ConvLaneTest, WhatTheFunctionThrowsComesBackToTheCaller) {
  ConvLane lane;
  EXPECT_THROW(lane.Run([] { throw std::runtime_error("no room"); }), std::runtime_error);
  // LibTorch's errors keep their type (an allocator's refusal is a c10::OutOfMemoryError, which
  // placement's retries catch by type).
  try {
    lane.Run([] { (void)at::ones({2, 3}).matmul(at::ones({2, 3})); });
    ADD_FAILURE() << "a shape mismatch went through";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot be multiplied"), std::string::npos) << e.what();
  }
  bool ran = false;
  lane.Run([&] { ran = true; });  // The lane goes on after a throw.
  EXPECT_TRUE(ran);
  EXPECT_EQ(lane.threads_started(), 1);
}

TEST(ConvLaneTest, TheCallersInferenceAndGradModesGoWithTheFunction) {
  ConvLane lane;
  bool inference = false, grad = true;
  {
    c10::InferenceMode guard;
    lane.Run([&] {
      inference = c10::InferenceMode::is_enabled();
      grad = c10::GradMode::is_enabled();
    });
  }
  EXPECT_TRUE(inference);
  EXPECT_FALSE(grad);
  lane.Run([&] {
    inference = c10::InferenceMode::is_enabled();
    grad = c10::GradMode::is_enabled();
  });
  EXPECT_FALSE(inference);
  EXPECT_TRUE(grad);
  {
    c10::AutoGradMode off(false);
    lane.Run([&] { grad = c10::GradMode::is_enabled(); });
  }
  EXPECT_FALSE(grad);
  // A tensor made on the lane under the caller's inference mode is an inference tensor there too.
  at::Tensor made;
  {
    c10::InferenceMode guard;
    lane.Run([&] { made = at::ones({2}); });
  }
  EXPECT_TRUE(made.is_inference());
}

// Callers on several threads take turns: every function runs once, never two at a time.
TEST(ConvLaneTest, CallersOnSeveralThreadsTakeTurns) {
  ConvLane lane;
  std::atomic<int> inside{0}, most{0}, total{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c) {
    callers.emplace_back([&, c] {
      for (int k = 0; k < 50; ++k) {
        if (c == 0 && k % 10 == 0) lane.Renew();
        lane.Run([&] {
          const int now = ++inside;
          int seen = most.load();
          while (now > seen && !most.compare_exchange_weak(seen, now)) {
          }
          ++total;
          --inside;
        });
      }
    });
  }
  for (std::thread& t : callers) t.join();
  EXPECT_EQ(total.load(), 200);
  EXPECT_EQ(most.load(), 1);
  EXPECT_EQ(lane.runs(), 200);
  // Five renewals, the first of which may come before any run (nothing to renew then).
  EXPECT_GE(lane.threads_started(), 5);
  EXPECT_LE(lane.threads_started(), 6);
}

// Installs a lane on the calling thread for its scope.
struct LaneOnThisThread {
  explicit LaneOnThisThread(ConvLane* lane) { ConvLane::SetForThisThread(lane); }
  ~LaneOnThisThread() { ConvLane::SetForThisThread(nullptr); }
};

class ConvHolder : public Module {
 public:
  ConvHolder() : Module("ConvHolder") {
    conv = AddChild("conv", std::make_unique<Conv2d>(3, 8, 3, 1, 1, LayerOptions{}));
  }
  Conv2d* conv;
};

// Conv2d on a thread with a lane runs its convolution there, bit for bit what it computes without one.
TEST(ConvLaneTest, Conv2dRunsOnTheLaneOfItsThread) {
  ConvHolder holder;
  InitializeRandomWeights(holder, 3);
  const at::Tensor x = at::randn({2, 3, 16, 16}, at::TensorOptions().dtype(at::kFloat));
  ASSERT_EQ(ConvLane::ForThisThread(), nullptr);
  const at::Tensor plain = holder.conv->Forward(x);
  ConvLane lane;
  at::Tensor laned, again;
  {
    LaneOnThisThread installed(&lane);
    {
      c10::InferenceMode guard;
      laned = holder.conv->Forward(x);
    }
    again = holder.conv->Forward(x);
  }
  EXPECT_EQ(lane.runs(), 2);
  EXPECT_TRUE(at::equal(plain, laned));
  EXPECT_TRUE(at::equal(plain, again));
  EXPECT_TRUE(laned.is_inference());
  // Without the lane again: nothing more runs there.
  (void)holder.conv->Forward(x);
  EXPECT_EQ(lane.runs(), 2);
  // A bad input's error reaches the caller through the lane.
  LaneOnThisThread installed(&lane);
  EXPECT_THROW((void)holder.conv->Forward(at::randn({2, 5, 16, 16})), c10::Error);
  EXPECT_EQ(lane.runs(), 3);
}

}  // namespace
}  // namespace stowage
