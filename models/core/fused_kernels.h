// Launchers of the fused CUDA kernels of the transformer forward (fused_kernels.cu), compiled only
// in CUDA builds. No LibTorch and no CUDA headers here: fused_ops.cc checks shapes, dtypes and
// strides and passes raw pointers and the current stream. Every tensor is bfloat16 unless named
// otherwise, rows are contiguous along the last dimension, and each launcher returns the launch's
// cudaError_t as an int (0 = success).
//
// Rounding: each kernel computes in float32 and rounds to bfloat16 exactly where the eager
// reference (fused_ops.cc, the plain LibTorch ops diffusers also runs) rounds, so the fused result
// differs from the reference only by the order of a row's float32 sums.
#ifndef STOWAGE_MODELS_CORE_FUSED_KERNELS_H_
#define STOWAGE_MODELS_CORE_FUSED_KERNELS_H_

#include <cstdint>

namespace stowage::fused_cuda {

// Per row r of x [rows, dim] (row r belongs to batch element r / rows_per_batch = b):
//   n = bf16(bf16(x · rsqrt(mean(x²) + eps)) · weight)
//   scale given:         n = bf16(n · scale[b])
//   residual+gate given: out = bf16(residual + bf16(gate[b] · n)), else out = n.
// scale and gate are rows of `dim` values with a batch stride in elements (0: one row for all).
int RmsNorm(const void* x, const void* weight, const void* scale, int64_t scale_batch_stride,
            const void* residual, const void* gate, int64_t gate_batch_stride, void* out, int64_t rows,
            int64_t rows_per_batch, int64_t dim, float eps, void* stream);

// x [batch, seq, heads, head_dim] (contiguous), optional RMS normalisation of each head vector
// (weight [head_dim], as RmsNorm without scale; null weight: no normalisation), then the rotary
// embedding of pairs (x0, x1) → (x0·c − x1·s, x1·c + x0·s) in float32, written to
// out [batch, out_seq, heads, head_dim] at sequence position s + out_seq_offset. cos and sin are
// float32 [cs_batch, cs_seq, head_dim / 2] (cs_batch 1 or batch), read at row s + table_offset.
// x's tokens are x_token_stride elements apart (heads · head_dim when contiguous; more when x is
// one part of a wider projection output).
int RmsNormRope(const void* x, int64_t x_token_stride, const void* weight, const float* cos, const float* sin,
                int64_t cs_batch, int64_t cs_seq, int64_t table_offset, void* out, int64_t batch, int64_t seq,
                int64_t heads, int64_t head_dim, int64_t out_seq, int64_t out_seq_offset, float eps, void* stream);

// The longest row the one-block-per-row norm kernels hold in registers (128 threads x 8 chunks of 8).
constexpr int64_t kMaxRowKernelDim = 8192;

// LayerNorm without affine parameters, then modulation: for row r of batch element b,
//   out = bf16(bf16(bf16(layer_norm(x)) · scale[b]) + shift[b])
// (scale is already 1 + the model's scale, in bfloat16, as the reference computes it).
int LayerNormModulate(const void* x, const void* scale, int64_t scale_batch_stride, const void* shift,
                      int64_t shift_batch_stride, void* out, int64_t rows, int64_t rows_per_batch, int64_t dim,
                      float eps, void* stream);
// The same row quantised per token to FP8 as QuantizeRowsFp8 (below) quantises LayerNormModulate's
// output, bit for bit, without writing the bfloat16 row: q [rows, dim] e4m3, q_scale [rows].
int LayerNormModulateFp8(const void* x, const void* scale, int64_t scale_batch_stride, const void* shift,
                         int64_t shift_batch_stride, void* q, float* q_scale, int64_t rows, int64_t rows_per_batch,
                         int64_t dim, float eps, void* stream);

// out = bf16(bf16(silu(a)) · b) over rows of `cols` values (a multiple of 8); a's and b's rows are
// a_row_stride and b_row_stride elements apart (cols when contiguous; both halves of one GEMM's
// output otherwise), out is contiguous.
int SiluMul(const void* a, int64_t a_row_stride, const void* b, int64_t b_row_stride, void* out, int64_t rows,
            int64_t cols, void* stream);

// Elementwise ops over [batch, seq, cols] tensors whose rows may be strided: element (b, s, c) of a
// tensor is at b · batch_stride + s · row_stride + c (cols and both strides multiples of 8, the
// pointers 16-byte aligned).
struct Rows {
  int64_t batch_stride;
  int64_t row_stride;
};
// out = bf16(gelu_tanh(x)).
int GeluTanh(const void* x, Rows x_rows, void* out, Rows out_rows, int64_t batch, int64_t seq, int64_t cols,
             void* stream);
// out = x (a strided copy, e.g. into one part of a joint tensor).
int CopyRows(const void* x, Rows x_rows, void* out, Rows out_rows, int64_t batch, int64_t seq, int64_t cols,
             void* stream);
// out = bf16(x + gate[b] · y) in float32 (at::addcmul's rounding); x, y and out contiguous rows,
// gate rows of `cols` values a batch stride apart (0: one row for the batch).
int GatedAdd(const void* x, const void* gate, int64_t gate_batch_stride, const void* y, void* out, int64_t batch,
             int64_t seq, int64_t cols, void* stream);

// Per-token FP8 quantisation for FP8 GEMMs: for row r of x [rows, dim] (dim a multiple of 8),
//   scale[r] = max(|x_r|) / 448 (float32; 1 when the row is all zeros), q = e4m3(x_r / scale[r]).
int QuantizeRowsFp8(const void* x, void* q, float* scale, int64_t rows, int64_t dim, void* stream);

// The same quantisation of a row made of up to kMaxQuantParts parts side by side (the
// concatenation along the last dimension that the next FP8 GEMM reads, never built): part p is a
// [batch, seq, cols] tensor of strided rows (as Rows above), passed through gelu_tanh first (rounded
// to bfloat16 exactly as GeluTanh) when `gelu`. q [batch · seq, Σ cols], scale [batch · seq]; the
// row (Σ cols) at most kMaxQuantConcatDim values (it is staged in shared memory). Equal, bit for bit,
// to QuantizeRowsFp8 of the concatenation of the parts (after GeluTanh of the flagged ones).
constexpr int kMaxQuantParts = 4;
constexpr int64_t kMaxQuantConcatDim = 24320;  // 47.5 KB of bfloat16: under the 48 KB a block gets without opting in.
struct QuantPart {
  const void* x;
  Rows rows;
  int64_t cols;
  bool gelu;
};
int QuantizeConcatRowsFp8(const QuantPart* parts, int num_parts, void* q, float* scale, int64_t batch, int64_t seq,
                          void* stream);

}  // namespace stowage::fused_cuda

#endif  // STOWAGE_MODELS_CORE_FUSED_KERNELS_H_
