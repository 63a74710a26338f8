// 8-bit streaming (CompressedHostStore through GroupOffloader) on the simulated device: the codec,
// the accuracy of dequantized weights and of a whole forward, the bytes moved per forward (exact,
// from the backend's host-to-device counter), the peak device bytes against the planned working
// set (scratch included), and 8-bit safetensors checkpoints streamed as they are.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <gtest/gtest.h>
#include <torch/version.h>
#ifdef STOWAGE_WITH_CUDA
#include <ATen/cuda/Sleep.h>
#endif

#include "absl/strings/str_cat.h"
#include "base/fp8_e4m3.h"
#include "offload/compressed_safetensors.h"
#include "offload/compression.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/group_plan.h"
#include "offload/host_weights.h"
#include "offload/load_quantizer.h"
#include "offload/safetensors.h"
#include "offload/widen_kernels.h"
#include "tests/offload/stack_model.h"

namespace stowage {
namespace {

double RelL2(const at::Tensor& got, const at::Tensor& want) {
  const at::Tensor g = got.to(at::kDouble);
  const at::Tensor w = want.to(at::kDouble);
  return (g - w).norm().item<double>() / w.norm().item<double>();
}

// int4's group scales as the device sees them: e4m3(code) · row scale, fp32 [C, groups].
at::Tensor Int4GroupScales(const QuantizedTensor& q, int64_t channels) {
  const at::Tensor rows = q.scale.narrow(0, 0, channels * 4).view(at::kFloat);
  const at::Tensor codes = q.scale.narrow(0, channels * 4, q.scale.numel() - channels * 4).to(at::kLong);
  return Fp8E4M3Table(at::kFloat).index_select(0, codes).view({channels, -1}) * rows.unsqueeze(1);
}

// --- The codec ------------------------------------------------------------------------------------

TEST(Fp8E4M3Test, EveryFiniteCodeRoundTrips) {
  const at::Tensor table = Fp8E4M3Table(at::kFloat);
  EXPECT_EQ(table[0x7E].item<float>(), 448.0f);
  EXPECT_EQ(table[0x08].item<float>(), std::ldexp(1.0f, -6));  // Smallest normal.
  EXPECT_EQ(table[0x01].item<float>(), std::ldexp(1.0f, -9));  // Smallest subnormal.
  EXPECT_EQ(table[0x38].item<float>(), 1.0f);
  EXPECT_TRUE(std::isnan(table[0x7F].item<float>()));
  EXPECT_TRUE(std::isnan(table[0xFF].item<float>()));
  const at::Tensor codes = EncodeFp8E4M3(table);
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) continue;
    EXPECT_EQ(codes[c].item<uint8_t>(), c) << c;
  }
  // The tables of the narrower dtypes hold the same values.
  EXPECT_TRUE(at::equal(Fp8E4M3Table(at::kBFloat16).to(at::kFloat).nan_to_num(0), table.nan_to_num(0)));
  EXPECT_TRUE(at::equal(Fp8E4M3Table(at::kHalf).to(at::kFloat).nan_to_num(0), table.nan_to_num(0)));
}

TEST(Fp8E4M3Test, RoundsToNearestEvenAndSaturates) {
  // 1.0625 lies halfway between 1.0 (0x38, even mantissa) and 1.125 (0x39): to even.
  // 1.1875 lies halfway between 1.125 (0x39) and 1.25 (0x3A): to even.
  const at::Tensor x = at::tensor({1.0625f, 1.1875f, 1.07f, 1000.0f, -1000.0f, 0.0f, -0.0f,
                                   std::ldexp(1.0f, -10), std::ldexp(1.5f, -10), 464.0f});
  const at::Tensor q = EncodeFp8E4M3(x);
  const std::vector<int> want = {0x38, 0x3A, 0x39, 0x7E, 0xFE, 0x00, 0x80, 0x00, 0x01, 0x7E};
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(q[static_cast<int64_t>(i)].item<uint8_t>(), want[i]) << i;
}

// The e4m3 encoder's bit arithmetic against the plain formulation it replaced
// (EncodeE4M3Reference: frexp / ldexp, round to nearest even, saturation at 448, NaN kept): a
// sweep over every 977th float bit pattern
// (all signs, exponents, NaNs and infinities), every e4m3 value, every midpoint between two
// neighbours and the floats either side of each. Equal everywhere (exhaustively, too, when it landed).
TEST(Fp8E4M3Test, TheBitArithmeticEncoderEqualsTheReferenceFormulation) {
  std::vector<float> values;
  for (uint64_t bits = 0; bits < (uint64_t{1} << 32); bits += 977) {
    const auto b = static_cast<uint32_t>(bits);
    float f;
    std::memcpy(&f, &b, sizeof(f));
    values.push_back(f);
  }
  const at::Tensor table = Fp8E4M3Table(at::kFloat);
  for (int c = 0; c < 0x7E; ++c) {  // Non-negative finite codes, each with its upper neighbour.
    const float lo = table[c].item<float>(), hi = table[c + 1].item<float>();
    const float mid = (lo + hi) / 2;
    for (const float v : {lo, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1000.0f), hi}) {
      values.push_back(v);
      values.push_back(-v);
    }
  }
  for (const float v : {448.0f, 464.0f, std::nextafter(464.0f, 0.0f), 480.0f, 1e30f, std::ldexp(1.0f, -130)}) {
    values.push_back(v);
    values.push_back(-v);
  }
  const at::Tensor x = at::from_blob(values.data(), {static_cast<int64_t>(values.size())}, at::kFloat);
  const at::Tensor got = EncodeFp8E4M3(x);
  const auto* codes = got.data_ptr<uint8_t>();
  int64_t mismatches = 0;
  for (size_t i = 0; i < values.size(); ++i) {
    if (codes[i] != EncodeE4M3Reference(values[i]) && ++mismatches <= 5) {
      ADD_FAILURE() << "e4m3 of " << values[i] << ": " << int{codes[i]} << " vs " << int{EncodeE4M3Reference(values[i])};
    }
  }
  EXPECT_EQ(mismatches, 0) << "of " << values.size();
}

TEST(QuantizeTest, Int8IsSymmetricPerOutputChannel) {
  const at::Tensor w = at::tensor({1.0f, -0.5f, 0.25f, 0.0f, 0.0f, 0.0f, -2.0f, 1.0f, 0.0f}).view({3, 3});
  const QuantizedTensor q = Quantize(w, CompressFormat::kInt8);
  EXPECT_EQ(q.q.scalar_type(), at::kChar);
  EXPECT_TRUE(at::allclose(q.scale, at::tensor({1.0f / 127, 1.0f, 2.0f / 127})));  // A zero row: 1.
  EXPECT_TRUE(at::equal(q.q[0], at::tensor({127, -64, 32}, at::kChar)));  // -63.5 → -64, 31.75 → 32.
  EXPECT_TRUE(at::equal(q.q[1], at::zeros({3}, at::kChar)));
  EXPECT_TRUE(at::equal(q.q[2], at::tensor({-127, 64, 0}, at::kChar)));  // 63.5 → 64 (even).
}

TEST(QuantizeTest, GroupedFormatsScaleEachGroupAndPackNibbles) {
  // K = 256: int4 groups of 16, grouped int8 groups of 128; K = 36: one group (no size divides it).
  EXPECT_EQ(GroupSize(CompressFormat::kInt4, 256), 16);
  EXPECT_EQ(GroupSize(CompressFormat::kInt8Grouped, 256), 128);
  EXPECT_EQ(GroupSize(CompressFormat::kInt4, 48), 16);
  EXPECT_EQ(GroupSize(CompressFormat::kInt8Grouped, 36), 36);
  EXPECT_FALSE(IsCompressible(CompressFormat::kInt4, at::kFloat, {4, 7}));  // An odd K cannot pack.
  EXPECT_TRUE(IsCompressible(CompressFormat::kInt8Grouped, at::kFloat, {4, 7}));
  // Two values a byte, the even index in the low nibble, q + 8; the scales: each row's fp32 scale
  // (max / (7 · 448); a zero row 1) then an e4m3 code a group (a group of zeros code 0). The clipping
  // search keeps max/7 here (a smaller scale would cost the two ±7 more than it saves): code 448
  // (0x7E), and 448 · (7 / 3136) is exactly 1.
  at::Tensor w = at::zeros({2, 64});
  w[0][0] = 7.0f;   // Scale 1: q = 7 → nibble 15.
  w[0][1] = -7.0f;  // q = -7 → nibble 1.
  w[0][2] = 2.4f;   // q = 2 → 10.
  const QuantizedTensor q = Quantize(w, CompressFormat::kInt4);
  EXPECT_EQ(q.q.sizes(), (at::IntArrayRef{2, 32}));
  EXPECT_EQ(q.q[0][0].item<uint8_t>(), 15 | (1 << 4));
  EXPECT_EQ(q.q[0][1].item<uint8_t>(), 10 | (8 << 4));
  EXPECT_EQ(q.q[1][0].item<uint8_t>(), 8 | (8 << 4));
  ASSERT_EQ(q.scale.scalar_type(), at::kByte);
  ASSERT_EQ(q.scale.numel(), 2 * 4 + 2 * 4);
  const at::Tensor rows = q.scale.narrow(0, 0, 8).view(at::kFloat);
  EXPECT_EQ(rows[0].item<float>(), 7.0f / 3136.0f);
  EXPECT_EQ(rows[1].item<float>(), 1.0f);
  EXPECT_TRUE(at::equal(q.scale.narrow(0, 8, 8), at::tensor({0x7E, 0, 0, 0, 0, 0, 0, 0}, at::kByte)));
  EXPECT_TRUE(at::equal(Int4GroupScales(q, 2).select(0, 0), at::tensor({1.0f, 0.0f, 0.0f, 0.0f})));
  EXPECT_TRUE(at::equal(Dequantize(q, CompressFormat::kInt4, at::kFloat).narrow(1, 0, 3),
                        at::tensor({7.0f, -7.0f, 2.0f, 0.0f, 0.0f, 0.0f}).view({2, 3})));
  const QuantLayout layout = LayoutOf(CompressFormat::kInt4, {2, 64});
  EXPECT_EQ(layout.q_bytes, 64);
  EXPECT_EQ(layout.scale_count, 16);
  EXPECT_EQ(layout.scale_dtype, at::kByte);
  EXPECT_EQ(layout.scale_bytes(), 16);
  // 4.5 bits a value at groups of 16: 0.28125 of bf16's bytes, plus 4 bytes a row.
  const QuantLayout big = LayoutOf(CompressFormat::kInt4, {3072, 12288});
  EXPECT_EQ(big.q_bytes + big.scale_bytes(), 3072 * 12288 * 9 / 16 + 3072 * 4);
  // The clipping search: a group with one large value among small ones clips it.
  at::manual_seed(3);
  at::Tensor spiky = at::randn({16, 16}) * 0.1;
  spiky.select(1, 0).fill_(1.0);
  const QuantizedTensor s = Quantize(spiky, CompressFormat::kInt4);
  EXPECT_TRUE((Int4GroupScales(s, 16).squeeze(1) < 0.99 / 7).any().item<bool>());
  // A group far under its row's largest is still scaled (e4m3's range under the row scale), and a
  // zero group amid others reconstructs zeros.
  at::Tensor ranged = at::zeros({1, 48});
  ranged.narrow(1, 0, 16).copy_(at::linspace(-1.0, 1.0, 16));
  ranged.narrow(1, 16, 16).copy_(at::linspace(-1e-3, 1e-3, 16));
  const at::Tensor ranged_back = Dequantize(Quantize(ranged, CompressFormat::kInt4), CompressFormat::kInt4, at::kFloat);
  EXPECT_LT(RelL2(ranged_back.narrow(1, 16, 16), ranged.narrow(1, 16, 16)), 0.1);
  EXPECT_TRUE(at::equal(ranged_back.narrow(1, 32, 16), at::zeros({1, 16})));
  // An outlier column (as activations' outlier features make in trained weights): one scale per
  // channel is set by it for the whole row; one per group only for its group.
  at::manual_seed(5);
  at::Tensor outliers = at::randn({64, 512}) * 0.02;
  outliers.select(1, 7).fill_(1.0);
  // The error of the columns outside the outlier's group.
  auto error = [&](CompressFormat f) {
    const at::Tensor back = Dequantize(Quantize(outliers, f), f, at::kFloat);
    return RelL2(back.narrow(1, 128, 384), outliers.narrow(1, 128, 384));
  };
  EXPECT_LT(error(CompressFormat::kInt8Grouped), 0.2 * error(CompressFormat::kInt8));
}

// Relative L2 bound of one dequantized Gaussian weight, per format (measured: int8 0.007,
// grouped int8 0.0065, fp8 0.026, int4 0.083).
double WeightTolerance(CompressFormat format) {
  switch (format) {
    case CompressFormat::kInt8: return 1e-2;
    case CompressFormat::kInt8Grouped: return 8e-3;
    case CompressFormat::kInt4: return 0.12;
    default: return 5e-2;
  }
}

std::string FormatLabel(const ::testing::TestParamInfo<CompressFormat>& info) {
  switch (info.param) {
    case CompressFormat::kInt8: return "Int8";
    case CompressFormat::kFp8E4M3: return "Fp8";
    case CompressFormat::kInt8Grouped: return "Int8Grouped";
    case CompressFormat::kInt4: return "Int4";
    default: return "None";
  }
}

class FormatTest : public ::testing::TestWithParam<CompressFormat> {};

TEST_P(FormatTest, DequantizedGaussianWeightsAreClose) {
  const CompressFormat format = GetParam();
  at::manual_seed(7);
  const at::Tensor w = at::randn({256, 384}) * 0.02;
  const double error = RelL2(Dequantize(Quantize(w, format), format, at::kFloat, w.sizes()), w);
  std::printf("%s Gaussian weight relative L2: %.4f\n", CompressFormatName(format), error);
  EXPECT_LT(error, WeightTolerance(format));
  EXPECT_GT(error, 0.0);
  // A 4-D convolution weight: per output channel (or group) over everything else.
  const at::Tensor conv = at::randn({8, 4, 3, 3});
  EXPECT_LT(RelL2(Dequantize(Quantize(conv, format), format, at::kFloat, conv.sizes()), conv),
            WeightTolerance(format) + 0.03);
}

// The widening ops give the host reference bit for bit, in fp32 and bf16, with the fp8 table path
// split into several index chunks.
TEST_P(FormatTest, WideningMatchesTheReferenceExactly) {
  const CompressFormat format = GetParam();
  at::manual_seed(11);
  for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    const at::Tensor w = (at::randn({33, 70}) * 3).to(dtype);
    const QuantizedTensor q = Quantize(w, format);
    WidenScratch scratch;
    scratch.table_f32 = Fp8E4M3Table(at::kFloat);
    scratch.table_bf16 = Fp8E4M3Table(at::kBFloat16);
    scratch.table_f16 = Fp8E4M3Table(at::kHalf);
    scratch.index = at::empty({1000}, at::kInt);  // 33 * 70 = 2310 elements: three chunks.
    scratch.nibbles = at::empty({33 * 70 / 2}, at::kByte);
    at::Tensor out = at::full({33, 70}, 7.0, at::TensorOptions().dtype(dtype));
    WidenInto(out, q.q, q.scale, format, scratch);
    EXPECT_TRUE(at::equal(out, Dequantize(q, format, dtype, out.sizes()))) << c10::toString(dtype);
    // Several groups a row (K = 256: int4 16 of 16, grouped int8 2 of 128).
    const at::Tensor wide = (at::randn({9, 256}) * 0.1).to(dtype);
    const QuantizedTensor qw = Quantize(wide, format);
    at::Tensor out_wide = at::full({9, 256}, 7.0, at::TensorOptions().dtype(dtype));
    scratch.nibbles = at::empty({9 * 128}, at::kByte);
    WidenInto(out_wide, qw.q, qw.scale, format, scratch);
    EXPECT_TRUE(at::equal(out_wide, Dequantize(qw, format, dtype, out_wide.sizes()))) << c10::toString(dtype);
    // A narrow K (int4: one group of 6 a row) with the smallest nibble buffer: int4 decodes the
    // scales of 52 rows at a time (8 bytes a row in 420), three chunks.
    const at::Tensor narrow = (at::randn({140, 6}) * 0.1).to(dtype);
    const QuantizedTensor qn = Quantize(narrow, format);
    at::Tensor out_narrow = at::full({140, 6}, 7.0, at::TensorOptions().dtype(dtype));
    scratch.nibbles = at::empty({140 * 6 / 2}, at::kByte);
    WidenInto(out_narrow, qn.q, qn.scale, format, scratch);
    EXPECT_TRUE(at::equal(out_narrow, Dequantize(qn, format, dtype, out_narrow.sizes()))) << c10::toString(dtype);
  }
}

// What LoadQuantizer writes: a tensor's rows quantized in chunks, placed into destination bytes in
// the whole tensor's layout (kInt4: every row's scale first, then every row's codes) and nothing
// outside them — on the host path and on the device path (staging halves, copies, events) taken on
// the CPU. The 8-bit formats give the whole tensor's Quantize() bit for bit; int4 its row scales
// exactly and its codes but for near-ties of the clipping search (summed in another order).
TEST_P(FormatTest, TheLoadQuantizerWritesTheWholeTensorsLayoutChunkByChunk) {
  const CompressFormat format = GetParam();
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  at::manual_seed(29);
  for (const std::vector<int64_t>& sizes :
       std::vector<std::vector<int64_t>>{{33, 70}, {9, 256}, {140, 6}, {12, 4, 2, 3}}) {
    const at::Tensor w = (at::randn(sizes) * 0.05).to(at::kBFloat16);
    const QuantizedTensor whole = Quantize(w, format);
    const QuantLayout layout = LayoutOf(format, w.sizes());
    for (const bool staged : {false, true}) {
      for (const int64_t chunk : {int64_t{5}, int64_t{4 * 70}, int64_t{1} << 20}) {
        SCOPED_TRACE(absl::StrCat(staged ? "staged" : "host", ", chunks of ", chunk, " values, ", w.sizes()[0]));
        auto quantizer = LoadQuantizer::Create(*backend, w.numel(), /*copy_threads=*/3, chunk, staged);
        ASSERT_TRUE(quantizer.ok()) << quantizer.status();
        // The destinations lie inside larger buffers whose other bytes must stay as they were.
        const at::Tensor q_buffer = at::full({layout.q_bytes + 64}, 0xA5, at::TensorOptions().dtype(at::kByte));
        const at::Tensor s_buffer = at::full({layout.scale_bytes() + 64}, 0x5A, at::TensorOptions().dtype(at::kByte));
        // The staged path is the device path taken on the CPU: it says it did not run on the host,
        // unless a row outgrows a staging half.
        const int64_t row_bytes = 2 * (w.numel() / w.size(0));
        const bool row_fits = row_bytes <= (*quantizer)->staging_half_bytes();
        EXPECT_EQ((*quantizer)->staging_half_bytes() > 0, staged);
        EXPECT_EQ((*quantizer)->QuantizeInto(w, format, q_buffer.narrow(0, 32, layout.q_bytes),
                                             s_buffer.narrow(0, 32, layout.scale_bytes())),
                  !(staged && row_fits));
        (*quantizer)->Finish();
        EXPECT_EQ((*quantizer)->host_fallbacks(), 0);
        for (const at::Tensor& buffer : {q_buffer, s_buffer}) {
          const int64_t n = buffer.numel();
          EXPECT_TRUE(at::equal(buffer.narrow(0, 0, 32), at::full({32}, buffer[0].item<uint8_t>(), buffer.options())));
          EXPECT_TRUE(at::equal(buffer.narrow(0, n - 32, 32), at::full({32}, buffer[0].item<uint8_t>(), buffer.options())));
        }
        const at::Tensor q = q_buffer.narrow(0, 32, layout.q_bytes);
        const at::Tensor scale = s_buffer.narrow(0, 32, layout.scale_bytes());
        const at::Tensor want_q = at::from_blob(whole.q.data_ptr(), {layout.q_bytes}, q.options());
        const at::Tensor want_scale = at::from_blob(whole.scale.data_ptr(), {layout.scale_bytes()}, q.options());
        if (format != CompressFormat::kInt4) {
          EXPECT_TRUE(at::equal(q, want_q));
          EXPECT_TRUE(at::equal(scale, want_scale));
          continue;
        }
        const int64_t rows = 4 * sizes[0];
        EXPECT_TRUE(at::equal(scale.narrow(0, 0, rows), want_scale.narrow(0, 0, rows)));
        const auto same = [](const at::Tensor& a, const at::Tensor& b) {
          return a.eq(b).to(at::kDouble).mean().item<double>();
        };
        EXPECT_GT(same(scale.narrow(0, rows, scale.numel() - rows), want_scale.narrow(0, rows, scale.numel() - rows)),
                  0.99);
        EXPECT_GT(same(q, want_q), 0.99);
      }
    }
  }
}

TEST(LoadQuantizerTest, RefusesBadSettings) {
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  EXPECT_EQ(LoadQuantizer::Create(*backend, 100, /*copy_threads=*/0).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadQuantizer::Create(*backend, 100, 2, /*chunk_elements=*/0).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A source in a safetensors mapping leaves the RSS chunk by chunk as the quantizer reads it (on the
// host path and on the staged device path): the pages of every chunk but the partial ones at chunk
// edges are released, and the bytes written are those of the same tensor quantized from the heap.
TEST(LoadQuantizerTest, ASourceInAMappingIsReleasedChunkByChunk) {
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  at::manual_seed(31);
  const at::Tensor w = (at::randn({256, 4096}) * 0.05).to(at::kBFloat16);  // 2 MiB, 8 KiB a row.
  const std::string path = std::string(::testing::TempDir()) + "/load_quantizer_source.safetensors";
  ASSERT_TRUE(WriteSafetensors(path, {{"w", w}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  auto mapped = (*file)->Get("w");
  ASSERT_TRUE(mapped.ok()) << mapped.status();
  ASSERT_TRUE(at::equal(*mapped, w));
  const CompressFormat format = CompressFormat::kInt8Grouped;
  const QuantLayout layout = LayoutOf(format, w.sizes());
  for (const bool staged : {false, true}) {
    SCOPED_TRACE(staged ? "staged" : "host");
    const int64_t chunk = 32 * 4096;  // 32 rows: 256 KiB of source a chunk, 8 chunks.
    auto from_mapping = LoadQuantizer::Create(*backend, w.numel(), /*copy_threads=*/2, chunk, staged);
    auto from_heap = LoadQuantizer::Create(*backend, w.numel(), /*copy_threads=*/2, chunk, staged);
    ASSERT_TRUE(from_mapping.ok() && from_heap.ok());
    const at::Tensor q = at::empty({layout.q_bytes}, at::kByte), s = at::empty({layout.scale_bytes()}, at::kByte);
    const at::Tensor q_heap = at::empty_like(q), s_heap = at::empty_like(s);
    (*from_mapping)->QuantizeInto(*mapped, format, q, s);
    (*from_mapping)->Finish();
    (*from_heap)->QuantizeInto(w, format, q_heap, s_heap);
    (*from_heap)->Finish();
    EXPECT_TRUE(at::equal(q, q_heap));
    EXPECT_TRUE(at::equal(s, s_heap));
    EXPECT_EQ((*from_heap)->released_bytes(), 0);  // Heap memory is never released.
    const int64_t page = ::sysconf(_SC_PAGESIZE);
    EXPECT_GE((*from_mapping)->released_bytes(), static_cast<int64_t>(w.nbytes()) - 8 * page);
    EXPECT_LE((*from_mapping)->released_bytes(), static_cast<int64_t>(w.nbytes()));
    EXPECT_TRUE(at::equal(*mapped, w));  // Released pages read back from the file.
  }
}

// The same widening ops on a GPU (where the copy stream runs them: CUDA kernels, fp8 through the
// native float8 dtype when torch has one) against the host reference, bit for bit. Skipped without
// CUDA (CI's LibTorch); the GPU host's ctest runs it.
TEST_P(FormatTest, WideningOnCudaMatchesTheHostReferenceExactly) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  const CompressFormat format = GetParam();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(13);
  // Both thread layouts of the kernels (widen_kernels.h Layout); the default restored after.
  const std::string default_layout = WideningLayoutName();
  for (const char* layout : {"coalesced", "strided"}) {
    ASSERT_TRUE(SetWideningLayout(layout));
    for (at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
      // Every kernel path: the scalar one ({33, 70}), 16 bytes of codes a thread ({64, 256}, {8, 4, 3, 4}),
      // eight values a thread where the total allows no more ({3, 48} for int4, {5, 24} for the 8-bit
      // formats) and a group size that is no power of two ({5, 24}: K = 24); coalesced tiles that end
      // inside the weight ({999, 264}, {1000, 272}: many tiles, the last partial; {7, 8}: one lane's
      // chunk of a tile).
      for (const std::vector<int64_t>& sizes : std::vector<std::vector<int64_t>>{
               {33, 70}, {64, 256}, {8, 4, 3, 4}, {3, 48}, {5, 24}, {140, 6}, {999, 264}, {1000, 272}, {7, 8}}) {
        const at::Tensor w = (at::randn(sizes) * 0.1).to(dtype);
        const QuantizedTensor q = Quantize(w, format);
        WidenScratch scratch;
        scratch.table_f32 = Fp8E4M3Table(at::kFloat).to(cuda);
        scratch.table_bf16 = Fp8E4M3Table(at::kBFloat16).to(cuda);
        scratch.table_f16 = Fp8E4M3Table(at::kHalf).to(cuda);
        scratch.index = at::empty({1000}, at::TensorOptions().dtype(at::kInt).device(cuda));
        scratch.nibbles = at::empty({w.numel() / 2}, at::TensorOptions().dtype(at::kByte).device(cuda));
        at::Tensor out = at::full(sizes, 7.0, at::TensorOptions().dtype(dtype).device(cuda));
        WidenInto(out, q.q.to(cuda), q.scale.to(cuda), format, scratch);
        EXPECT_TRUE(at::equal(out.cpu(), Dequantize(q, format, dtype, w.sizes())))
            << layout << " " << c10::toString(dtype) << " " << w.sizes();
      }
    }
  }
  SetWideningLayout(default_layout);
}

// The widening kernel's scalar path (an output that is not 16-byte aligned) gives the same bits.
TEST_P(FormatTest, WideningOnCudaIntoAnUnalignedOutputMatchesToo) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  const CompressFormat format = GetParam();
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(17);
  const at::Tensor w = (at::randn({64, 256}) * 0.1).to(at::kBFloat16);
  const QuantizedTensor q = Quantize(w, format);
  const at::Tensor buffer = at::zeros({64 * 256 + 1}, at::TensorOptions().dtype(at::kBFloat16).device(cuda));
  const at::Tensor out = buffer.narrow(0, 1, 64 * 256).view({64, 256});
  WidenInto(out, q.q.to(cuda), q.scale.to(cuda), format, WidenScratch{});
  EXPECT_TRUE(at::equal(out.cpu(), Dequantize(q, format, at::kBFloat16, w.sizes())));
}

// A group's weights widened together (WidenAllInto: on CUDA shared launches of up to 16 weights for
// those the 16-byte path takes, the rest alone) give every weight the bytes it gets alone: 20
// weights (two shared launches), of shapes the wide path takes and shapes it does not, two output
// dtypes in one call. On the CPU (CI) the same call widens one weight at a time.
TEST_P(FormatTest, WideningAGroupTogetherMatchesEachAlone) {
  const CompressFormat format = GetParam();
  const bool cuda = at::hasCUDA();
  const at::Device device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  at::manual_seed(29);
  const std::vector<std::vector<int64_t>> shapes = {{64, 256}, {33, 70}, {3, 48}, {8, 4, 3, 4}, {5, 24}, {16, 512},
                                                     {999, 264}};
  std::vector<at::Tensor> wants;
  std::vector<WidenTarget> targets;
  int64_t largest = 0;
  for (int n = 0; n < 20; ++n) {
    const std::vector<int64_t>& sizes = shapes[static_cast<size_t>(n) % shapes.size()];
    const at::ScalarType dtype = n % 3 == 2 ? at::kHalf : at::kBFloat16;
    const at::Tensor w = (at::randn(sizes) * 0.1).to(dtype);
    largest = std::max<int64_t>(largest, w.numel());
    const QuantizedTensor q = Quantize(w, format);
    wants.push_back(Dequantize(q, format, dtype, w.sizes()));
    targets.push_back({at::full(sizes, 7.0, at::TensorOptions().dtype(dtype).device(device)), q.q.to(device),
                       q.scale.to(device)});
  }
  WidenScratch scratch;
  scratch.table_f32 = Fp8E4M3Table(at::kFloat).to(device);
  scratch.table_bf16 = Fp8E4M3Table(at::kBFloat16).to(device);
  scratch.table_f16 = Fp8E4M3Table(at::kHalf).to(device);
  scratch.index = at::empty({1000}, at::TensorOptions().dtype(at::kInt).device(device));
  scratch.nibbles = at::empty({AlignScratch(largest / 2) + 1024}, at::TensorOptions().dtype(at::kByte).device(device));
  // Both thread layouts of CUDA's kernels (one only elsewhere: the name is accepted, nothing changes);
  // the default restored after.
  const std::string default_layout = WideningLayoutName();
  for (const char* layout : {"coalesced", "strided"}) {
    ASSERT_TRUE(SetWideningLayout(layout));
    for (const WidenTarget& target : targets) target.out.fill_(7.0);
    WidenAllInto(targets, format, scratch);
    for (size_t n = 0; n < targets.size(); ++n) {
      EXPECT_TRUE(at::equal(targets[n].out.cpu(), wants[n]))
          << layout << " weight " << n << " " << targets[n].out.sizes() << " "
          << c10::toString(targets[n].out.scalar_type());
    }
  }
  SetWideningLayout(default_layout);
  EXPECT_EQ(WideningLayoutName(), default_layout);
  EXPECT_FALSE(SetWideningLayout("diagonal"));
}

// Quantizing on the GPU at load (LoadQuantizer: rows in chunks through pinned staging, written
// straight into pinned destinations) gives the host's bits for the 8-bit formats; int4's clipping
// search may break a near-tie the other way. A device that refuses (a budget too small for a chunk)
// leaves the tensor to the host, whose bytes are Quantize()'s exactly.
TEST_P(FormatTest, QuantizingOnCudaMatchesTheHost) {
  auto made = CreateCudaBackend(0);
  if (!made.ok()) GTEST_SKIP() << "needs a GPU: " << made.status();
  DeviceBackend& backend = **made;
  const CompressFormat format = GetParam();
  at::manual_seed(19);
  // 4100 x 4096: more than one chunk of kQuantizeChunkElements values, so both staging halves.
  for (const std::vector<int64_t>& sizes : std::vector<std::vector<int64_t>>{{33, 70}, {4100, 4096}}) {
    const at::Tensor w = (at::randn(sizes) * 0.05).to(at::kBFloat16);
    const QuantizedTensor host = Quantize(w, format);
    const QuantLayout layout = LayoutOf(format, w.sizes());
    auto quantizer = LoadQuantizer::Create(backend, w.numel(), /*copy_threads=*/4);
    ASSERT_TRUE(quantizer.ok()) << quantizer.status();
    auto q_pinned = backend.AllocatePinnedHost(layout.q_bytes);
    auto s_pinned = backend.AllocatePinnedHost(layout.scale_bytes());
    ASSERT_TRUE(q_pinned.ok() && s_pinned.ok());
    EXPECT_FALSE((*quantizer)->QuantizeInto(w, format, *q_pinned, *s_pinned));  // On the device.
    (*quantizer)->Finish();
    EXPECT_EQ((*quantizer)->host_fallbacks(), 0);
    const at::Tensor want_q = at::from_blob(host.q.data_ptr(), {layout.q_bytes}, q_pinned->options());
    const at::Tensor want_scale = at::from_blob(host.scale.data_ptr(), {layout.scale_bytes()}, q_pinned->options());
    if (format != CompressFormat::kInt4) {
      EXPECT_TRUE(at::equal(*q_pinned, want_q)) << w.sizes();
      EXPECT_TRUE(at::equal(*s_pinned, want_scale)) << w.sizes();
    } else {
      const int64_t rows = 4 * sizes[0];
      EXPECT_TRUE(at::equal(s_pinned->narrow(0, 0, rows), want_scale.narrow(0, 0, rows))) << w.sizes();
      const double same = s_pinned->eq(want_scale).to(at::kDouble).mean().item<double>();
      EXPECT_GT(same, 0.999) << w.sizes();
      const QuantizedTensor device{q_pinned->view(host.q.sizes()), *s_pinned};
      EXPECT_NEAR(RelL2(Dequantize(device, format, at::kFloat), w.to(at::kFloat).view({sizes[0], -1})),
                  RelL2(Dequantize(host, format, at::kFloat), w.to(at::kFloat).view({sizes[0], -1})), 1e-4);
    }
  }
  {  // Refused: a budget that holds the context and a few MB, far under a chunk's temporaries.
    const at::Tensor w = (at::randn({4100, 4096}) * 0.05).to(at::kBFloat16);
    const QuantizedTensor host = Quantize(w, format);
    const QuantLayout layout = LayoutOf(format, w.sizes());
    backend.ReleaseCachedMemory();
    ASSERT_TRUE(backend.SetMemoryBudget(backend.GetMemoryStats().context_bytes +
                                        backend.GetMemoryStats().allocated_bytes + (int64_t{4} << 20)).ok());
    auto quantizer = LoadQuantizer::Create(backend, w.numel(), /*copy_threads=*/2);
    ASSERT_TRUE(quantizer.ok()) << quantizer.status();
    const at::Tensor q = at::empty({layout.q_bytes}, at::TensorOptions().dtype(at::kByte));
    const at::Tensor scale = at::empty({layout.scale_bytes()}, at::TensorOptions().dtype(at::kByte));
    EXPECT_TRUE((*quantizer)->QuantizeInto(w, format, q, scale));  // The fallback ran on the host.
    (*quantizer)->Finish();
    ASSERT_TRUE(backend.SetMemoryBudget(0).ok());
    EXPECT_EQ((*quantizer)->host_fallbacks(), 1);
    EXPECT_TRUE(at::equal(q, at::from_blob(host.q.data_ptr(), {layout.q_bytes}, q.options())));
    EXPECT_TRUE(at::equal(scale, at::from_blob(host.scale.data_ptr(), {layout.scale_bytes()}, q.options())));
  }
  if (format == CompressFormat::kFp8E4M3) {  // Every code, halfway cases, saturation, NaN.
    const at::Tensor table = Fp8E4M3Table(at::kFloat);
    const at::Tensor x = at::cat({table, table * 1.03125, table * 0.96875, at::tensor({1000.0f, -1000.0f, 0.0f, -0.0f})});
    EXPECT_TRUE(at::equal(EncodeFp8E4M3(x.to(at::Device(at::kCUDA, 0))).cpu(), EncodeFp8E4M3(x)));
  }
}

// Quantizing to int4 on the GPU queues its work and returns without waiting for the device, so the
// load quantizer's copy threads read the next chunk while the device quantizes this one. Until
// session 46 each of the clipping search's six candidates copied the e4m3 table to the device, a
// blocking copy that waited for everything queued before it (this test then saw the event complete).
TEST(QuantizeTest, Int4OnCudaQueuesWithoutWaitingForTheDevice) {
  auto made = CreateCudaBackend(0);
  if (!made.ok()) GTEST_SKIP() << "needs a GPU: " << made.status();
  DeviceBackend& backend = **made;
  c10::InferenceMode guard;
  const at::Device cuda(at::kCUDA, 0);
  at::manual_seed(23);
  const at::Tensor w = (at::randn({256, 1024}) * 0.05).to(at::kBFloat16).to(cuda);
  const QuantizedTensor first = Quantize(w, CompressFormat::kInt4);  // A device's first call makes its table.
  backend.Synchronize();
  const char* launch_blocking = std::getenv("CUDA_LAUNCH_BLOCKING");
  if (launch_blocking != nullptr && std::string(launch_blocking) == "1") GTEST_SKIP() << "every launch waits";
#ifdef STOWAGE_WITH_CUDA
  // About a second of a kernel that spins on the clock (whatever the GPU's throughput), then the
  // quantization, on the same (this thread's current) stream.
  at::cuda::sleep(int64_t{2} << 30);
#else
  GTEST_SKIP() << "built without CUDA";
#endif
  const std::unique_ptr<DeviceEvent> queued = backend.RecordOnComputeStream();
  const QuantizedTensor again = Quantize(w, CompressFormat::kInt4);
  EXPECT_FALSE(queued->Query()) << "the int4 quantization waited for the device's queued work";
  backend.Synchronize();
  EXPECT_TRUE(at::equal(again.q.cpu(), first.q.cpu()));
  EXPECT_TRUE(at::equal(again.scale.cpu(), first.scale.cpu()));
}

INSTANTIATE_TEST_SUITE_P(Formats, FormatTest,
                         ::testing::Values(CompressFormat::kInt8, CompressFormat::kFp8E4M3,
                                           CompressFormat::kInt8Grouped, CompressFormat::kInt4),
                         FormatLabel);

#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
// FP8 compute weights: int4 is their one compression (the others are no smaller than e4m3); on
// CUDA their int4 copy widens back into e4m3 bytes equal to the host reference (the float32 product
// rounded once to e4m3), through the vector and the scalar kernel paths; elsewhere widening into
// float8 is refused (FP8 compute runs on CUDA only).
TEST(Int4OfFp8Test, WidensBackIntoFloat8BytesOnCudaOnly) {
  at::manual_seed(23);
  const std::vector<int64_t> sizes = {64, 256};
  const at::Tensor w = (at::randn(sizes) * 60).to(at::kFloat8_e4m3fn);
  EXPECT_TRUE(IsCompressible(CompressFormat::kInt4, w.scalar_type(), w.sizes()));
  for (CompressFormat f : {CompressFormat::kInt8, CompressFormat::kFp8E4M3, CompressFormat::kInt8Grouped}) {
    EXPECT_FALSE(IsCompressible(f, w.scalar_type(), w.sizes())) << CompressFormatName(f);
  }
  const QuantizedTensor q = Quantize(w, CompressFormat::kInt4);
  const at::Tensor want = Dequantize(q, CompressFormat::kInt4, at::kFloat8_e4m3fn, w.sizes());
  ASSERT_EQ(want.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_LT(RelL2(want.to(at::kFloat), w.to(at::kFloat)), 0.15);
  at::Tensor on_host = at::empty(sizes, at::TensorOptions().dtype(at::kFloat8_e4m3fn));
  WidenScratch host_scratch;
  host_scratch.nibbles = at::empty({w.numel() / 2}, at::TensorOptions().dtype(at::kByte));
  EXPECT_THROW(WidenInto(on_host, q.q, q.scale, CompressFormat::kInt4, host_scratch), c10::Error);
  if (!at::hasCUDA()) GTEST_SKIP() << "widening into float8 needs a GPU";
  const at::Device cuda(at::kCUDA, 0);
  const at::Tensor buffer = at::full({w.numel() + 16}, 0x55, at::TensorOptions().dtype(at::kByte).device(cuda));
  // 16-byte aligned: 32 values a thread; 8 bytes off: the scalar path (the vector paths store 16 bytes
  // of bf16 or 8 of e4m3 and want 16-byte alignment); one byte off: the scalar path.
  for (const int64_t offset : {0, 16, 8, 1}) {
    const at::Tensor out = buffer.narrow(0, offset, w.numel()).view(at::kFloat8_e4m3fn).view(sizes);
    buffer.fill_(0x55);
    WidenInto(out, q.q.to(cuda), q.scale.to(cuda), CompressFormat::kInt4, WidenScratch{});
    EXPECT_TRUE(at::equal(out.cpu().view(at::kByte), want.view(at::kByte))) << "offset " << offset;
    const at::Tensor outside = at::cat({buffer.narrow(0, 0, offset), buffer.narrow(0, offset + w.numel(), 16 - offset)});
    EXPECT_TRUE(outside.eq(0x55).all().item<bool>()) << "offset " << offset << ": written outside the output";
  }
  // Z-Image's hidden width (3840 values a row: 240 groups, no power of two, so the kernels find a
  // group's row by RowMagic's multiply); 3 x 48: a total of 144 values, not a multiple of 32, eight
  // values a thread.
  for (const std::vector<int64_t>& shape : std::vector<std::vector<int64_t>>{{40, 3840}, {3, 48}}) {
    const at::Tensor weight = (at::randn(shape) * 60).to(at::kFloat8_e4m3fn);
    const QuantizedTensor quantized = Quantize(weight, CompressFormat::kInt4);
    const at::Tensor widened = at::empty(shape, at::TensorOptions().dtype(at::kFloat8_e4m3fn).device(cuda));
    WidenInto(widened, quantized.q.to(cuda), quantized.scale.to(cuda), CompressFormat::kInt4, WidenScratch{});
    const at::Tensor want = Dequantize(quantized, CompressFormat::kInt4, at::kFloat8_e4m3fn, weight.sizes());
    EXPECT_TRUE(at::equal(widened.cpu().view(at::kByte), want.view(at::kByte))) << weight.sizes();
  }
}
#endif

// The widening kernels find an int4 group's row as the high 64 bits of RowMagic(d) * g instead of
// dividing g by the groups a row d: equal to g / d for every g < 2^32, checked here (with the
// compiler's 128-bit product, the value of CUDA's __umul64hi) at the edges — 0, d - 1, d, d + 1,
// each multiple of d nearest 2^32 and 2^32 - 1 — of divisors from 2 to 2^32 - 1 (small ones, powers
// of two and their neighbours, the real weights' 240 and 640, pseudo-random ones) and at
// pseudo-random indices; divisors outside 2..2^32 - 1 get no magic (the kernels divide).
TEST(WidenKernelsTest, RowMagicDividesEvery32BitIndex) {
  EXPECT_EQ(widen_cuda::RowMagic(1), 0u);
  EXPECT_EQ(widen_cuda::RowMagic(0), 0u);
  EXPECT_EQ(widen_cuda::RowMagic(int64_t{1} << 32), 0u);
  std::vector<uint64_t> divisors;
  for (uint64_t d = 2; d <= 4096; ++d) divisors.push_back(d);
  for (int b = 12; b < 32; ++b) {
    for (int64_t delta : {-1, 0, 1}) divisors.push_back((uint64_t{1} << b) + static_cast<uint64_t>(delta));
  }
  divisors.push_back(0xFFFFFFFFull);
  uint64_t state = 0x9E3779B97F4A7C15ull;
  auto next = [&state] {  // splitmix64
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  };
  for (int n = 0; n < 2000; ++n) divisors.push_back(2 + next() % 0xFFFFFFFDull);
  int64_t checked = 0;
  for (const uint64_t d : divisors) {
    const uint64_t magic = widen_cuda::RowMagic(static_cast<int64_t>(d));
    ASSERT_NE(magic, 0u) << d;
    auto quotient = [magic](uint64_t g) {
      return static_cast<uint64_t>((static_cast<unsigned __int128>(magic) * g) >> 64);
    };
    const uint64_t last_multiple = 0xFFFFFFFFull / d * d;
    std::vector<uint64_t> indices = {0, d - 1, d, d + 1, last_multiple - 1, last_multiple, 0xFFFFFFFFull};
    for (int n = 0; n < 64; ++n) indices.push_back(next() & 0xFFFFFFFFull);
    for (const uint64_t g : indices) {
      if (g > 0xFFFFFFFFull) continue;
      ASSERT_EQ(quotient(g), g / d) << g << " / " << d;
      ++checked;
    }
  }
  EXPECT_GT(checked, 400000);
}

TEST(CompressFormatTest, NamesRoundTrip) {
  for (CompressFormat f : {CompressFormat::kNone, CompressFormat::kInt8, CompressFormat::kFp8E4M3,
                           CompressFormat::kInt8Grouped, CompressFormat::kInt4}) {
    EXPECT_EQ(*ParseCompressFormat(CompressFormatName(f)), f);
  }
  EXPECT_FALSE(ParseCompressFormat("fp4").ok());
}

// --- Streaming a model -----------------------------------------------------------------------------

struct StreamRun {
  at::Tensor out;
  int64_t h2d_per_forward = 0;  // Of a steady-state forward (the third).
  int64_t peak = 0;             // Peak device bytes of that forward.
  GroupOffloadStats stats;
  int64_t device_bytes = 0;
  int64_t needed_after_release = 0;
};

// Streams `model` (its weights in `dtype`) with `options` and runs three forwards.
StreamRun Stream(at::ScalarType dtype, GroupOffloadOptions options, std::shared_ptr<const PrequantizedWeights> given = nullptr,
           const std::function<void(StackModel&)>& prepare = nullptr) {
  StackModel model;
  model.ForEachSlot([&](Module&, TensorSlot& slot) { slot.value = slot.value.to(dtype); });
  if (prepare) prepare(model);
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  options.prequantized = std::move(given);
  auto offloader = GroupOffloader::Apply("stack", model, *weights, *backend, options);
  EXPECT_TRUE(offloader.ok()) << offloader.status();
  if (!offloader.ok()) return {};
  at::manual_seed(3);
  const at::Tensor input = at::randn({3, 5, 16}).to(dtype);
  c10::InferenceMode guard;
  StreamRun run;
  for (int i = 0; i < 3; ++i) {
    backend->Synchronize();
    backend->ResetPeakStats();
    const int64_t h2d = backend->GetMemoryStats().host_to_device_bytes;
    run.out = model.Forward(input);
    backend->Synchronize();
    run.h2d_per_forward = backend->GetMemoryStats().host_to_device_bytes - h2d;
    run.peak = backend->GetMemoryStats().peak_allocated_bytes;
  }
  run.stats = (*offloader)->stats();
  run.device_bytes = (*offloader)->device_bytes();
  (*offloader)->ReleaseSlots();
  run.needed_after_release = (*offloader)->bytes_needed_to_run();
  // After a release the next forward allocates the ring and scratch again and re-initialises it.
  at::Tensor again = model.Forward(input);
  EXPECT_TRUE(at::equal(again, run.out));
  return run;
}

GroupOffloadOptions Streaming(CompressFormat format, int64_t budget = 0) {
  GroupOffloadOptions o;
  o.type = OffloadType::kBlockLevel;
  o.num_blocks_per_group = 1;
  o.use_stream = true;
  o.prefetch_depth = 1;
  o.compress = format;
  o.budget_bytes = budget;
  return o;
}

// The simulated device, or CUDA device 0 (null where this build or host has none).
std::unique_ptr<DeviceBackend> SimulatedOrCuda(bool cuda) {
  if (!cuda) return CreateSimulatedBackend({});
  auto made = CreateCudaBackend(0);
  return made.ok() ? *std::move(made) : nullptr;
}

// The test stack with bfloat16 weights, captured as host copies.
struct Bf16Stack {
  Bf16Stack() {
    model.ForEachSlot([&](Module&, TensorSlot& slot) { slot.value = slot.value.to(at::kBFloat16); });
    weights = *HostWeights::Capture(model);
  }
  StackModel model;
  std::unique_ptr<HostWeights> weights;
};

// Bytes one copy of a tensor moves compressed: its q data and fp32 scales (aligned), or itself.
int64_t CompressedBytes(const at::Tensor& t, CompressFormat format) {
  if (!IsCompressible(format, t.scalar_type(), t.sizes())) return static_cast<int64_t>(t.nbytes());
  const QuantLayout layout = LayoutOf(format, t.sizes());
  return AlignScratch(layout.q_bytes) + AlignScratch(layout.scale_bytes());
}

// Relative L2 error of a whole forward vs the uncompressed one. int8 meets the 3e-2 asked of it;
// fp8 e4m3 (3 mantissa bits: ~2.5 % relative error per weight, 14 layers in a chain) measures 0.043
// on this model, so it is held to its per-weight bound instead (reported, not hidden); int4 (~8 %
// per weight, 0.13-0.14 through the chain) to 0.25 — its fidelity is judged on the trained demo
// pipeline (bench/fidelity_bench.py).
double ForwardTolerance(CompressFormat format) {
  switch (format) {
    case CompressFormat::kInt8:
    case CompressFormat::kInt8Grouped: return 3e-2;
    case CompressFormat::kInt4: return 0.25;
    default: return 5e-2;
  }
}

class CompressedStreamingTest : public ::testing::TestWithParam<CompressFormat> {};

TEST_P(CompressedStreamingTest, Fp32ForwardIsCloseMovesAQuarterAndPeaksAtTheWorkingSet) {
  const CompressFormat format = GetParam();
  const StreamRun exact = Stream(at::kFloat, Streaming(CompressFormat::kNone));
  const StreamRun small = Stream(at::kFloat, Streaming(format));
  ASSERT_TRUE(exact.out.defined() && small.out.defined());
  const double error = RelL2(small.out, exact.out);
  std::printf("%s fp32 forward relative L2 error: %.4f\n", CompressFormatName(format), error);
  EXPECT_LT(error, ForwardTolerance(format));
  EXPECT_GT(error, 0.0);

  // Bytes: every group (6 blocks streamed + the always-on rest) copied once per forward.
  StackModel model;
  int64_t want = 0;
  model.ForEachSlot([&](Module&, TensorSlot& slot) { want += CompressedBytes(slot.value, format); });
  EXPECT_EQ(small.h2d_per_forward, want);
  EXPECT_EQ(small.stats.bytes_per_forward, want);
  EXPECT_EQ(exact.h2d_per_forward, StackModel::kTotalBytes);
  EXPECT_EQ(exact.stats.bytes_per_forward, StackModel::kTotalBytes);
  // Preparing: the pinned allocations and the quantizing are timed; nothing fell back to the host.
  EXPECT_GT(small.stats.prepare_pin_alloc_s, 0.0);
  EXPECT_GT(small.stats.prepare_quantize_s, 0.0);
  EXPECT_EQ(small.stats.host_quantized_fallbacks, 0);
  const double bits = format == CompressFormat::kInt4 ? 4.0 : 8.0;  // fp32 → bits + scales.
  EXPECT_LT(small.h2d_per_forward, StackModel::kTotalBytes * (bits / 32 + 0.06));
  EXPECT_GT(small.h2d_per_forward, StackModel::kTotalBytes * (bits / 32));

  // Device memory: the scratch is in the working set, and the working set is the peak.
  EXPECT_EQ(small.stats.compress, CompressFormatName(format));
  EXPECT_EQ(exact.stats.compress, "none");
  EXPECT_EQ(exact.stats.scratch_bytes, 0);
  EXPECT_GT(small.stats.scratch_bytes, 0);
  EXPECT_EQ(small.stats.working_set_bytes, exact.stats.working_set_bytes + small.stats.scratch_bytes);
  EXPECT_EQ(small.peak, small.stats.working_set_bytes);
  EXPECT_EQ(exact.peak, exact.stats.working_set_bytes);
  EXPECT_EQ(small.device_bytes, small.stats.slots * small.stats.slot_bytes + small.stats.scratch_bytes);
  EXPECT_EQ(small.needed_after_release, small.stats.working_set_bytes);  // Nothing is resident.
  EXPECT_EQ(small.stats.compressed_host_bytes, small.stats.pinned_host_bytes);
  EXPECT_GE(small.stats.compressed_host_bytes, want);
}

TEST_P(CompressedStreamingTest, Bf16MovesAboutHalf) {
  const CompressFormat format = GetParam();
  const StreamRun exact = Stream(at::kBFloat16, Streaming(CompressFormat::kNone));
  const StreamRun small = Stream(at::kBFloat16, Streaming(format));
  ASSERT_TRUE(exact.out.defined() && small.out.defined());
  const double error = RelL2(small.out, exact.out);
  std::printf("%s bf16 forward relative L2 error: %.4f\n", CompressFormatName(format), error);
  EXPECT_LT(error, ForwardTolerance(format));
  int64_t want = 0;
  StackModel model;
  int64_t carried = 0;  // Tensors that stay uncompressed: they cross as one run a group, padding included.
  model.ForEachSlot([&](Module&, TensorSlot& slot) {
    const at::Tensor t = slot.value.to(at::kBFloat16);
    want += CompressedBytes(t, format);
    carried += IsCompressible(format, t.scalar_type(), t.sizes()) ? 0 : 1;
  });
  EXPECT_GE(small.h2d_per_forward, want);
  EXPECT_LT(small.h2d_per_forward, want + carried * kGroupAlign);
  EXPECT_EQ(small.stats.bytes_per_forward, small.h2d_per_forward);
  EXPECT_EQ(exact.h2d_per_forward, exact.stats.bytes_per_forward);
  const double ratio = static_cast<double>(small.h2d_per_forward) / static_cast<double>(exact.h2d_per_forward);
  const double bits = format == CompressFormat::kInt4 ? 4.0 : 8.0;
  EXPECT_GT(ratio, bits / 16);
  EXPECT_LT(ratio, bits / 16 + 0.08);  // Scales (int4: an 8-bit code per 16 values) and alignment.
  EXPECT_EQ(small.peak, small.stats.working_set_bytes);
}

// A backend that passes everything to the simulated one and counts, per stream, the waits on events
// the compute stream recorded (the slots' releases among them), and the copy-stream DMAs whose
// destination lies in a device buffer of `watched_bytes` bytes (the ring's slots).
class WaitCountingBackend final : public DeviceBackend {
 public:
  struct Counts {
    int copy_waits_on_compute = 0;
    int transform_waits_on_compute = 0;
    int copies_into_watched = 0;
    int copies = 0;  // Every host-to-device DMA.
  };
  explicit WaitCountingBackend(std::unique_ptr<DeviceBackend> inner) : inner_(std::move(inner)) {}
  Counts counts() const { return counts_; }
  void ResetCounts() { counts_ = {}; }

  std::string name() const override { return inner_->name(); }
  c10::Device torch_device() const override { return inner_->torch_device(); }
  bool supports_streams() const override { return inner_->supports_streams(); }
  void Watch(int64_t bytes) { watched_bytes_ = bytes; }
  absl::StatusOr<at::Tensor> AllocateBytes(int64_t bytes) override {
    absl::StatusOr<at::Tensor> buffer = inner_->AllocateBytes(bytes);
    if (buffer.ok()) allocations_.emplace_back(static_cast<const char*>(buffer->data_ptr()), bytes);
    return buffer;
  }
  absl::StatusOr<at::Tensor> CopyToDevice(const at::Tensor& host) override { return inner_->CopyToDevice(host); }
  absl::StatusOr<at::Tensor> CopyFromPeer(const at::Tensor& src) override { return inner_->CopyFromPeer(src); }
  void CopyToDeviceAsync(const at::Tensor& dst, const at::Tensor& src) override {
    ++counts_.copies;
    const auto* at = static_cast<const char*>(dst.data_ptr());
    for (const auto& [begin, bytes] : allocations_) {
      counts_.copies_into_watched += bytes == watched_bytes_ && at >= begin && at < begin + bytes;
    }
    inner_->CopyToDeviceAsync(dst, src);
  }
  void EnqueueOnTransformStream(std::function<void()> work) override { inner_->EnqueueOnTransformStream(std::move(work)); }
  std::unique_ptr<DeviceEvent> RecordOnTransformStream() override { return Wrap(inner_->RecordOnTransformStream(), false); }
  std::unique_ptr<DeviceEvent> RecordOnCopyStream() override { return Wrap(inner_->RecordOnCopyStream(), false); }
  std::unique_ptr<DeviceEvent> RecordOnComputeStream() override { return Wrap(inner_->RecordOnComputeStream(), true); }
  void TransformStreamWait(DeviceEvent& event) override {
    counts_.transform_waits_on_compute += Of(event).compute;
    inner_->TransformStreamWait(*Of(event).inner);
  }
  void ComputeStreamWait(DeviceEvent& event) override { inner_->ComputeStreamWait(*Of(event).inner); }
  void CopyStreamWait(DeviceEvent& event) override {
    counts_.copy_waits_on_compute += Of(event).compute;
    inner_->CopyStreamWait(*Of(event).inner);
  }
  void Synchronize() override { inner_->Synchronize(); }
  absl::StatusOr<at::Tensor> AllocatePinnedHost(int64_t bytes) override { return inner_->AllocatePinnedHost(bytes); }
  absl::Status RegisterHostMemory(void* ptr, int64_t bytes, bool read_only) override {
    return inner_->RegisterHostMemory(ptr, bytes, read_only);
  }
  absl::Status UnregisterHostMemory(void* ptr) override { return inner_->UnregisterHostMemory(ptr); }
  bool IsPageLockedHostMemory(const void* ptr) override { return inner_->IsPageLockedHostMemory(ptr); }
  absl::Status SetMemoryBudget(int64_t bytes) override { return inner_->SetMemoryBudget(bytes); }
  int64_t MemoryBudget() const override { return inner_->MemoryBudget(); }
  void ReleaseCachedMemory() override { inner_->ReleaseCachedMemory(); }

 protected:
  DeviceMemoryStats ReadMemoryStats() override { return inner_->GetMemoryStats(); }
  void ResetAllocatorPeaks() override { inner_->ResetPeakStats(); }

 private:
  struct Tagged final : DeviceEvent {
    std::unique_ptr<DeviceEvent> inner;
    bool compute = false;
    bool Query() override { return inner->Query(); }
    void Wait() override { inner->Wait(); }
  };
  static std::unique_ptr<DeviceEvent> Wrap(std::unique_ptr<DeviceEvent> inner, bool compute) {
    auto tagged = std::make_unique<Tagged>();
    tagged->inner = std::move(inner);
    tagged->compute = compute;
    return tagged;
  }
  static Tagged& Of(DeviceEvent& event) { return static_cast<Tagged&>(event); }
  std::unique_ptr<DeviceBackend> inner_;
  Counts counts_;
  int64_t watched_bytes_ = -1;
  std::vector<std::pair<const char*, int64_t>> allocations_;  // Every AllocateBytes (a test's few).
};

// A compressed store writes the slots of groups with compressed weights only on the transform stream:
// in a steady-state forward no copy-stream DMA lands in a slot and the copy stream never waits for the
// compute (its copies land in the scratch while the compute still reads the slot they will be widened
// into); the transform stream waits for each slot's release instead. The pinned store's copy stream
// copies into the slots and waits for the releases itself. (The simulator runs the compute on the
// calling thread, so these are the orders asked for, not races it could show.)
TEST(CompressedStreamingOrderTest, TheLinksCopiesDoNotWaitForTheComputeThatReadsTheSlot) {
  for (const CompressFormat format : {CompressFormat::kNone, CompressFormat::kInt4, CompressFormat::kInt8}) {
    SCOPED_TRACE(CompressFormatName(format));
    Bf16Stack stack;
    WaitCountingBackend backend(CreateSimulatedBackend({}));
    auto applied = GroupOffloader::Apply("stack", stack.model, *stack.weights, backend, Streaming(format));
    ASSERT_TRUE(applied.ok()) << applied.status();
    backend.Watch((*applied)->stats().slot_bytes);
    at::manual_seed(3);
    const at::Tensor input = at::randn({3, 5, 16}).to(at::kBFloat16);
    c10::InferenceMode guard;
    const at::Tensor first = stack.model.Forward(input);
    backend.Synchronize();
    backend.ResetCounts();
    const GroupOffloadStats before = (*applied)->stats();
    const at::Tensor second = stack.model.Forward(input);
    backend.Synchronize();
    EXPECT_TRUE(at::equal(first, second));
    const WaitCountingBackend::Counts counts = backend.counts();
    const GroupOffloadStats stats = (*applied)->stats();
    const int streamed = stats.streamed_groups;
    // Each always-on group (the stack's input and output layers) onloads into a fresh buffer from the
    // compute stream's pool, so its copy waits for the compute queued before: that wait is not a slot's.
    const int always_on = stats.groups - stats.streamed_groups - stats.resident_groups;
    ASSERT_GT(streamed, 2);
    ASSERT_GT(always_on, 0);
    if (format == CompressFormat::kNone) {
      EXPECT_GE(counts.copy_waits_on_compute, always_on + streamed - 2);
      EXPECT_EQ(counts.transform_waits_on_compute, 0);
      EXPECT_GE(counts.copies_into_watched, streamed);
    } else {
      EXPECT_EQ(counts.copy_waits_on_compute, always_on);
      EXPECT_GE(counts.transform_waits_on_compute, streamed - 2);
      EXPECT_EQ(counts.copies_into_watched, 0);
      // A group's uncompressed tensors (a block's two biases and its norm) follow its compressed ones in
      // the slot and cross as one run: two DMAs a group, not one per tensor.
      const int64_t loads = (stats.prefetches - before.prefetches) + (stats.sync_onloads - before.sync_onloads) + always_on;
      EXPECT_GE(loads, streamed);
      EXPECT_EQ(counts.copies, 2 * loads);
    }
  }
}

// With a copy stream the scratch holds two areas for the groups' packed bytes (one group's
// widening on the transform stream overlaps the next group's copy), without one a single area; the
// forward is the same bit for bit either way, and the peak is the working set.
TEST_P(CompressedStreamingTest, TwoScratchAreasWithACopyStreamSameResult) {
  const CompressFormat format = GetParam();
  GroupOffloadOptions serial = Streaming(format);
  serial.use_stream = false;
  const StreamRun overlapped = Stream(at::kBFloat16, Streaming(format));
  const StreamRun one_area = Stream(at::kBFloat16, serial);
  ASSERT_TRUE(overlapped.out.defined() && one_area.out.defined());
  EXPECT_TRUE(at::equal(overlapped.out, one_area.out));
  // The second area holds the largest group's packed buffer: a block's two compressed weights and
  // its other tensors, each aligned (the groups outside the blocks are smaller).
  StackBlock block;
  int64_t area = 0;
  block.ForEachSlot([&](Module&, TensorSlot& slot) {
    const at::Tensor t = slot.value.to(at::kBFloat16);
    area += IsCompressible(format, t.scalar_type(), t.sizes()) ? CompressedBytes(t, format)
                                                                : AlignScratch(static_cast<int64_t>(t.nbytes()));
  });
  ASSERT_GT(area, 0);
  EXPECT_EQ(overlapped.stats.scratch_bytes - one_area.stats.scratch_bytes, area);
  EXPECT_EQ(overlapped.stats.working_set_bytes - one_area.stats.working_set_bytes,
            area + (overlapped.stats.slots - one_area.stats.slots) * overlapped.stats.slot_bytes);
  EXPECT_EQ(overlapped.peak, overlapped.stats.working_set_bytes);
  EXPECT_EQ(one_area.peak, one_area.stats.working_set_bytes);
}

// widen_per_group (a group's weights in shared launches on CUDA) streams the same forward bit for
// bit as a launch per weight: on the simulator and, where this build and host have it, CUDA.
TEST_P(CompressedStreamingTest, WideningAGroupInSharedLaunchesStreamsTheSameForward) {
  const CompressFormat format = GetParam();
  for (const bool cuda : {false, true}) {
    SCOPED_TRACE(cuda ? "cuda" : "simulated");
    std::vector<at::Tensor> outs;
    for (const bool per_group : {false, true}) {
      std::unique_ptr<DeviceBackend> backend = SimulatedOrCuda(cuda);
      if (backend == nullptr) break;  // No CUDA in this build or host.
      Bf16Stack stack;
      GroupOffloadOptions options = Streaming(format);
      options.use_stream = backend->supports_streams();
      options.widen_per_group = per_group;
      auto applied = GroupOffloader::Apply("stack", stack.model, *stack.weights, *backend, options);
      ASSERT_TRUE(applied.ok()) << applied.status();
      at::manual_seed(3);
      const at::Tensor input = at::randn({3, 5, 16}).to(at::kBFloat16).to(backend->torch_device());
      c10::InferenceMode guard;
      outs.push_back(stack.model.Forward(input).cpu());
      backend->Synchronize();
    }
    if (outs.size() == 2) EXPECT_TRUE(at::equal(outs[0], outs[1]));
  }
}

// With a budget, resident groups stay exact and out of the scratch; the planner keeps the scratch
// inside the budget, and the peak is the working set.
TEST_P(CompressedStreamingTest, BudgetCountsTheScratchAndResidentGroupsStayExact) {
  const CompressFormat format = GetParam();
  const int64_t budget = StackModel::kOutsideBytes + 5 * StackModel::kBlockBytes;
  const StreamRun small = Stream(at::kFloat, Streaming(format, budget));
  ASSERT_TRUE(small.out.defined());
  EXPECT_GT(small.stats.resident_groups, 0);
  EXPECT_GT(small.stats.streamed_groups, 0);
  EXPECT_LE(small.stats.working_set_bytes, budget);
  EXPECT_EQ(small.peak, small.stats.working_set_bytes);
  EXPECT_EQ(small.h2d_per_forward, small.stats.bytes_per_forward);
  EXPECT_EQ(small.needed_after_release,
            small.stats.slots * small.stats.slot_bytes + small.stats.scratch_bytes + small.stats.always_on_bytes);
  // Streaming everything needs the scratch on top of the uncompressed working set: a budget of
  // exactly that works, one byte less is refused.
  const StreamRun all = Stream(at::kFloat, Streaming(format));
  const StreamRun exact_budget = Stream(at::kFloat, Streaming(format, all.stats.working_set_bytes));
  EXPECT_EQ(exact_budget.peak, all.stats.working_set_bytes);
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  GroupOffloadOptions tight = Streaming(format, all.stats.working_set_bytes - 1);
  auto refused = GroupOffloader::Apply("stack", model, *weights, *backend, tight);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("scratch"), std::string::npos) << refused.status();
}

TEST_P(CompressedStreamingTest, SlotsHoldTheDequantizedWeightsExactly) {
  const CompressFormat format = GetParam();
  // Leaf level: every linear is its own streamed group; check a block's weights while it runs.
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::vector<std::pair<TensorSlot*, at::Tensor>> expected;
  model.ForEachSlot([&](Module&, TensorSlot& slot) {
    const at::Tensor& w = slot.value;
    expected.emplace_back(&slot, w.dim() >= 2 ? Dequantize(Quantize(w, format), format, w.scalar_type(), w.sizes())
                                              : w.clone());
  });
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  GroupOffloadOptions options = Streaming(format);
  options.type = OffloadType::kLeafLevel;
  auto offloader = GroupOffloader::Apply("stack", model, *weights, *backend, options);
  ASSERT_TRUE(offloader.ok()) << offloader.status();
  // A hook after the engine's sees every tensor of the running module on the device.
  struct Check : ModuleHook {
    std::vector<std::pair<TensorSlot*, at::Tensor>>* expected;
    int checked = 0;
    void PreForward(Module& m) override {
      for (TensorSlot& s : m.slots()) {
        for (auto& [slot, want] : *expected) {
          if (slot != &s) continue;
          EXPECT_TRUE(at::equal(s.value, want)) << m.SlotPath(s);
          ++checked;
        }
      }
    }
  };
  auto check = std::make_shared<Check>();
  check->expected = &expected;
  model.ForEachModule([&](Module& m) {
    if (m.is_leaf()) ASSERT_TRUE(m.AddHook("check", check).ok());
  });
  c10::InferenceMode guard;
  for (int i = 0; i < 2; ++i) (void)model.Forward(at::randn({2, 16}));
  EXPECT_EQ(check->checked, 2 * (static_cast<int>(expected.size()) - 1));  // All but the root's.
}

// The spare-room cache of a compressed component: with an allowance below its streamed groups
// widened but enough for their compressed copies, the cache keeps every streamed group as it
// crossed the link (device copies of the packed buffers) and the next forwards copy nothing of
// them over the link, widening from the copies instead — bit for bit the uncached forward, with
// and without a copy stream; an allowance for everything widened turns the copies into widened
// groups (no copy, no widening); a lower allowance gives copies back at once. On the simulator and,
// where this build and host have it, CUDA (its widening kernels reading a cached copy instead of
// the scratch): every forward equals the first, uncached one bit for bit.
TEST_P(CompressedStreamingTest, TheSpareRoomCacheKeepsGroupsAsTheyCrossTheLinkWhenWidenedTheyDoNotFit) {
  const CompressFormat format = GetParam();
  const std::pair<bool, bool> runs[] = {{false, true}, {false, false}, {true, true}, {true, false}};
  for (const auto& [cuda, stream] : runs) {
    SCOPED_TRACE(absl::StrCat(cuda ? "cuda, " : "simulated, ", stream ? "with a copy stream" : "without"));
    GroupOffloadOptions options = Streaming(format);
    options.use_stream = stream;
    std::unique_ptr<DeviceBackend> backend = SimulatedOrCuda(cuda);
    if (backend == nullptr) continue;  // No CUDA in this build or host.
    Bf16Stack stack;
    StackModel& model = stack.model;
    auto applied = GroupOffloader::Apply("stack", model, *stack.weights, *backend, options);
    ASSERT_TRUE(applied.ok()) << applied.status();
    GroupOffloader& offloader = **applied;
    const GroupOffloadStats planned = offloader.stats();
    at::manual_seed(3);
    const at::Tensor input = at::randn({3, 5, 16}).to(at::kBFloat16).to(backend->torch_device());
    c10::InferenceMode guard;
    const auto h2d = [&] { return backend->GetMemoryStats().host_to_device_bytes; };
    at::Tensor uncached;  // The first forward's output: no cache.
    const auto forward = [&] {
      const int64_t before = h2d();
      at::Tensor out = model.Forward(input).to(at::kCPU);
      backend->Synchronize();
      if (!uncached.defined()) uncached = out;
      EXPECT_TRUE(at::equal(out, uncached));
      return h2d() - before;
    };
    const int64_t per_forward = forward();
    EXPECT_EQ(per_forward, planned.bytes_per_forward);
    if (!cuda) {  // The simulator's uncached forward is the one Stream() measures elsewhere.
      EXPECT_TRUE(at::equal(uncached, Stream(at::kBFloat16, options).out));
    }

    // Room for the compressed copies of every streamed group, not for them widened.
    const int64_t allowance = planned.streamed_bytes - 1;
    offloader.SetCacheAllowance(allowance);
    EXPECT_EQ(forward(), per_forward);  // The filling forward: the copies land in the cache.
    GroupOffloadStats s = offloader.stats();
    EXPECT_EQ(s.cached_groups, planned.streamed_groups);
    EXPECT_GT(s.cache_link_bytes, 0);
    // Kept as they crossed the link (device copies of the packed buffers: aligned parts).
    EXPECT_GE(s.cache_bytes, s.cache_link_bytes);
    EXPECT_LT(s.cache_bytes, planned.streamed_bytes);
    EXPECT_EQ(offloader.device_bytes(), planned.slots * planned.slot_bytes + planned.scratch_bytes + s.cache_bytes);
    const int64_t cached_forward = forward();
    // Only the always-on groups (outside the blocks; never cached) cross.
    EXPECT_EQ(cached_forward, per_forward - s.cache_link_bytes);
    // Each streamed group's onload is served by its copy once a forward.
    const int64_t hits = offloader.stats().cache_hits, hit_bytes = offloader.stats().cache_hit_bytes;
    EXPECT_EQ(forward(), cached_forward);
    EXPECT_EQ(offloader.stats().cache_hits - hits, planned.streamed_groups);
    EXPECT_EQ(offloader.stats().cache_hit_bytes - hit_bytes, s.cache_link_bytes);
    // After a release of the ring (and its scratch: fp8's decode tables go up again with it), the
    // copies still serve.
    offloader.ReleaseSlots();
    EXPECT_LT(forward() - cached_forward, planned.scratch_bytes);
    EXPECT_EQ(forward(), cached_forward);

    // A lower allowance gives copies back at once; the next forward copies those again.
    const int64_t allocated = backend->GetMemoryStats().allocated_bytes;
    const int64_t freed = offloader.SetCacheAllowance(s.cache_bytes / 2);
    EXPECT_GT(freed, 0);
    EXPECT_LE(offloader.cache_bytes(), s.cache_bytes / 2);
    // The simulator counts tensor bytes; CUDA's allocator frees whole blocks (rounded up).
    if (cuda) {
      EXPECT_LE(backend->GetMemoryStats().allocated_bytes, allocated - freed);
    } else {
      EXPECT_EQ(backend->GetMemoryStats().allocated_bytes, allocated - freed);
    }
    EXPECT_EQ(forward(), per_forward - offloader.stats().cache_link_bytes);

    // Room for every streamed group widened: they are kept as the slot holds them, and a forward
    // copies (and widens) none of them.
    offloader.SetCacheAllowance(planned.streamed_bytes);
    (void)forward();
    s = offloader.stats();
    EXPECT_EQ(s.cached_groups, planned.streamed_groups);
    EXPECT_EQ(s.cache_bytes, planned.streamed_bytes);
    EXPECT_EQ(forward(), cached_forward);
    EXPECT_EQ(offloader.stats().cache_link_bytes, per_forward - cached_forward);
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, CompressedStreamingTest,
                         ::testing::Values(CompressFormat::kInt8, CompressFormat::kFp8E4M3,
                                           CompressFormat::kInt8Grouped, CompressFormat::kInt4),
                         FormatLabel);

TEST(CompressedOptionsTest, NeedThePinnedTarget) {
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  GroupOffloadOptions options = Streaming(CompressFormat::kInt8);
  options.target = OffloadTarget::kPageableHost;
  auto offloader = GroupOffloader::Apply("stack", model, *weights, *backend, options);
  ASSERT_FALSE(offloader.ok());
  EXPECT_EQ(offloader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(offloader.status().message().find("compress"), std::string::npos);
}

// The threads that read the weights at load are checked before anything is pinned.
TEST(CompressedOptionsTest, NoCopyThreadsIsRefusedUpFront) {
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  GroupOffloadOptions options = Streaming(CompressFormat::kInt4);
  options.staging_threads = 0;
  auto offloader = GroupOffloader::Apply("stack", model, *weights, *backend, options);
  ASSERT_FALSE(offloader.ok());
  EXPECT_EQ(offloader.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(offloader.status().message().find("staging_threads"), std::string::npos) << offloader.status();
}

// The quantizer's chunk: below 1024 values refused up front, naming the option; a small one (the
// stack's weights in several chunks each) streams the default's forward bit for bit.
TEST(CompressedOptionsTest, TheQuantizeChunkIsCheckedAndChangesNoByte) {
  GroupOffloadOptions bad = Streaming(CompressFormat::kInt4);
  bad.quantize_chunk_elements = 1023;
  {
    StackModel model;
    std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
    std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
    auto offloader = GroupOffloader::Apply("stack", model, *weights, *backend, bad);
    ASSERT_FALSE(offloader.ok());
    EXPECT_EQ(offloader.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(offloader.status().message().find("quantize_chunk_elements"), std::string::npos) << offloader.status();
  }
  GroupOffloadOptions small = Streaming(CompressFormat::kInt4);
  small.quantize_chunk_elements = 1024;  // 128-value rows: 8 rows a chunk, several chunks a weight.
  const StreamRun fine = Stream(at::kBFloat16, small);
  const StreamRun whole = Stream(at::kBFloat16, Streaming(CompressFormat::kInt4));
  ASSERT_TRUE(fine.out.defined() && whole.out.defined());
  EXPECT_TRUE(at::equal(fine.out, whole.out));
}

// --- 8-bit checkpoints ----------------------------------------------------------------------------

TEST_P(CompressedStreamingTest, CheckpointWrittenLoadedAndStreamedAsIs) {
  const CompressFormat format = GetParam();
  if (format == CompressFormat::kInt8Grouped || format == CompressFormat::kInt4) {
    // Checkpoints hold the 8-bit per-channel formats; the others are made at load.
    EXPECT_EQ(WriteCompressedSafetensors(::testing::TempDir() + "/x.safetensors", {}, format).code(),
              absl::StatusCode::kInvalidArgument);
    return;
  }
  const std::string path = std::string(::testing::TempDir()) + "/stack_" + CompressFormatName(format) + ".safetensors";
  {
    StackModel model;
    std::vector<std::pair<std::string, at::Tensor>> named;
    model.ForEachSlot([&](Module& m, TensorSlot& s) { named.emplace_back(m.SlotPath(s), s.value); });
    ASSERT_TRUE(WriteCompressedSafetensors(path, named, format).ok());
  }
  auto checkpoint = ReadCompressedSafetensors(path);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_EQ(checkpoint->format, format);
  EXPECT_EQ(checkpoint->quantized.size(), 2u * StackModel::kBlocks + 2);  // fc1, fc2 per block; embed, head.
  // Bind: the module's host copies are the dequantized weights (compute dtype), the store gets the
  // 8-bit bytes as they are in the file.
  auto given = std::make_shared<PrequantizedWeights>(checkpoint->quantized);
  auto bind = [&](StackModel& model) {
    model.ForEachSlot([&](Module& m, TensorSlot& s) {
      const std::string name = m.SlotPath(s);
      auto q = checkpoint->quantized.find(name);
      s.value = q != checkpoint->quantized.end() ? Dequantize(q->second, format, at::kFloat)
                                                 : checkpoint->plain.at(name).clone();
    });
  };
  const StreamRun from_file = Stream(at::kFloat, Streaming(format), given, bind);
  // Quantizing at Apply from the original weights gives the same bytes, hence the same output.
  const StreamRun at_apply = Stream(at::kFloat, Streaming(format));
  ASSERT_TRUE(from_file.out.defined() && at_apply.out.defined());
  EXPECT_TRUE(at::equal(from_file.out, at_apply.out));
  EXPECT_EQ(from_file.h2d_per_forward, at_apply.h2d_per_forward);

  // A file without the metadata, or an 8-bit tensor without its scale, is refused.
  ASSERT_TRUE(WriteSafetensors(path, {{"w", at::zeros({4, 4}, at::kChar)}}, {{kCompressMetadataKey, "int8"}}).ok());
  EXPECT_EQ(ReadCompressedSafetensors(path).status().code(), absl::StatusCode::kInvalidArgument);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", at::zeros({4, 4})}}).ok());
  EXPECT_EQ(ReadCompressedSafetensors(path).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(CompressedCheckpointTest, MismatchedPrequantizedWeightIsRefused) {
  auto given = std::make_shared<PrequantizedWeights>();
  (*given)["blocks.0.fc1.weight"] = QuantizedTensor{at::zeros({3, 3}, at::kChar), at::ones({3})};
  StackModel model;
  std::unique_ptr<HostWeights> weights = *HostWeights::Capture(model);
  std::unique_ptr<DeviceBackend> backend = CreateSimulatedBackend({});
  GroupOffloadOptions options = Streaming(CompressFormat::kInt8);
  options.prequantized = given;
  auto offloader = GroupOffloader::Apply("stack", model, *weights, *backend, options);
  ASSERT_FALSE(offloader.ok());
  EXPECT_EQ(offloader.status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace stowage
