// The compression kernels behind widen_kernels.h (built for sm_90 in CUDA builds only).
//
// Memory-bound: each thread of the vector path reads 8 compressed values (8 bytes, or 4 for int4)
// and their scale, and writes 8 outputs with 16-byte stores; a scalar path takes any alignment and
// group size.
#include "offload/widen_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace stowage::widen_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 16384;

// The e4m3fn value of a byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m · 2^-9); S.1111.111 is NaN (no infinities).
__device__ __forceinline__ float DecodeE4M3(uint32_t bits) {
  const uint32_t sign = (bits & 0x80u) << 24;
  const uint32_t exp = (bits >> 3) & 0xFu;
  const uint32_t mant = bits & 0x7u;
  if (exp == 0xFu && mant == 0x7u) return __uint_as_float(sign | 0x7FC00000u);
  if (exp == 0) return __uint_as_float(sign | __float_as_uint(static_cast<float>(mant) * 0.001953125f));
  return __uint_as_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

template <Codes C>
__device__ __forceinline__ float ValueAt(const uint8_t* q, int64_t e) {
  if constexpr (C == Codes::kInt8) {
    return static_cast<float>(static_cast<int8_t>(q[e]));
  } else if constexpr (C == Codes::kFp8E4M3) {
    return DecodeE4M3(q[e]);
  } else {
    return static_cast<float>(static_cast<int>((q[e >> 1] >> ((e & 1) * 4)) & 0xF) - 8);
  }
}

template <bool kBf16>
__device__ __forceinline__ float ScaleAt(const void* scale, int64_t g) {
  if constexpr (kBf16) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(scale)[g]);
  } else {
    return static_cast<const float*>(scale)[g];
  }
}

template <typename Out>
__device__ __forceinline__ Out Round(float v) {
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else if constexpr (std::is_same_v<Out, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<Out, uint8_t>) {  // e4m3fn bits.
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(v, __NV_SATFINITE, __NV_E4M3));
  } else {
    return v;
  }
}

// Eight 2-byte outputs: one 16-byte store.
template <typename Out>
struct alignas(16) Pack8 {
  Out v[8];
};

template <Codes C, typename Out, bool kBf16>
__global__ void WidenScalar(const uint8_t* q, const void* scale, Out* out, int64_t total, int64_t group) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[e] = Round<Out>(ValueAt<C>(q, e) * ScaleAt<kBf16>(scale, e / group));
  }
}

// Eight values starting at a multiple of 8 (one scale: the group size is a multiple of 8).
template <Codes C, typename Out, bool kBf16>
__global__ void WidenVector(const uint8_t* q, const void* scale, Out* out, int64_t chunks, int64_t group) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e0 = i * 8;
    const float s = ScaleAt<kBf16>(scale, e0 / group);
    float v[8];
    if constexpr (C == Codes::kInt4) {
      const uint32_t word = reinterpret_cast<const uint32_t*>(q)[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(static_cast<int>((word >> (4 * j)) & 0xF) - 8);
    } else {
      const uint2 bytes = reinterpret_cast<const uint2*>(q)[i];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t b = ((j < 4 ? bytes.x : bytes.y) >> (8 * (j % 4))) & 0xFFu;
        if constexpr (C == Codes::kInt8) {
          v[j] = static_cast<float>(static_cast<int8_t>(b));
        } else {
          v[j] = DecodeE4M3(b);
        }
      }
    }
    if constexpr (std::is_same_v<Out, float>) {
      float4* dst = reinterpret_cast<float4*>(out + e0);
      dst[0] = make_float4(v[0] * s, v[1] * s, v[2] * s, v[3] * s);
      dst[1] = make_float4(v[4] * s, v[5] * s, v[6] * s, v[7] * s);
    } else if constexpr (std::is_same_v<Out, uint8_t>) {  // Eight e4m3 bytes: one 8-byte store.
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo |= static_cast<uint32_t>(Round<Out>(v[j] * s)) << (8 * j);
        hi |= static_cast<uint32_t>(Round<Out>(v[j + 4] * s)) << (8 * j);
      }
      *reinterpret_cast<uint2*>(out + e0) = make_uint2(lo, hi);
    } else {
      Pack8<Out> result;
#pragma unroll
      for (int j = 0; j < 8; ++j) result.v[j] = Round<Out>(v[j] * s);
      *reinterpret_cast<Pack8<Out>*>(out + e0) = result;
    }
  }
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

template <Codes C, typename Out, bool kBf16>
int Launch(const void* q, const void* scale, void* out, int64_t total, int64_t group, cudaStream_t stream) {
  const auto* qb = static_cast<const uint8_t*>(q);
  auto* o = static_cast<Out*>(out);
  const bool vector = total % 8 == 0 && group % 8 == 0 && Aligned(out, 16) &&
                      Aligned(q, C == Codes::kInt4 ? 4 : 8);
  const int64_t work = vector ? total / 8 : total;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (work + kThreads - 1) / kThreads));
  if (vector) {
    WidenVector<C, Out, kBf16><<<blocks, kThreads, 0, stream>>>(qb, scale, o, work, group);
  } else {
    WidenScalar<C, Out, kBf16><<<blocks, kThreads, 0, stream>>>(qb, scale, o, work, group);
  }
  return static_cast<int>(cudaGetLastError());
}

template <Codes C, bool kBf16>
int ForOut(const void* q, const void* scale, void* out, OutType out_type, int64_t total, int64_t group,
           cudaStream_t stream) {
  switch (out_type) {
    case OutType::kBFloat16:
      return Launch<C, __nv_bfloat16, kBf16>(q, scale, out, total, group, stream);
    case OutType::kHalf:
      return Launch<C, __half, kBf16>(q, scale, out, total, group, stream);
    case OutType::kFp8E4M3:
      return Launch<C, uint8_t, kBf16>(q, scale, out, total, group, stream);
    case OutType::kFloat:
      break;
  }
  return Launch<C, float, kBf16>(q, scale, out, total, group, stream);
}

__global__ void EncodeE4M3Kernel(const float* x, uint8_t* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float f = x[i];
    const uint8_t sign = signbit(f) ? 0x80 : 0x00;
    if (isnan(f)) {
      out[i] = sign | 0x7F;
      continue;
    }
    const float a = fabsf(f);
    if (a >= 448.0f) {
      out[i] = sign | 0x7E;
      continue;
    }
    int e = 0;
    (void)frexpf(a, &e);  // a = m · 2^e, m in [0.5, 1).
    const int exponent = e - 1;
    if (a == 0.0f || exponent < -6) {  // Subnormal: k · 2^-9, k in 0..8.
      out[i] = sign | static_cast<uint8_t>(static_cast<int>(rintf(ldexpf(a, 9))));
      continue;
    }
    int mantissa = static_cast<int>(rintf(ldexpf(a, 3 - exponent)));  // In [8, 16].
    int biased = exponent + 7;
    if (mantissa == 16) {
      mantissa = 8;
      ++biased;
    }
    out[i] = sign | static_cast<uint8_t>((biased << 3) | (mantissa - 8));
  }
}

}  // namespace

int EncodeE4M3(const float* x, uint8_t* out, int64_t n, void* stream) {
  if (n <= 0) return 0;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
  EncodeE4M3Kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, out, n);
  return static_cast<int>(cudaGetLastError());
}

int Widen(Codes codes, const void* q, const void* scale, bool scale_bf16, void* out, OutType out_type,
          int64_t channels, int64_t k, int64_t group_size, void* stream) {
  const int64_t total = channels * k;
  if (total <= 0) return 0;
  if (group_size <= 0 || k % group_size != 0) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  switch (codes) {
    case Codes::kInt8:
      return scale_bf16 ? ForOut<Codes::kInt8, true>(q, scale, out, out_type, total, group_size, s)
                        : ForOut<Codes::kInt8, false>(q, scale, out, out_type, total, group_size, s);
    case Codes::kFp8E4M3:
      return scale_bf16 ? ForOut<Codes::kFp8E4M3, true>(q, scale, out, out_type, total, group_size, s)
                        : ForOut<Codes::kFp8E4M3, false>(q, scale, out, out_type, total, group_size, s);
    case Codes::kInt4:
      break;
  }
  return scale_bf16 ? ForOut<Codes::kInt4, true>(q, scale, out, out_type, total, group_size, s)
                    : ForOut<Codes::kInt4, false>(q, scale, out, out_type, total, group_size, s);
}

}  // namespace stowage::widen_cuda
