// The fused CUDA kernels behind fused_kernels.h (built for sm_90 in CUDA builds only).
//
// All kernels are memory-bound row operations: a row is read once into registers (16-byte loads),
// reduced in float32, and written once. Rounding to bfloat16 happens where the eager reference
// rounds (see fused_kernels.h), so a fused op differs from its reference only in summation order.
#include "models/core/fused_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace stowage::fused_cuda {
namespace {

using bf16 = __nv_bfloat16;

constexpr int kRowThreads = 128;   // Threads per row of the row kernels.
constexpr int kMaxChunks = 8;      // 8-value chunks per thread: rows up to 128 * 8 * 8 = 8192 values.
static_assert(kMaxRowKernelDim == int64_t{kRowThreads} * kMaxChunks * 8, "fused_kernels.h's row limit");
constexpr int kMaxPairs = 8;       // Pairs per lane in RmsNormRope: head_dim up to 512.

struct alignas(16) Vec8 {
  bf16 v[8];
};

__device__ __forceinline__ float Round(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Sum (or max) over the block's kThreads threads; every thread gets the result. `shared` holds 33
// floats and may be reused once this returns.
template <bool kMax, int kThreads = kRowThreads>
__device__ float BlockReduce(float v, float* shared) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  v = kMax ? WarpMax(v) : WarpSum(v);
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float w = lane < kThreads / 32 ? shared[lane] : 0.f;  // 0 is neutral for both: |x| >= 0.
    w = kMax ? WarpMax(w) : WarpSum(w);
    if (lane == 0) shared[32] = w;
  }
  __syncthreads();
  const float result = shared[32];
  __syncthreads();
  return result;
}

// Loads this thread's chunks of a row into registers (zeros past the row's end).
__device__ __forceinline__ void LoadRow(const bf16* row, int chunks, float (&vals)[kMaxChunks][8]) {
  const Vec8* v = reinterpret_cast<const Vec8*>(row);
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kRowThreads;
    if (c < chunks) {
      const Vec8 chunk = v[c];
#pragma unroll
      for (int j = 0; j < 8; ++j) vals[i][j] = __bfloat162float(chunk.v[j]);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) vals[i][j] = 0.f;
    }
  }
}

template <bool kScale, bool kGated>
__global__ void __launch_bounds__(kRowThreads) RmsNormKernel(
    const bf16* __restrict__ x, const bf16* __restrict__ weight, const bf16* __restrict__ scale,
    int64_t scale_batch_stride, const bf16* __restrict__ residual, const bf16* __restrict__ gate,
    int64_t gate_batch_stride, bf16* __restrict__ out, int64_t rows_per_batch, int dim, float eps) {
  __shared__ float shared[33];
  const int64_t row = blockIdx.x;
  const int64_t b = row / rows_per_batch;
  const int chunks = dim / 8;
  float vals[kMaxChunks][8];
  LoadRow(x + row * dim, chunks, vals);
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) squares += vals[i][j] * vals[i][j];
  }
  const float total = BlockReduce<false>(squares, shared);
  const float r = 1.f / sqrtf(total / static_cast<float>(dim) + eps);
  const Vec8* w = reinterpret_cast<const Vec8*>(weight);
  const Vec8* s = kScale ? reinterpret_cast<const Vec8*>(scale + b * scale_batch_stride) : nullptr;
  const Vec8* res = kGated ? reinterpret_cast<const Vec8*>(residual + row * dim) : nullptr;
  const Vec8* g = kGated ? reinterpret_cast<const Vec8*>(gate + b * gate_batch_stride) : nullptr;
  Vec8* o = reinterpret_cast<Vec8*>(out + row * dim);
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kRowThreads;
    if (c >= chunks) continue;
    const Vec8 wc = w[c];
    Vec8 sc, rc, gc, result;
    if constexpr (kScale) sc = s[c];
    if constexpr (kGated) {
      rc = res[c];
      gc = g[c];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      float n = Round(Round(vals[i][j] * r) * __bfloat162float(wc.v[j]));
      if constexpr (kScale) n = Round(n * __bfloat162float(sc.v[j]));
      if constexpr (kGated) n = __bfloat162float(rc.v[j]) + Round(__bfloat162float(gc.v[j]) * n);
      result.v[j] = __float2bfloat16_rn(n);
    }
    o[c] = result;
  }
}

__global__ void __launch_bounds__(256) RmsNormRopeKernel(
    const bf16* __restrict__ x, int64_t x_token_stride, const bf16* __restrict__ weight, const float* __restrict__ cos,
    const float* __restrict__ sin, int64_t cs_batch, int64_t cs_seq, int64_t table_offset, bf16* __restrict__ out,
    int64_t rows,
    int64_t seq, int64_t heads, int head_dim, int64_t out_seq, int64_t out_seq_offset, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (row >= rows) return;  // Uniform across the warp: one row per warp.
  const int lane = threadIdx.x % 32;
  const int64_t h = row % heads;
  const int64_t s = (row / heads) % seq;
  const int64_t b = row / (heads * seq);
  const int pairs = head_dim / 2;
  const __nv_bfloat162* xr =
      reinterpret_cast<const __nv_bfloat162*>(x + (b * seq + s) * x_token_stride + h * head_dim);
  float even[kMaxPairs], odd[kMaxPairs];
  float squares = 0.f;
#pragma unroll
  for (int k = 0; k < kMaxPairs; ++k) {
    const int p = lane + 32 * k;
    even[k] = odd[k] = 0.f;
    if (p < pairs) {
      const float2 v = __bfloat1622float2(xr[p]);
      even[k] = v.x;
      odd[k] = v.y;
      squares += v.x * v.x + v.y * v.y;
    }
  }
  if (weight != nullptr) {
    const float r = 1.f / sqrtf(WarpSum(squares) / static_cast<float>(head_dim) + eps);
    const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(weight);
#pragma unroll
    for (int k = 0; k < kMaxPairs; ++k) {
      const int p = lane + 32 * k;
      if (p < pairs) {
        const float2 wp = __bfloat1622float2(w[p]);
        even[k] = Round(Round(even[k] * r) * wp.x);
        odd[k] = Round(Round(odd[k] * r) * wp.y);
      }
    }
  }
  const int64_t table_row = ((cs_batch == 1 ? 0 : b) * cs_seq + s + table_offset) * pairs;
  __nv_bfloat162* o =
      reinterpret_cast<__nv_bfloat162*>(out + ((b * out_seq + s + out_seq_offset) * heads + h) * head_dim);
#pragma unroll
  for (int k = 0; k < kMaxPairs; ++k) {
    const int p = lane + 32 * k;
    if (p < pairs) {
      const float c = cos[table_row + p], sn = sin[table_row + p];
      o[p] = __floats2bfloat162_rn(even[k] * c - odd[k] * sn, odd[k] * c + even[k] * sn);
    }
  }
}

// The same with 16-byte accesses: kLanes = head_dim / 8 lanes per row (a power of two up to 32),
// each holding 8 values (4 pairs), cos/sin read as float4. Lanes past the last row still take part
// in the shuffles.
template <int kLanes>
__global__ void __launch_bounds__(256) RmsNormRopeVecKernel(
    const bf16* __restrict__ x, int64_t x_token_stride, const bf16* __restrict__ weight, const float* __restrict__ cos,
    const float* __restrict__ sin, int64_t cs_batch, int64_t cs_seq, int64_t table_offset, bf16* __restrict__ out,
    int64_t rows, int64_t seq, int64_t heads, int64_t out_seq, int64_t out_seq_offset, float eps) {
  constexpr int kHeadDim = kLanes * 8;
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanes;
  const int sub = threadIdx.x % kLanes;
  const bool valid = row < rows;
  const int64_t h = row % heads;
  const int64_t s = (row / heads) % seq;
  const int64_t b = row / (heads * seq);
  float v[8];
  if (valid) {
    const Vec8 xv = reinterpret_cast<const Vec8*>(x + (b * seq + s) * x_token_stride + h * kHeadDim)[sub];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = __bfloat162float(xv.v[j]);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = 0.f;
  }
  if (weight != nullptr) {
    float squares = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) squares += v[j] * v[j];
#pragma unroll
    for (int offset = kLanes / 2; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const float r = 1.f / sqrtf(squares / static_cast<float>(kHeadDim) + eps);
    const Vec8 wv = reinterpret_cast<const Vec8*>(weight)[sub];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = Round(Round(v[j] * r) * __bfloat162float(wv.v[j]));
  }
  if (!valid) return;
  const int64_t table_row = ((cs_batch == 1 ? 0 : b) * cs_seq + s + table_offset) * (kHeadDim / 2);
  const float4 c = reinterpret_cast<const float4*>(cos + table_row)[sub];
  const float4 sn = reinterpret_cast<const float4*>(sin + table_row)[sub];
  const float cs[4] = {c.x, c.y, c.z, c.w}, ss[4] = {sn.x, sn.y, sn.z, sn.w};
  Vec8 result;
#pragma unroll
  for (int p = 0; p < 4; ++p) {
    const float e = v[2 * p], o = v[2 * p + 1];
    result.v[2 * p] = __float2bfloat16_rn(e * cs[p] - o * ss[p]);
    result.v[2 * p + 1] = __float2bfloat16_rn(o * cs[p] + e * ss[p]);
  }
  reinterpret_cast<Vec8*>(out + ((b * out_seq + s + out_seq_offset) * heads + h) * kHeadDim)[sub] = result;
}

// LayerNorm (no affine) and modulation of the block's row (blockIdx.x) of x, read into `vals`:
// afterwards vals[i][j] is the bfloat16 output value (as a float). The one formula of
// LayerNormModulateKernel and its FP8 form.
__device__ __forceinline__ void LayerNormModulateRow(const bf16* __restrict__ x, const bf16* __restrict__ scale,
                                                     int64_t scale_batch_stride, const bf16* __restrict__ shift,
                                                     int64_t shift_batch_stride, int64_t rows_per_batch, int dim,
                                                     float eps, float (&vals)[kMaxChunks][8], float* shared) {
  const int64_t row = blockIdx.x;
  const int64_t b = row / rows_per_batch;
  const int chunks = dim / 8;
  const Vec8* sc = reinterpret_cast<const Vec8*>(scale + b * scale_batch_stride);
  const Vec8* sh = reinterpret_cast<const Vec8*>(shift + b * shift_batch_stride);
  LoadRow(x + row * dim, chunks, vals);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
#pragma unroll
    for (int j = 0; j < 8; ++j) sum += vals[i][j];
  }
  const float mean = BlockReduce<false>(sum, shared) / static_cast<float>(dim);
  float centred = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    if (threadIdx.x + i * kRowThreads >= chunks) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float d = vals[i][j] - mean;
      centred += d * d;
    }
  }
  const float rstd = 1.f / sqrtf(BlockReduce<false>(centred, shared) / static_cast<float>(dim) + eps);
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kRowThreads;
    if (c >= chunks) continue;
    const Vec8 s = sc[c], t = sh[c];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float l = Round((vals[i][j] - mean) * rstd);
      vals[i][j] = Round(Round(l * __bfloat162float(s.v[j])) + __bfloat162float(t.v[j]));
    }
  }
}

__global__ void __launch_bounds__(kRowThreads) LayerNormModulateKernel(
    const bf16* __restrict__ x, const bf16* __restrict__ scale, int64_t scale_batch_stride,
    const bf16* __restrict__ shift, int64_t shift_batch_stride, bf16* __restrict__ out, int64_t rows_per_batch,
    int dim, float eps) {
  __shared__ float shared[33];
  const int64_t row = blockIdx.x;
  const int chunks = dim / 8;
  float vals[kMaxChunks][8];
  LayerNormModulateRow(x, scale, scale_batch_stride, shift, shift_batch_stride, rows_per_batch, dim, eps, vals,
                       shared);
  Vec8* o = reinterpret_cast<Vec8*>(out + row * dim);
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kRowThreads;
    if (c >= chunks) continue;
    Vec8 result;
#pragma unroll
    for (int j = 0; j < 8; ++j) result.v[j] = __float2bfloat16_rn(vals[i][j]);
    o[c] = result;
  }
}

__global__ void SiluMulKernel(const bf16* __restrict__ a, int64_t a_row_stride, const bf16* __restrict__ b,
                              int64_t b_row_stride, bf16* __restrict__ out, int64_t chunks, int64_t row_chunks) {
  Vec8* ov = reinterpret_cast<Vec8*>(out);
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = c / row_chunks, col = c % row_chunks;
    const Vec8 x = reinterpret_cast<const Vec8*>(a + row * a_row_stride)[col];
    const Vec8 y = reinterpret_cast<const Vec8*>(b + row * b_row_stride)[col];
    Vec8 result;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float v = __bfloat162float(x.v[j]);
      result.v[j] = __float2bfloat16_rn(Round(v / (1.f + expf(-v))) * __bfloat162float(y.v[j]));
    }
    ov[c] = result;
  }
}

// gelu_tanh(f) rounded to bfloat16: the one formula of GeluTanh and the fused GELU quantisation,
// so the two round identically. 0.5·f·(1 + tanh(u)) is f·sigmoid(2u) = f / (1 + e^(-2u)): one fast
// exponential and one fast division instead of tanhf's polynomial (whose cost kept the fused GELU
// quantisation of Flux's feed-forwards below the memory bandwidth); their few-ulp float error is far
// below bfloat16's rounding. The limits hold: e^(-2u) overflows to inf for very negative f, and
// f / inf is 0; it underflows to 0 for very positive f, giving f.
__device__ __forceinline__ bf16 GeluTanhBf16(float f) {
  const float two_u = 1.5957691216057308f * (f + 0.044715f * f * f * f);
  return __float2bfloat16_rn(__fdividef(f, 1.f + __expf(-two_u)));
}

// Packs 8 floats (already divided by the row's scale) into 8 e4m3 bytes.
__device__ __forceinline__ uint2 PackFp8(const float (&v)[8]) {
  __nv_fp8_storage_t bytes[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) bytes[j] = __nv_cvt_float_to_fp8(v[j], __NV_SATFINITE, __NV_E4M3);
  uint2 packed;
  packed.x = bytes[0] | (bytes[1] << 8) | (bytes[2] << 16) | (static_cast<uint32_t>(bytes[3]) << 24);
  packed.y = bytes[4] | (bytes[5] << 8) | (bytes[6] << 16) | (static_cast<uint32_t>(bytes[7]) << 24);
  return packed;
}

// One block of kQuantThreads per row, two passes over the row (the second reads it from L1/L2):
// rows of any length that is a multiple of 8 (FP8 GEMM inputs reach 15360 values).
constexpr int kQuantThreads = 256;

__global__ void __launch_bounds__(kQuantThreads) QuantizeRowsFp8Kernel(const bf16* __restrict__ x,
                                                                       __nv_fp8_storage_t* __restrict__ q,
                                                                       float* __restrict__ scale, int dim) {
  __shared__ float shared[33];
  const int64_t row = blockIdx.x;
  const int chunks = dim / 8;
  const Vec8* xr = reinterpret_cast<const Vec8*>(x + row * dim);
  float amax = 0.f;
  for (int c = threadIdx.x; c < chunks; c += kQuantThreads) {
    const Vec8 v = xr[c];
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(__bfloat162float(v.v[j])));
  }
  amax = BlockReduce<true, kQuantThreads>(amax, shared);
  const float s = amax > 0.f ? amax / 448.f : 1.f;
  if (threadIdx.x == 0) scale[row] = s;
  const float inv = 1.f / s;
  uint2* o = reinterpret_cast<uint2*>(q + row * dim);
  for (int c = threadIdx.x; c < chunks; c += kQuantThreads) {
    const Vec8 v = xr[c];
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = __bfloat162float(v.v[j]) * inv;
    o[c] = PackFp8(f);
  }
}

// LayerNormModulateKernel's row quantised as QuantizeRowsFp8Kernel quantises it (its max |value|
// over the bfloat16 outputs, the same scale and division): the bfloat16 row is never written.
__global__ void __launch_bounds__(kRowThreads) LayerNormModulateFp8Kernel(
    const bf16* __restrict__ x, const bf16* __restrict__ scale, int64_t scale_batch_stride,
    const bf16* __restrict__ shift, int64_t shift_batch_stride, __nv_fp8_storage_t* __restrict__ q,
    float* __restrict__ q_scale, int64_t rows_per_batch, int dim, float eps) {
  __shared__ float shared[33];
  const int64_t row = blockIdx.x;
  const int chunks = dim / 8;
  float vals[kMaxChunks][8];
  LayerNormModulateRow(x, scale, scale_batch_stride, shift, shift_batch_stride, rows_per_batch, dim, eps, vals,
                       shared);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    if (threadIdx.x + i * kRowThreads >= chunks) continue;
#pragma unroll
    for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(vals[i][j]));
  }
  amax = BlockReduce<true>(amax, shared);
  const float sc = amax > 0.f ? amax / 448.f : 1.f;
  if (threadIdx.x == 0) q_scale[row] = sc;
  const float inv = 1.f / sc;
  uint2* o = reinterpret_cast<uint2*>(q + row * dim);
#pragma unroll
  for (int i = 0; i < kMaxChunks; ++i) {
    const int c = threadIdx.x + i * kRowThreads;
    if (c >= chunks) continue;
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = vals[i][j] * inv;
    o[c] = PackFp8(f);
  }
}

struct QuantParts {
  QuantPart p[kMaxQuantParts];
  int n;
};

// One block per row: the row's parts are read once (GELU applied where asked, rounded to bfloat16)
// into shared memory while the block finds the row's max |value|, then written as FP8 from there.
// Dynamic shared memory: the row's bfloat16 values (dim · 2 bytes).
__global__ void __launch_bounds__(kQuantThreads) QuantizeConcatRowsFp8Kernel(QuantParts parts,
                                                                             __nv_fp8_storage_t* __restrict__ q,
                                                                             float* __restrict__ scale, int64_t seq,
                                                                             int dim) {
  extern __shared__ Vec8 row_values[];
  __shared__ float shared[33];
  const int64_t row = blockIdx.x;
  const int64_t b = row / seq, s = row % seq;
  float amax = 0.f;
  int base = 0;
  for (int p = 0; p < parts.n; ++p) {
    const QuantPart part = parts.p[p];
    const Vec8* xr = reinterpret_cast<const Vec8*>(static_cast<const bf16*>(part.x) + b * part.rows.batch_stride +
                                                   s * part.rows.row_stride);
    const int chunks = static_cast<int>(part.cols / 8);
    for (int c = threadIdx.x; c < chunks; c += kQuantThreads) {
      Vec8 v = xr[c];
      if (part.gelu) {
#pragma unroll
        for (int j = 0; j < 8; ++j) v.v[j] = GeluTanhBf16(__bfloat162float(v.v[j]));
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) amax = fmaxf(amax, fabsf(__bfloat162float(v.v[j])));
      row_values[base + c] = v;
    }
    base += chunks;
  }
  amax = BlockReduce<true, kQuantThreads>(amax, shared);  // Its barriers also publish row_values.
  const float sc = amax > 0.f ? amax / 448.f : 1.f;
  if (threadIdx.x == 0) scale[row] = sc;
  const float inv = 1.f / sc;
  uint2* o = reinterpret_cast<uint2*>(q + row * dim);
  for (int c = threadIdx.x; c < dim / 8; c += kQuantThreads) {
    const Vec8 v = row_values[c];
    float f[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) f[j] = __bfloat162float(v.v[j]) * inv;
    o[c] = PackFp8(f);
  }
}

enum class RowOp { kGelu, kCopy };

template <RowOp kOp>
__global__ void RowsKernel(const bf16* __restrict__ x, Rows xr, bf16* __restrict__ out, Rows outr, int64_t seq,
                           int64_t chunks, int64_t row_chunks) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = c / row_chunks, col = c % row_chunks;
    const int64_t b = row / seq, s = row % seq;
    const Vec8 v = reinterpret_cast<const Vec8*>(x + b * xr.batch_stride + s * xr.row_stride)[col];
    Vec8 result;
    if constexpr (kOp == RowOp::kCopy) {
      result = v;
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) result.v[j] = GeluTanhBf16(__bfloat162float(v.v[j]));
    }
    reinterpret_cast<Vec8*>(out + b * outr.batch_stride + s * outr.row_stride)[col] = result;
  }
}

__global__ void GatedAddKernel(const bf16* __restrict__ x, const bf16* __restrict__ gate, int64_t gate_batch_stride,
                               const bf16* __restrict__ y, bf16* __restrict__ out, int64_t seq, int64_t chunks,
                               int64_t row_chunks) {
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t row = c / row_chunks, col = c % row_chunks;
    const int64_t b = row / seq;
    const Vec8 xv = reinterpret_cast<const Vec8*>(x)[c], yv = reinterpret_cast<const Vec8*>(y)[c];
    const Vec8 g = reinterpret_cast<const Vec8*>(gate + b * gate_batch_stride)[col];
    Vec8 result;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      result.v[j] = __float2bfloat16_rn(__bfloat162float(xv.v[j]) +
                                        __bfloat162float(g.v[j]) * __bfloat162float(yv.v[j]));
    }
    reinterpret_cast<Vec8*>(out)[c] = result;
  }
}

int64_t GridFor(int64_t chunks, int threads) { return std::min<int64_t>((chunks + threads - 1) / threads, 132 * 16); }

bool RowsOk(Rows r, int64_t cols) { return cols % 8 == 0 && r.batch_stride % 8 == 0 && r.row_stride % 8 == 0; }

int LastError() { return static_cast<int>(cudaGetLastError()); }

bool RowFits(int64_t dim) { return dim % 8 == 0 && dim / 8 <= static_cast<int64_t>(kRowThreads) * kMaxChunks; }

}  // namespace

int RmsNorm(const void* x, const void* weight, const void* scale, int64_t scale_batch_stride,
            const void* residual, const void* gate, int64_t gate_batch_stride, void* out, int64_t rows,
            int64_t rows_per_batch, int64_t dim, float eps, void* stream) {
  if (!RowFits(dim) || rows <= 0 || rows_per_batch <= 0) return static_cast<int>(cudaErrorInvalidValue);
  const auto s = static_cast<cudaStream_t>(stream);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(weight);
  const auto* sb = static_cast<const bf16*>(scale);
  const auto* rb = static_cast<const bf16*>(residual);
  const auto* gb = static_cast<const bf16*>(gate);
  auto* ob = static_cast<bf16*>(out);
  const int d = static_cast<int>(dim);
  const dim3 grid(static_cast<unsigned>(rows));
  const bool gated = residual != nullptr && gate != nullptr;
  if (scale != nullptr && gated) {
    RmsNormKernel<true, true><<<grid, kRowThreads, 0, s>>>(xb, wb, sb, scale_batch_stride, rb, gb, gate_batch_stride,
                                                           ob, rows_per_batch, d, eps);
  } else if (scale != nullptr) {
    RmsNormKernel<true, false><<<grid, kRowThreads, 0, s>>>(xb, wb, sb, scale_batch_stride, nullptr, nullptr, 0, ob,
                                                            rows_per_batch, d, eps);
  } else if (gated) {
    RmsNormKernel<false, true><<<grid, kRowThreads, 0, s>>>(xb, wb, nullptr, 0, rb, gb, gate_batch_stride, ob,
                                                            rows_per_batch, d, eps);
  } else {
    RmsNormKernel<false, false><<<grid, kRowThreads, 0, s>>>(xb, wb, nullptr, 0, nullptr, nullptr, 0, ob,
                                                             rows_per_batch, d, eps);
  }
  return LastError();
}

int RmsNormRope(const void* x, int64_t x_token_stride, const void* weight, const float* cos, const float* sin,
                int64_t cs_batch, int64_t cs_seq, int64_t table_offset, void* out, int64_t batch, int64_t seq,
                int64_t heads, int64_t head_dim, int64_t out_seq, int64_t out_seq_offset, float eps, void* stream) {
  if (head_dim % 2 != 0 || head_dim / 2 > 32 * kMaxPairs || batch <= 0 || seq <= 0 || heads <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t rows = batch * seq * heads;
  constexpr int kThreads = 256;
  const auto st = static_cast<cudaStream_t>(stream);
  const auto* xb = static_cast<const bf16*>(x);
  const auto* wb = static_cast<const bf16*>(weight);
  auto* ob = static_cast<bf16*>(out);
  // 16-byte rows need 16-byte aligned tensors (the tables' rows are then 16-byte aligned too).
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(out) |
                        reinterpret_cast<uintptr_t>(weight) | reinterpret_cast<uintptr_t>(cos) |
                        reinterpret_cast<uintptr_t>(sin)) % 16 == 0 &&
                       x_token_stride % 8 == 0;
  auto vec = [&](auto lanes) {
    constexpr int kLanes = decltype(lanes)::value;
    const int64_t blocks = (rows * kLanes + kThreads - 1) / kThreads;
    RmsNormRopeVecKernel<kLanes><<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, st>>>(
        xb, x_token_stride, wb, cos, sin, cs_batch, cs_seq, table_offset, ob, rows, seq, heads, out_seq,
        out_seq_offset, eps);
  };
  if (aligned && head_dim == 128) {
    vec(std::integral_constant<int, 16>());
  } else if (aligned && head_dim == 64) {
    vec(std::integral_constant<int, 8>());
  } else if (aligned && head_dim == 256) {
    vec(std::integral_constant<int, 32>());
  } else {
    const int64_t rows_per_block = kThreads / 32;
    const dim3 grid(static_cast<unsigned>((rows + rows_per_block - 1) / rows_per_block));
    RmsNormRopeKernel<<<grid, kThreads, 0, st>>>(xb, x_token_stride, wb, cos, sin, cs_batch, cs_seq, table_offset, ob,
                                                 rows, seq, heads, static_cast<int>(head_dim), out_seq, out_seq_offset,
                                                 eps);
  }
  return LastError();
}

int LayerNormModulate(const void* x, const void* scale, int64_t scale_batch_stride, const void* shift,
                      int64_t shift_batch_stride, void* out, int64_t rows, int64_t rows_per_batch, int64_t dim,
                      float eps, void* stream) {
  if (!RowFits(dim) || rows <= 0 || rows_per_batch <= 0) return static_cast<int>(cudaErrorInvalidValue);
  LayerNormModulateKernel<<<dim3(static_cast<unsigned>(rows)), kRowThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), static_cast<const bf16*>(scale), scale_batch_stride,
      static_cast<const bf16*>(shift), shift_batch_stride, static_cast<bf16*>(out), rows_per_batch,
      static_cast<int>(dim), eps);
  return LastError();
}

int LayerNormModulateFp8(const void* x, const void* scale, int64_t scale_batch_stride, const void* shift,
                         int64_t shift_batch_stride, void* q, float* q_scale, int64_t rows, int64_t rows_per_batch,
                         int64_t dim, float eps, void* stream) {
  if (!RowFits(dim) || rows <= 0 || rows_per_batch <= 0) return static_cast<int>(cudaErrorInvalidValue);
  LayerNormModulateFp8Kernel<<<dim3(static_cast<unsigned>(rows)), kRowThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), static_cast<const bf16*>(scale), scale_batch_stride,
      static_cast<const bf16*>(shift), shift_batch_stride, static_cast<__nv_fp8_storage_t*>(q), q_scale,
      rows_per_batch, static_cast<int>(dim), eps);
  return LastError();
}

int SiluMul(const void* a, int64_t a_row_stride, const void* b, int64_t b_row_stride, void* out, int64_t rows,
            int64_t cols, void* stream) {
  if (cols % 8 != 0 || cols <= 0 || rows <= 0 || a_row_stride % 8 != 0 || b_row_stride % 8 != 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t chunks = rows * cols / 8;
  constexpr int kThreads = 256;
  const int64_t blocks = std::min<int64_t>((chunks + kThreads - 1) / kThreads, 132 * 16);
  SiluMulKernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(a), a_row_stride, static_cast<const bf16*>(b), b_row_stride, static_cast<bf16*>(out),
      chunks, cols / 8);
  return LastError();
}

int QuantizeConcatRowsFp8(const QuantPart* parts, int num_parts, void* q, float* scale, int64_t batch, int64_t seq,
                          void* stream) {
  if (num_parts <= 0 || num_parts > kMaxQuantParts || batch <= 0 || seq <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  QuantParts packed{};
  int64_t dim = 0;
  for (int p = 0; p < num_parts; ++p) {
    const QuantPart& part = parts[p];
    if (part.cols <= 0 || !RowsOk(part.rows, part.cols) || reinterpret_cast<uintptr_t>(part.x) % 16 != 0) {
      return static_cast<int>(cudaErrorInvalidValue);
    }
    packed.p[p] = part;
    dim += part.cols;
  }
  packed.n = num_parts;
  if (dim > kMaxQuantConcatDim) return static_cast<int>(cudaErrorInvalidValue);
  QuantizeConcatRowsFp8Kernel<<<dim3(static_cast<unsigned>(batch * seq)), kQuantThreads,
                                static_cast<size_t>(dim) * sizeof(bf16), static_cast<cudaStream_t>(stream)>>>(
      packed, static_cast<__nv_fp8_storage_t*>(q), scale, seq, static_cast<int>(dim));
  return LastError();
}

int QuantizeRowsFp8(const void* x, void* q, float* scale, int64_t rows, int64_t dim, void* stream) {
  if (dim % 8 != 0 || dim <= 0 || rows <= 0) return static_cast<int>(cudaErrorInvalidValue);
  QuantizeRowsFp8Kernel<<<dim3(static_cast<unsigned>(rows)), kQuantThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), static_cast<__nv_fp8_storage_t*>(q), scale, static_cast<int>(dim));
  return LastError();
}

namespace {

template <RowOp kOp>
int LaunchRows(const void* x, Rows x_rows, void* out, Rows out_rows, int64_t batch, int64_t seq, int64_t cols,
               void* stream) {
  if (!RowsOk(x_rows, cols) || !RowsOk(out_rows, cols) || batch <= 0 || seq <= 0 || cols <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t chunks = batch * seq * cols / 8;
  RowsKernel<kOp><<<dim3(static_cast<unsigned>(GridFor(chunks, 256))), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), x_rows, static_cast<bf16*>(out), out_rows, seq, chunks, cols / 8);
  return LastError();
}

}  // namespace

int GeluTanh(const void* x, Rows x_rows, void* out, Rows out_rows, int64_t batch, int64_t seq, int64_t cols,
             void* stream) {
  return LaunchRows<RowOp::kGelu>(x, x_rows, out, out_rows, batch, seq, cols, stream);
}

int CopyRows(const void* x, Rows x_rows, void* out, Rows out_rows, int64_t batch, int64_t seq, int64_t cols,
             void* stream) {
  return LaunchRows<RowOp::kCopy>(x, x_rows, out, out_rows, batch, seq, cols, stream);
}

int GatedAdd(const void* x, const void* gate, int64_t gate_batch_stride, const void* y, void* out, int64_t batch,
             int64_t seq, int64_t cols, void* stream) {
  if (cols % 8 != 0 || gate_batch_stride % 8 != 0 || batch <= 0 || seq <= 0 || cols <= 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const int64_t chunks = batch * seq * cols / 8;
  GatedAddKernel<<<dim3(static_cast<unsigned>(GridFor(chunks, 256))), 256, 0, static_cast<cudaStream_t>(stream)>>>(
      static_cast<const bf16*>(x), static_cast<const bf16*>(gate), gate_batch_stride, static_cast<const bf16*>(y),
      static_cast<bf16*>(out), seq, chunks, cols / 8);
  return LastError();
}

}  // namespace stowage::fused_cuda
