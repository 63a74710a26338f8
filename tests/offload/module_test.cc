#include "offload/module.h"

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace stowage {
namespace {

class Scale : public Module {
 public:
  Scale() : Module("Scale") { weight_ = AddParameter("weight", at::full({2}, 3.0f)); }
  at::Tensor Forward(const at::Tensor& x, bool fail = false) {
    ForwardScope scope(*this);
    if (fail) throw std::runtime_error("forward failed");
    return x * tensor(weight_);
  }

 private:
  int weight_;
};

class Outer : public Module {
 public:
  Outer() : Module("Outer") {
    inner_ = AddChild("inner", std::make_unique<Scale>());
    AddBuffer("offset", at::ones({2}));
  }
  Scale* inner_;
};

class RecordingHook : public ModuleHook {
 public:
  RecordingHook(std::string tag, std::vector<std::string>* log) : tag_(std::move(tag)), log_(log) {}
  void PreForward(Module& m) override { log_->push_back(tag_ + ":pre:" + m.kind()); }
  void PostForward(Module& m) override { log_->push_back(tag_ + ":post:" + m.kind()); }

 private:
  std::string tag_;
  std::vector<std::string>* log_;
};

TEST(ModuleTest, HooksRunPreInOrderAndPostInReverse) {
  Scale scale;
  std::vector<std::string> log;
  ASSERT_TRUE(scale.AddHook("a", std::make_shared<RecordingHook>("a", &log)).ok());
  ASSERT_TRUE(scale.AddHook("b", std::make_shared<RecordingHook>("b", &log)).ok());
  const at::Tensor y = scale.Forward(at::ones({2}));
  EXPECT_EQ(log, (std::vector<std::string>{"a:pre:Scale", "b:pre:Scale", "b:post:Scale", "a:post:Scale"}));
  EXPECT_FLOAT_EQ(y[0].item<float>(), 3.0f);
}

TEST(ModuleTest, HooksAreNamedAndRemovedIndependently) {
  Scale scale;
  std::vector<std::string> log;
  ASSERT_TRUE(scale.AddHook("a", std::make_shared<RecordingHook>("a", &log)).ok());
  ASSERT_TRUE(scale.AddHook("b", std::make_shared<RecordingHook>("b", &log)).ok());
  const absl::Status duplicate = scale.AddHook("a", std::make_shared<RecordingHook>("x", &log));
  EXPECT_EQ(duplicate.code(), absl::StatusCode::kAlreadyExists);
  EXPECT_TRUE(scale.RemoveHook("a"));
  EXPECT_FALSE(scale.RemoveHook("a"));
  EXPECT_EQ(scale.FindHook("a"), nullptr);
  EXPECT_NE(scale.FindHook("b"), nullptr);
  scale.Forward(at::ones({2}));
  EXPECT_EQ(log, (std::vector<std::string>{"b:pre:Scale", "b:post:Scale"}));
}

TEST(ModuleTest, PostHooksSkippedWhenForwardThrows) {
  Scale scale;
  std::vector<std::string> log;
  ASSERT_TRUE(scale.AddHook("a", std::make_shared<RecordingHook>("a", &log)).ok());
  EXPECT_THROW(scale.Forward(at::ones({2}), /*fail=*/true), std::runtime_error);
  EXPECT_EQ(log, (std::vector<std::string>{"a:pre:Scale"}));
}

TEST(ModuleTest, OffloadedTensorAccessFailsLoudlyWithItsPath) {
  Outer outer;
  outer.inner_->slots()[0].value = at::Tensor();
  try {
    outer.inner_->Forward(at::ones({2}));
    FAIL() << "expected OffloadedTensorAccess";
  } catch (const OffloadedTensorAccess& e) {
    EXPECT_NE(std::string(e.what()).find("inner.weight"), std::string::npos) << e.what();
  }
}

TEST(ModuleTest, PathsSlotsAndBytesCoverTheTree) {
  Outer outer;
  std::vector<std::string> paths;
  outer.ForEachSlot([&](Module& m, TensorSlot& slot) { paths.push_back(m.SlotPath(slot)); });
  EXPECT_EQ(paths, (std::vector<std::string>{"offset", "inner.weight"}));
  EXPECT_EQ(outer.DefinedBytes(), 4 * 4);
  EXPECT_TRUE(outer.inner_->is_leaf());
  EXPECT_FALSE(outer.is_leaf());
  EXPECT_EQ(outer.inner_->path(), "inner");
}

TEST(ModuleTest, DuplicateNamesAreRejected) {
  Outer outer;
  EXPECT_THROW(outer.AddParameter("offset", at::ones({1})), std::invalid_argument);
  EXPECT_THROW(outer.AddChild("inner", std::make_unique<Scale>()), std::invalid_argument);
}

}  // namespace
}  // namespace stowage
