// A small model with every structure group offloading must handle, sized so that every tensor is
// a multiple of 256 bytes (the engine's alignment): exact byte counts are plain sums.
//   embed (Linear 16→64) | position (root-owned [64]) | blocks: 6 × StackBlock | head (Linear 64→64)
//   StackBlock = fc1 (64→128) + fc2 (128→64) + norm (RMSNorm 64): 66560 bytes in fp32.
// Forward order can be changed to exercise out-of-order, conditional and repeated calls.
#ifndef STOWAGE_TESTS_OFFLOAD_STACK_MODEL_H_
#define STOWAGE_TESTS_OFFLOAD_STACK_MODEL_H_

#include <memory>
#include <vector>

#include <ATen/ATen.h>

#include "models/core/layers.h"
#include "models/core/weight_init.h"

namespace stowage {

class StackBlock : public Module {
 public:
  StackBlock() : Module("StackBlock") {
    fc1_ = AddChild("fc1", std::make_unique<Linear>(64, 128, true, LayerOptions{}));
    fc2_ = AddChild("fc2", std::make_unique<Linear>(128, 64, true, LayerOptions{}));
    norm_ = AddChild("norm", std::make_unique<RMSNorm>(64, 1e-6, true, LayerOptions{}));
  }
  at::Tensor Forward(const at::Tensor& x) {
    ForwardScope scope(*this);
    return x + fc2_->Forward(at::gelu(fc1_->Forward(norm_->Forward(x))));
  }

 private:
  Linear* fc1_;
  Linear* fc2_;
  RMSNorm* norm_;
};

// kRepeatFirst: block 0 again after the last; kFirstTwice: block 0 twice before block 1 (a block run
// once per sample).
enum class StackOrder { kForward, kReverse, kSkipOdd, kRepeatFirst, kFirstTwice };

class StackModel : public Module {
 public:
  static constexpr int64_t kBlockBytes = 66560;
  static constexpr int64_t kOutsideBytes = 4096 + 256 + 256 + 16384 + 256;
  static constexpr int64_t kLargestLeafBytes = 32768 + 512;
  static constexpr int64_t kRootParamBytes = 256;
  static constexpr int kBlocks = 6;
  static constexpr int64_t kTotalBytes = kBlocks * kBlockBytes + kOutsideBytes;

  StackModel() : Module("StackModel") {
    embed_ = AddChild("embed", std::make_unique<Linear>(16, 64, true, LayerOptions{}));
    position_ = AddParameter("position", at::empty({64}));
    blocks_ = AddChild("blocks", std::make_unique<ModuleList<StackBlock>>());
    for (int i = 0; i < kBlocks; ++i) blocks_->Append(std::make_unique<StackBlock>());
    head_ = AddChild("head", std::make_unique<Linear>(64, 64, true, LayerOptions{}));
    InitializeRandomWeights(*this, 1234);
  }

  StackOrder order = StackOrder::kForward;

  at::Tensor Forward(const at::Tensor& x) {
    ForwardScope scope(*this);
    at::Tensor h = embed_->Forward(x) + tensor(position_);
    std::vector<int> sequence;
    for (int i = 0; i < kBlocks; ++i) sequence.push_back(i);
    if (order == StackOrder::kReverse) std::reverse(sequence.begin(), sequence.end());
    if (order == StackOrder::kSkipOdd) sequence = {0, 2, 4};
    if (order == StackOrder::kRepeatFirst) sequence.push_back(0);
    if (order == StackOrder::kFirstTwice) sequence.insert(sequence.begin(), 0);
    for (int i : sequence) h = (*blocks_)[static_cast<size_t>(i)].Forward(h);
    return head_->Forward(h);
  }

 private:
  Linear* embed_;
  int position_;
  ModuleList<StackBlock>* blocks_;
  Linear* head_;
};

}  // namespace stowage

#endif  // STOWAGE_TESTS_OFFLOAD_STACK_MODEL_H_
