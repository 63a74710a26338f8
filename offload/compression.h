// 8-bit and 4-bit weight compression for streamed groups: the formats, the host-side quantizers,
// the device-side widening, and the scratch sizes the engine plans for.
//
// Formats (a weight of rank >= 2 seen as [C, K]: dim 0 the output channels, every other dim
// flattened into K):
//   kInt8         symmetric per output channel: scale[c] = max|w[c,:]| / 127,
//                 q = round_half_even(w / scale) in [-127, 127] (int8 storage); w' = q * scale.
//   kFp8E4M3      e4m3fn bits (uint8 storage): scale[c] = max|w[c,:]| / 448, q = e4m3(w / scale)
//                 (round to nearest even, saturating at 448); w' = e4m3_value(q) * scale.
//   kInt8Grouped  int8 as kInt8 but one scale per group of G consecutive values along K
//                 (scale[c, g] = max|w[c, gG:(g+1)G]| / 127): G = 128 where K allows, else the
//                 largest of 64, 32, 16 dividing K, else K (GroupSize). 8.25 bits a value at G = 128.
//   kInt4         symmetric 4-bit per group (G = 16 where K divides by it, else K) with 8-bit group
//                 scales: each row c has an fp32 scale r[c] = max|w[c,:]| / (7 · 448) (1 for a zero
//                 row) and each group an e4m3fn code s[c, g]; the group's scale is
//                 e4m3(s[c, g]) · r[c] (the product in fp32). The code is chosen by a clipping search:
//                 for ratios {1, 0.95, ..., 0.75} the candidate e4m3(ratio · max|group| / 7 / r[c]) · r[c],
//                 the one of least squared error kept. q = round_half_even(w / scale) in [-7, 7]
//                 stored as q + 8, two values a byte (the even index in the low nibble); uint8
//                 storage [C, K / 2]; K must be even. w' = (nibble − 8) · scale. 4.5 bits a value
//                 (0.281× bf16) at G = 16. The scales are one uint8 buffer [C · 4 + C · K / G]: the C
//                 fp32 row scales' bytes, then the codes row by row. (Measured on the trained demo,
//                 bench/results/fidelity_cpu_int4_variants.md: 48 of 48 caption checks and 36.6 / 29.8
//                 dB mean / worst PSNR against bf16, where bf16 group scales — 5 bits a value — gave
//                 36.1 / 29.1 dB; groups of 32 lose a check.)
// Scales are fp32 ([C] or [C, K / G]) but for kInt4. A channel (group) of zeros gets scale 1 (q = 0;
// kInt4: code 0, scale 0). Only
// floating tensors (fp32, bf16, fp16) of rank >= 2 with elements are compressed (and for kInt4
// an even K); the rest (biases, norms, scalars) stay in their compute dtype: they are tiny.
// float8 e4m3fn weights (FP8 compute, LibTorch 2.1 or later) are compressed by kInt4 only — their
// values in float32 quantized as any other weight's — and widened on CUDA back into e4m3 bytes,
// which the FP8 GEMM reads with the layer's own per-channel scale: 4.5 bits a value on the link
// instead of 8, and no widening to bf16. Elsewhere widening into float8 is refused.
//
// Widening is dequantization into the compute dtype. On CUDA it is one kernel pass
// (widen_kernels.cu: 16 bytes of codes a thread, 16-byte stores). Elsewhere (the simulator, CPU) it is done
// with LibTorch ops that allocate nothing (a copy_ into the output, an index_select_out through a
// 256-entry table for fp8, an in-place mul_ by the scales), so its device memory is exactly the
// planned scratch:
//   int8: out.copy_(q); out.mul_(scale[:, None])   (grouped: out[c, g, :].mul_(scale[c, g]))
//   fp8:  out[chunk] = table[q[chunk]] (int32 index chunk), then out.mul_(scale[:, None])
//   int4: nibbles = q & 15 into the uint8 scratch, copied to out's even columns; q >> 4 to the odd
//         ones; out.sub_(8); then, rows in chunks, the group scales decoded into the same scratch
//         (an int32 index of the codes, index_select through the fp32 table, times the row scale)
//         and out[c, g, :].mul_(scale[c, g])
// Either way the result equals Dequantize() bit for bit (the product in fp32, rounded once to the
// compute dtype: int8, int4 and e4m3 values are exact in bf16 and fp16; an int4 group's scale is
// rounded once, to fp32, everywhere).
// Debian's LibTorch 1.13 has no float8 dtype: the fp8 codec is this file's own code on uint8.
//
// Thread-safety: functions are reentrant.
#ifndef STOWAGE_OFFLOAD_COMPRESSION_H_
#define STOWAGE_OFFLOAD_COMPRESSION_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace stowage {

enum class CompressFormat { kNone, kInt8, kFp8E4M3, kInt8Grouped, kInt4 };

// "none", "int8", "fp8_e4m3", "int8_grouped", "int4" (the first three also checkpoint metadata
// values, see compressed_safetensors.h).
const char* CompressFormatName(CompressFormat format);
// The inverse of CompressFormatName; INVALID_ARGUMENT otherwise.
absl::StatusOr<CompressFormat> ParseCompressFormat(absl::string_view name);

// Largest finite e4m3fn magnitude.
inline constexpr float kFp8E4M3Max = 448.0f;
// Elements widened per index_select of the fp8 table path (the int32 index chunk in scratch).
inline constexpr int64_t kFp8DecodeChunkElements = int64_t{1} << 20;

// A weight in compressed form. `q`: int8 (kInt8, kInt8Grouped) or uint8 e4m3fn bits (kFp8E4M3), the
// weight's shape; kInt4: uint8 [C, K / 2]; contiguous. `scale`: fp32 [C] (kInt8, kFp8E4M3) or
// [C, K / GroupSize] (kInt8Grouped); kInt4: uint8 [C · 4 + C · K / GroupSize] (the row scales'
// fp32 bytes, then the group codes); contiguous.
struct QuantizedTensor {
  at::Tensor q;
  at::Tensor scale;
};

// Values per scale along K for the grouped formats (see the header comment); K for the others.
int64_t GroupSize(CompressFormat format, int64_t k);

// How one compressible tensor is stored: the bytes, dtype and shape of q, and the number and dtype
// of its scales.
struct QuantLayout {
  int64_t q_bytes = 0;
  at::ScalarType q_dtype = at::kByte;
  std::vector<int64_t> q_shape;
  int64_t scale_count = 0;
  at::ScalarType scale_dtype = at::kFloat;
  int64_t scale_bytes() const { return scale_count * static_cast<int64_t>(c10::elementSize(scale_dtype)); }
};
QuantLayout LayoutOf(CompressFormat format, at::IntArrayRef sizes);

// Already-quantized weights by full slot path ("blocks.0.fc1.weight"), e.g. read from an 8-bit
// checkpoint: the store uses them instead of quantizing the host copy.
using PrequantizedWeights = std::map<std::string, QuantizedTensor>;

// True when `format` compresses a tensor of this dtype and shape (see the header comment).
bool IsCompressible(CompressFormat format, at::ScalarType dtype, at::IntArrayRef sizes);

// Quantizes a tensor (IsCompressible) to `format`, on the tensor's device (CPU, or CUDA: the same
// LibTorch ops and, for fp8, a kernel of widen_kernels.h).
QuantizedTensor Quantize(const at::Tensor& w, CompressFormat format);
// Values a chunk of rows holds at most when LoadQuantizer (offload/load_quantizer.h) quantizes a
// weight on a GPU at load: its device memory stays well under a GB. The result equals the host's
// Quantize() bit for bit for the 8-bit formats (the same IEEE operations per value and exact
// maxima); for int4 the clipping search compares sums of squared errors whose order of summation
// differs, so a near-tie may keep another (equally good) candidate.
inline constexpr int64_t kQuantizeChunkElements = int64_t{1} << 24;
// The host reference of widening: the weight as the device sees it, in `dtype`, of shape `sizes`
// (the weight's; empty: q's shape, or [C, K] for kInt4).
at::Tensor Dequantize(const QuantizedTensor& t, CompressFormat format, at::ScalarType dtype,
                      at::IntArrayRef sizes = {});

// e4m3fn codec on uint8: EncodeFp8E4M3 rounds to nearest even and saturates to ±448 (NaN stays NaN);
// Fp8E4M3Table(dtype) is the decoded value of every bit pattern (0x7F and 0xFF are NaN), on CPU.
at::Tensor EncodeFp8E4M3(const at::Tensor& x);  // fp32 CPU in, uint8 out, same shape.
at::Tensor Fp8E4M3Table(at::ScalarType dtype);

// Device buffers the widening needs besides q and scale (views of the store's scratch): fp8's
// tables and index chunk; int4's nibble buffer and fp32 table (of its scale codes). CUDA's kernel
// reads none of them.
struct WidenScratch {
  at::Tensor table_f32, table_bf16, table_f16;  // 256 entries each (those of the dtypes used).
  at::Tensor index;                             // int32, >= min(numel, kFp8DecodeChunkElements).
  at::Tensor nibbles;  // uint8, >= AlignScratch(numel / 2) of the largest tensor (kInt4).
};
// Enqueue-free: issues the widening of (q, scale) into `out` (compute dtype, q's shape,
// contiguous) on the current stream of out's device.
void WidenInto(const at::Tensor& out, const at::Tensor& q, const at::Tensor& scale, CompressFormat format,
               const WidenScratch& scratch);

// One tensor of WidenAllInto.
struct WidenTarget {
  at::Tensor out, q, scale;
};
// WidenInto of every target (one format, outputs on one device), the same bytes in fewer launches:
// on CUDA the weights whose layout the 16-byte kernel path takes share launches of up to 16 (a
// group's weights in one or two instead of one each, widen_kernels.h WidenMany), the others
// launch alone; elsewhere one WidenInto each.
void WidenAllInto(const std::vector<WidenTarget>& targets, CompressFormat format, const WidenScratch& scratch);

// How CUDA's widening kernels lay a weight over their threads (widen_kernels.h Layout): "coalesced"
// (the default) or "strided". A process-wide switch for benchmarks; false for another name. Off CUDA
// builds the layout does not exist: the name is accepted and nothing changes; WideningLayoutName()
// is the default's name, "coalesced", there.
bool SetWideningLayout(absl::string_view name);
std::string WideningLayoutName();

// Scratch layout, shared by the planner (through the engine) and the store.
inline constexpr int64_t kScratchAlign = 256;
inline int64_t AlignScratch(int64_t bytes) { return (bytes + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }
// Bytes one compressed tensor takes in a group's scratch: q then scale, each aligned; 0 when the
// tensor is not compressed (it goes straight to the slot).
int64_t TensorScratchBytes(CompressFormat format, at::ScalarType dtype, at::IntArrayRef sizes);
// Bytes the widening needs once, whatever the group: for fp8, one table per compute dtype present
// and the index chunk for the largest compressed tensor (`max_numel`); for int4 the nibble buffer
// (AlignScratch(max_numel / 2), at its start) and the fp32 table after it; 0 for int8 and none.
int64_t FixedScratchBytes(CompressFormat format, bool has_f32, bool has_bf16, bool has_f16, int64_t max_numel);
// Where int4's fp32 table starts in its fixed scratch (after the nibble buffer).
inline int64_t Int4TableOffset(int64_t max_numel) { return AlignScratch(max_numel / 2); }

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_COMPRESSION_H_
