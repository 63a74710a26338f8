// Deferred FP8 weights (Module::DeferFp8, HostWeights::deferred): the codes and scales are written
// before anything reads the host copies — onloading, pointing at the host, the stores that copy host
// bytes — with the bytes an FP8 conversion gives, and a compressed int4 store makes its copy from the
// source in one pass without writing them (the same bytes on the device as from the written copy).
#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/version.h>

#include "offload/compression.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/host_spill.h"
#include "offload/host_weights.h"
#include "offload/load_quantizer.h"
#include "offload/module.h"
#include "tests/offload/spill_dir.h"

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define TEST_HAS_FLOAT8 1
#endif

namespace stowage {
namespace {

// A bf16 weight with a row of zeros (scale 1) and a wide range across rows.
at::Tensor Source(int64_t rows, int64_t k, int seed) {
  at::manual_seed(seed);
  at::Tensor w = at::randn({rows, k}) * at::linspace(0.01, 30.0, rows).unsqueeze(1);
  w[1].zero_();
  return w.to(at::kBFloat16);
}

// One layer: an FP8 weight's codes ("weight", [rows, k]) and scales ("weight_scale", fp32 [rows]),
// deferred or written now, and a bias. Its forward records what its slots hold, on the host.
class Fp8Leaf : public Module {
 public:
  Fp8Leaf(const at::Tensor& source, at::ScalarType codes_dtype, bool defer) : Module("Fp8Leaf") {
    const int64_t rows = source.size(0);
    if (defer) {
      weight_ = AddParameter("weight", UnwrittenHostTensor(source.sizes(), codes_dtype));
      scale_ = AddBuffer("weight_scale", UnwrittenHostTensor({rows}, at::kFloat));
      DeferFp8(weight_, scale_, source);
    } else {
      const QuantizedTensor q = Quantize(source, CompressFormat::kFp8E4M3);
      weight_ = AddParameter("weight", q.q.view(codes_dtype).clone());
      scale_ = AddBuffer("weight_scale", q.scale.clone());
    }
    bias_ = AddParameter("bias", at::arange(rows, at::kFloat));
  }
  void Forward(std::vector<at::Tensor>& seen) {
    ForwardScope scope(*this);
    for (int i : {weight_, scale_, bias_}) seen.push_back(tensor(i).cpu().contiguous().view({-1}).view(at::kByte).clone());
  }

 private:
  int weight_, scale_, bias_;
};

class Fp8Root : public Module {
 public:
  Fp8Root(at::ScalarType codes_dtype, bool defer) : Module("Fp8Root") {
    for (int i = 0; i < 3; ++i) {
      leaves_.push_back(AddChild("layer" + std::to_string(i),
                                 std::make_unique<Fp8Leaf>(Source(32, 64, 10 + i), codes_dtype, defer)));
    }
  }
  std::vector<at::Tensor> Forward() {
    ForwardScope scope(*this);
    std::vector<at::Tensor> seen;
    for (Fp8Leaf* leaf : leaves_) leaf->Forward(seen);
    return seen;
  }
  Fp8Leaf& leaf(int i) { return *leaves_[static_cast<size_t>(i)]; }

 private:
  std::vector<Fp8Leaf*> leaves_;
};

void ExpectSameBytes(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(at::equal(got[i], want[i])) << "tensor " << i;
}

GroupOffloadOptions LeafStreaming(CompressFormat format) {
  GroupOffloadOptions options;
  options.type = OffloadType::kLeafLevel;
  options.use_stream = true;
  options.prefetch_depth = 1;
  options.compress = format;
  return options;
}

// What the layers hold when the weights were written at once, onloaded whole.
std::vector<at::Tensor> WrittenForward(at::ScalarType codes_dtype, DeviceBackend& backend) {
  Fp8Root root(codes_dtype, /*defer=*/false);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
  EXPECT_TRUE(weights->OnloadAll(backend).ok());
  c10::InferenceMode guard;
  return root.Forward();
}

TEST(DeferredFp8Test, CaptureTakesTheDeclarationsAndOnloadingWritesThemFirst) {
  Fp8Root root(at::kByte, /*defer=*/true);
  EXPECT_EQ(root.leaf(0).deferred_fp8().size(), 1u);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
  EXPECT_TRUE(root.leaf(0).deferred_fp8().empty());  // Taken over.
  ASSERT_EQ(weights->deferred().size(), 3u);
  int unwritten = 0;
  for (const HostWeights::Entry& e : weights->entries()) unwritten += weights->unwritten(e);
  EXPECT_EQ(unwritten, 6);  // Codes and scales of each layer; not the biases.
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  ASSERT_TRUE(weights->OnloadAll(*backend).ok());
  for (const HostWeights::Entry& e : weights->entries()) EXPECT_FALSE(weights->unwritten(e));
  c10::InferenceMode guard;
  ExpectSameBytes(root.Forward(), WrittenForward(at::kByte, *backend));
}

// Only the capture holding the declarations may write them: a second capture of the tree is refused
// while it holds them unwritten; destroyed, it gives them back, and the next capture writes them.
TEST(DeferredFp8Test, TheDeclarationsHaveOneHolderAtATime) {
  Fp8Root root(at::kByte, /*defer=*/true);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  {
    std::unique_ptr<HostWeights> first = *HostWeights::Capture(root);
    const absl::StatusOr<std::unique_ptr<HostWeights>> second = HostWeights::Capture(root);
    ASSERT_FALSE(second.ok());
    EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(second.status().message().find("layer0"), std::string::npos) << second.status();
  }
  EXPECT_EQ(root.leaf(0).deferred_fp8().size(), 1u);  // Given back unwritten.
  std::unique_ptr<HostWeights> again = *HostWeights::Capture(root);
  ASSERT_TRUE(again->OnloadAll(*backend).ok());
  c10::InferenceMode guard;
  ExpectSameBytes(root.Forward(), WrittenForward(at::kByte, *backend));
  again.reset();  // Written: nothing to give back, and a new capture takes the written copies.
  EXPECT_TRUE(root.leaf(0).deferred_fp8().empty());
  EXPECT_TRUE(HostWeights::Capture(root).ok());
}

TEST(DeferredFp8Test, PointingAtTheHostWritesThem) {
  Fp8Root root(at::kByte, /*defer=*/true);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
  weights->PointAtHost();
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  c10::InferenceMode guard;
  ExpectSameBytes(root.Forward(), WrittenForward(at::kByte, *backend));
}

// The stores that copy host bytes as they are (pinned, and a compressed store whose format does not
// take the codes: int8 compresses no byte tensor) write the deferred weights first.
TEST(DeferredFp8Test, StoresThatCopyHostBytesWriteThemFirst) {
  for (const CompressFormat format : {CompressFormat::kNone, CompressFormat::kInt8}) {
    SCOPED_TRACE(CompressFormatName(format));
    Fp8Root root(at::kByte, /*defer=*/true);
    std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
    std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
    auto offloader = GroupOffloader::Apply("fp8", root, *weights, *backend, LeafStreaming(format));
    ASSERT_TRUE(offloader.ok()) << offloader.status();
    for (const HostWeights::Entry& e : weights->entries()) EXPECT_FALSE(weights->unwritten(e));
    EXPECT_EQ((*offloader)->stats().one_pass_fp8_weights, 0);
    c10::InferenceMode guard;
    for (int i = 0; i < 2; ++i) ExpectSameBytes(root.Forward(), WrittenForward(at::kByte, *backend));
  }
}

TEST(DeferredFp8Test, ReplacingAnUnwrittenHostCopyIsRefused) {
  Fp8Root root(at::kByte, /*defer=*/true);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
  HostWeights::Entry& codes = weights->entries()[weights->deferred()[0].codes];
  EXPECT_THROW(weights->ReplaceHost(codes, codes.host.clone()), c10::Error);
  weights->MaterializeDeferred();
  EXPECT_NO_THROW(weights->ReplaceHost(codes, codes.host.clone()));
}

TEST(DeferredFp8Test, SpillingLeavesTheUnwrittenCopiesAlone) {
  const std::string dir = MakeSpillTestDir();
  if (dir.empty()) GTEST_SKIP() << "no disk directory for spill files";
  Fp8Root root(at::kByte, /*defer=*/true);
  const void* codes = root.leaf(0).slots()[0].value.data_ptr();
  const void* bias = root.leaf(0).slots()[2].value.data_ptr();
  absl::StatusOr<SpillStats> spilled = SpillHeapTensors(root, dir, "deferred", /*min_bytes=*/0);
  ASSERT_TRUE(spilled.ok()) << spilled.status();
  EXPECT_EQ(spilled->tensors, 3);  // The biases only.
  EXPECT_EQ(root.leaf(0).slots()[0].value.data_ptr(), codes);
  EXPECT_NE(root.leaf(0).slots()[2].value.data_ptr(), bias);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  ASSERT_TRUE(weights->OnloadAll(*backend).ok());
  c10::InferenceMode guard;
  ExpectSameBytes(root.Forward(), WrittenForward(at::kByte, *backend));
}

#ifdef TEST_HAS_FLOAT8
// The quantizer's one pass writes what quantizing the written FP8 weight writes, plus its scales —
// on the host, through the staging path on the CPU, and on CUDA where there is one.
TEST(DeferredFp8Test, TheQuantizersOnePassWritesTheTwoPassesBytes) {
  const at::Tensor source = Source(48, 128, 3);
  const QuantizedTensor fp8 = Quantize(source, CompressFormat::kFp8E4M3);
  const at::Tensor codes = fp8.q.view(at::kFloat8_e4m3fn);
  const QuantLayout layout = LayoutOf(CompressFormat::kInt4, source.sizes());
  std::vector<std::unique_ptr<DeviceBackend>> backends;
  backends.push_back(CreateSimulatedBackend({}));
  if (at::hasCUDA()) {
    auto cuda = CreateCudaBackend(0);
    if (cuda.ok()) backends.push_back(*std::move(cuda));
  }
  for (auto& backend : backends) {
    for (const bool stage_on_cpu : {false, true}) {
      SCOPED_TRACE(std::string(backend->name()) + (stage_on_cpu ? " staged" : ""));
      auto two = *LoadQuantizer::Create(*backend, source.numel(), 2, /*chunk_elements=*/1000, stage_on_cpu);
      auto one = *LoadQuantizer::Create(*backend, source.numel(), 2, /*chunk_elements=*/1000, stage_on_cpu);
      at::Tensor q2 = at::zeros({layout.q_bytes}, at::kByte), s2 = at::zeros({layout.scale_bytes()}, at::kByte);
      at::Tensor q1 = at::zeros_like(q2), s1 = at::zeros_like(s2), f1 = at::zeros({4 * source.size(0)}, at::kByte);
      two->QuantizeInto(codes, CompressFormat::kInt4, q2, s2);
      one->QuantizeFp8Into(source, CompressFormat::kInt4, q1, s1, f1);
      two->Finish();
      one->Finish();
      EXPECT_TRUE(at::equal(q1, q2));
      EXPECT_TRUE(at::equal(s1, s2));
      EXPECT_TRUE(at::equal(f1, fp8.scale.view(at::kByte)));
    }
  }
}

// An int4 store of FP8 weights: made from the deferred sources in one pass, the slots hold the bytes
// the two passes give (the FP8 copy written, then its int4 copy), and the FP8 host copies are never
// written. Widening into float8 needs CUDA.
TEST(DeferredFp8Test, AnInt4StoreMakesItsCopyInOnePassWithTheSameBytes) {
  std::unique_ptr<DeviceBackend> cuda;
  if (at::hasCUDA()) {
    auto made = CreateCudaBackend(0);
    if (made.ok()) cuda = *std::move(made);
  }
  if (cuda == nullptr) GTEST_SKIP() << "widening into float8 needs a GPU";
  std::vector<std::vector<at::Tensor>> runs;
  for (const bool defer : {false, true}) {
    Fp8Root root(at::kFloat8_e4m3fn, defer);
    std::unique_ptr<HostWeights> weights = *HostWeights::Capture(root);
    auto offloader = GroupOffloader::Apply("fp8", root, *weights, *cuda, LeafStreaming(CompressFormat::kInt4));
    ASSERT_TRUE(offloader.ok()) << offloader.status();
    EXPECT_EQ((*offloader)->stats().one_pass_fp8_weights, defer ? 3 : 0);
    int unwritten = 0;
    for (const HostWeights::Entry& e : weights->entries()) unwritten += weights->unwritten(e);
    EXPECT_EQ(unwritten, defer ? 6 : 0);
    c10::InferenceMode guard;
    runs.push_back(root.Forward());
    ExpectSameBytes(root.Forward(), runs.back());
  }
  ExpectSameBytes(runs[1], runs[0]);
}
#endif

}  // namespace
}  // namespace stowage
