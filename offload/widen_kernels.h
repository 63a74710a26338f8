// Launchers of the compression kernels (widen_kernels.cu, compiled only in CUDA builds): widening,
// one pass from a compressed weight (offload/compression.h) to the compute dtype instead of the
// several LibTorch ops of the portable path; and the fp8 encoder of quantization on the device. No LibTorch and no CUDA headers here: compression.cc checks the
// tensors and passes raw pointers and the current stream.
//
// For every element e of the [channels, k] weight (row-major), with g = e / group_size its scale:
//   out[e] = round_to_out_dtype(value(q, e) · scale(g))   (the product in float32, rounded once)
// where value is q[e] (int8), the e4m3fn value of q[e] (fp8), or ((q[e / 2] >> 4·(e % 2)) & 15) − 8
// (int4, two values a byte, the even index in the low nibble), and scale(g) is scale[g] (fp32: the
// 8-bit formats) or, for kE4M3Rows (int4), e4m3(codes[g]) · rows[g / (k / group_size)] in float32 (rows: the first
// `channels` fp32 values of the buffer, codes: the bytes after them). This is compression.cc's
// Dequantize bit for bit: int8, int4 and e4m3 values are exact in float32, and the scale is an fp32
// value.
#ifndef STOWAGE_OFFLOAD_WIDEN_KERNELS_H_
#define STOWAGE_OFFLOAD_WIDEN_KERNELS_H_

#include <cstdint>

namespace stowage::widen_cuda {

enum class Codes { kInt8 = 0, kFp8E4M3 = 1, kInt4 = 2 };
// kFp8E4M3: e4m3fn bytes (round to nearest even, saturating at ±448: a weight that computes in FP8,
// e.g. its int4 host copy widened straight into the FP8 GEMM's operand).
enum class OutType { kFloat = 0, kBFloat16 = 1, kHalf = 2, kFp8E4M3 = 3 };
// How the scales are stored (see above): kFloat the 8-bit formats', kE4M3Rows int4's.
enum class ScaleKind { kFloat = 0, kE4M3Rows = 1 };

// How a launch spreads a weight over its threads: kCoalesced (the default), a warp's lanes take
// interleaved chunks of eight values so that each of the warp's loads and stores covers one
// contiguous span; kStrided, each thread takes 16 consecutive bytes of codes and writes their values
// with 16-byte stores 64 bytes apart across the warp. Both give the same bytes (tested bit for bit on
// the GPU host). Measured on an H100 (session 32, bench/results/widen_h100_b3fe603/): int4 into bf16
// 2.64-2.87 TB/s coalesced against 1.42-1.60 strided (a plain device copy 2.82), the 8-bit formats
// into bf16 2.72-2.92 against 2.11-2.20, into e4m3 the same either way. STOWAGE_WIDEN_LAYOUT=strided
// in the environment chooses the strided layout at the first launch; SetLayout changes the layout for
// the launches after (process-wide; a benchmark's switch, not a serving setting).
enum class Layout { kCoalesced = 0, kStrided = 1 };
Layout CurrentLayout();
void SetLayout(Layout layout);
// The kernels' division of an int4 group's index g by its weight's groups a row d (the row whose fp32
// scale it takes): the high 64 bits of RowMagic(d) · g, where RowMagic(d) = ceil(2^64 / d), equal
// g / d for every g < 2^32 and 2 <= d < 2^32 (Lemire, Kaser and Kurz, "Faster remainder by direct
// computation", 2019: exact when 64 >= 32 + log2(d)); 0 for other d (the kernels then divide).
// compressed_offload_test checks the identity on the CPU.
constexpr uint64_t RowMagic(int64_t d) {
  return d >= 2 && d <= 0xFFFFFFFFll ? ~uint64_t{0} / static_cast<uint64_t>(d) + 1 : 0;
}

// `group_size` divides `k` (per-channel formats pass k). Returns the launch's cudaError_t as an int
// (0 = success).
int Widen(Codes codes, const void* q, const void* scale, ScaleKind scale_kind, void* out, OutType out_type,
          int64_t channels, int64_t k, int64_t group_size, void* stream);

// One weight of a WidenMany call: Widen's arguments.
struct WidenJob {
  const void* q = nullptr;
  const void* scale = nullptr;
  void* out = nullptr;
  int64_t channels = 0;
  int64_t k = 0;
  int64_t group_size = 0;
};

// Widen of every job (one codes, scale kind and output type), the same bytes, in fewer launches:
// the jobs the 16-byte path takes (whole 16-byte items, 16-byte aligned codes and output, groups of
// a multiple of 8) share launches of up to kWidenManyJobs weights; the others launch alone. Returns
// the first launch error (0: none).
inline constexpr int kWidenManyJobs = 16;
int WidenMany(Codes codes, ScaleKind scale_kind, OutType out_type, const WidenJob* jobs, int count, void* stream);

// e4m3fn bits of n float32 values, as compression.cc's host encoder gives them (round to nearest
// even, saturating at ±448, NaN kept): quantizing on the device at load.
int EncodeE4M3(const float* x, uint8_t* out, int64_t n, void* stream);

}  // namespace stowage::widen_cuda

#endif  // STOWAGE_OFFLOAD_WIDEN_KERNELS_H_
