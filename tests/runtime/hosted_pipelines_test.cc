#include "runtime/hosted_pipelines.h"

#include <atomic>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace stowage {
namespace {

// A pipeline that is never run: the table only keeps and hands out the pointer.
class FakePipeline : public Pipeline {
 public:
  explicit FakePipeline(std::string name) : name_(std::move(name)) {}
  const std::string& name() const override { return name_; }
  std::string description() const override { return "fake"; }
  const PipelineLimits& limits() const override { return limits_; }
  std::vector<Component*> components() override { return {}; }
  absl::StatusOr<Image> Run(const GenerationParams&, ComponentRunner&, RunContext&) override {
    return absl::UnimplementedError("never run");
  }

 private:
  std::string name_;
  PipelineLimits limits_;
};

std::shared_ptr<Pipeline> Make(const std::string& name) { return std::make_shared<FakePipeline>(name); }

int Defaults(const HostedPipelines& table) {
  int n = 0;
  for (const auto& v : table.List()) n += v.is_default ? 1 : 0;
  return n;
}

void Load(HostedPipelines& table, const std::string& name, bool make_default = false) {
  ASSERT_TRUE(table.BeginLoad(name).ok());
  table.FinishLoad(name, Make(name), make_default);
}

TEST(HostedPipelinesTest, SecondLoadOfALoadingOrReadyNameIsAlreadyExists) {
  HostedPipelines table;
  ASSERT_TRUE(table.BeginLoad("a").ok());
  EXPECT_EQ(table.BeginLoad("a").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(table.Resolve("a").status().code(), absl::StatusCode::kUnavailable);  // Still loading.
  table.FinishLoad("a", Make("a"), false);
  EXPECT_EQ(table.BeginLoad("a").code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(table.Resolve("a").ok());
}

TEST(HostedPipelinesTest, LoadOfANameBeingUnloadedIsRefusedUntilItIsGone) {
  HostedPipelines table;
  Load(table, "a");
  auto unloading = table.BeginUnload("a");
  ASSERT_TRUE(unloading.ok());
  EXPECT_NE(*unloading, nullptr);
  EXPECT_EQ(table.BeginLoad("a").code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table.BeginUnload("a").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(table.Resolve("a").status().code(), absl::StatusCode::kFailedPrecondition);
  // Accepted requests still run until the worker removes it.
  EXPECT_TRUE(table.StillHosted("a", unloading->get()));
  table.FinishUnload("a");
  EXPECT_FALSE(table.StillHosted("a", unloading->get()));
  EXPECT_EQ(table.Resolve("a").status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(table.BeginLoad("a").ok());
}

TEST(HostedPipelinesTest, ExactlyOneDefaultWhileAnyIsReady) {
  HostedPipelines table;
  EXPECT_EQ(table.Resolve("").status().code(), absl::StatusCode::kUnavailable);
  Load(table, "a");
  Load(table, "b");
  Load(table, "c", /*make_default=*/true);
  EXPECT_EQ(Defaults(table), 1);
  EXPECT_EQ((*table.Resolve(""))->name(), "c");
  ASSERT_TRUE(table.BeginUnload("c").ok());  // The default moves at once, to a READY one.
  EXPECT_EQ(Defaults(table), 1);
  EXPECT_EQ((*table.Resolve(""))->name(), "a");
  table.AbandonUnload("c");  // A withdrawn unload changes nothing: "c" is the default again.
  EXPECT_EQ(Defaults(table), 1);
  EXPECT_EQ((*table.Resolve(""))->name(), "c");
  // Unless another was made the default explicitly while it was unloading.
  ASSERT_TRUE(table.BeginUnload("c").ok());
  ASSERT_TRUE(table.BeginLoad("d").ok());
  table.FinishLoad("d", Make("d"), /*make_default=*/true);
  table.AbandonUnload("c");
  EXPECT_EQ((*table.Resolve(""))->name(), "d");
  ASSERT_TRUE(table.BeginUnload("d").ok());
  table.FinishUnload("d");
  EXPECT_EQ((*table.Resolve(""))->name(), "a");  // The first READY one stands in.
  ASSERT_TRUE(table.BeginUnload("a").ok());
  ASSERT_TRUE(table.BeginUnload("b").ok());
  EXPECT_EQ((*table.Resolve(""))->name(), "c");
  ASSERT_TRUE(table.BeginUnload("c").ok());
  EXPECT_EQ(Defaults(table), 0);  // None READY: no default.
  table.AbandonUnload("b");
  EXPECT_EQ((*table.Resolve(""))->name(), "b");
  EXPECT_EQ(Defaults(table), 1);
}

TEST(HostedPipelinesTest, FailedLoadsAreListedWithTheirErrorAndMayBeRetriedOrRemoved) {
  HostedPipelines table;
  ASSERT_TRUE(table.BeginLoad("bad").ok());
  table.FailLoad("bad", absl::InvalidArgumentError("config.json: dim is 0"));
  auto list = table.List();
  ASSERT_EQ(list.size(), 1u);
  EXPECT_EQ(list[0].state, PipelineState::kFailed);
  EXPECT_NE(list[0].error.find("dim is 0"), std::string::npos);
  EXPECT_FALSE(list[0].is_default);
  EXPECT_EQ(table.Resolve("bad").status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(table.BeginLoad("bad").ok());  // Retry.
  table.AbandonLoad("bad");                  // Withdrawn: nothing remains.
  EXPECT_TRUE(table.List().empty());
  ASSERT_TRUE(table.BeginLoad("bad").ok());
  table.FailLoad("bad", absl::InternalError("x"));
  auto removed = table.BeginUnload("bad");
  ASSERT_TRUE(removed.ok());
  EXPECT_EQ(*removed, nullptr);
  EXPECT_TRUE(table.List().empty());
}

TEST(HostedPipelinesTest, MessagesCutAnUnboundedName) {
  HostedPipelines table;
  const std::string huge(1 << 20, 'x');
  const absl::Status status = table.Resolve(huge).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_LT(status.message().size(), 200u);
  EXPECT_NE(status.message().find("1048576 bytes"), std::string::npos);
}

TEST(HostedPipelinesTest, ConcurrentLoadsOfOneNameLetExactlyOneThrough) {
  for (int round = 0; round < 20; ++round) {
    HostedPipelines table;
    std::atomic<int> ok{0}, exists{0};
    std::vector<std::thread> threads;
    for (int i = 0; i < 8; ++i) {
      threads.emplace_back([&] {
        const absl::Status s = table.BeginLoad("same");
        if (s.ok()) {
          ++ok;
          table.FinishLoad("same", Make("same"), false);
        } else if (s.code() == absl::StatusCode::kAlreadyExists) {
          ++exists;
        }
      });
    }
    for (auto& t : threads) t.join();
    EXPECT_EQ(ok.load(), 1);
    EXPECT_EQ(exists.load(), 7);
    EXPECT_EQ(table.List().size(), 1u);
    EXPECT_EQ(Defaults(table), 1);
  }
}

}  // namespace
}  // namespace stowage
