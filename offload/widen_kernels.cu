// The compression kernels behind widen_kernels.h (built for sm_90 in CUDA builds only).
//
// Memory-bound: each thread of the vector path reads 16 bytes of codes (32 int4 values, 16 of an
// 8-bit format; 8 values where the layout allows no more) and their scales, and writes its outputs
// with 16-byte stores. Codes become floats without the conversion unit (Unbias) and outputs are
// rounded two at a time, so the instruction count stays under the memory time. A scalar path takes
// any alignment and group size.
#include "offload/widen_kernels.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

namespace stowage::widen_cuda {
namespace {

// -1 until the first read (then STOWAGE_WIDEN_LAYOUT's choice), else a Layout.
std::atomic<int> g_layout{-1};

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 16384;

// 2^23 + m as a float holds m in its mantissa: subtracting 2^23 + bias gives m − bias exactly, with two
// full-rate instructions instead of the integer-to-float conversion unit.
__device__ __forceinline__ float Unbias(uint32_t m, float two23_plus_bias) {
  return __uint_as_float(0x4B000000u | m) - two23_plus_bias;
}

// The e4m3fn value of a byte: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 is
// subnormal (m · 2^-9); S.1111.111 is NaN (no infinities).
__device__ __forceinline__ float DecodeE4M3(uint32_t bits) {
  const uint32_t sign = (bits & 0x80u) << 24;
  const uint32_t exp = (bits >> 3) & 0xFu;
  const uint32_t mant = bits & 0x7u;
  if (exp == 0xFu && mant == 0x7u) return __uint_as_float(sign | 0x7FC00000u);
  if (exp == 0) return __uint_as_float(sign | __float_as_uint(Unbias(mant, 8388608.0f) * 0.001953125f));
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

// The scales as the kernels read them: `p` the buffer; for kE4M3Rows, `channels` fp32 row scales
// then the codes, `groups_per_row` codes a row, and `row_magic` ceil(2^64 / groups_per_row) (0 when
// groups_per_row is 1 or not below 2^32): RowOf divides by multiplying with it.
struct Scales {
  const void* p;
  int64_t channels;
  int64_t groups_per_row;
  uint64_t row_magic;
};

// The host's Scales of a weight whose scales are `p`.
Scales ScalesOf(const void* p, int64_t channels, int64_t groups_per_row) {
  return Scales{p, channels, groups_per_row, RowMagic(groups_per_row)};
}

// The row of group g: g / groups_per_row. For g < 2^32 by one 64-bit multiply-high with row_magic
// (widen_kernels.h's RowMagic), instead of the 32-bit division a chunk it replaces (the GPU has no
// divide instruction: the compiler emits a reciprocal-and-correct sequence).
__device__ __forceinline__ int64_t RowOf(const Scales& scales, int64_t g) {
  if (g <= 0xFFFFFFFFll) {
    if (scales.groups_per_row == 1) return g;
    if (scales.row_magic != 0) return static_cast<int64_t>(__umul64hi(scales.row_magic, static_cast<uint64_t>(g)));
  }
  return g / scales.groups_per_row;
}

template <ScaleKind S>
__device__ __forceinline__ float ScaleAt(const Scales& scales, int64_t g) {
  if constexpr (S == ScaleKind::kFloat) {
    return static_cast<const float*>(scales.p)[g];
  } else {
    const auto* rows = static_cast<const float*>(scales.p);
    const uint8_t* codes = static_cast<const uint8_t*>(scales.p) + 4 * scales.channels;
    return __fmul_rn(DecodeE4M3(codes[g]), rows[RowOf(scales, g)]);
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

// Two outputs rounded by one instruction, `lo` at the lower address: 2-byte types in 32 bits, e4m3
// bytes in 16 (PTX's cvt puts its first source in the upper half).
template <typename Out>
__device__ __forceinline__ uint32_t RoundPair(float lo, float hi) {
  uint32_t bits;
  if constexpr (std::is_same_v<Out, __nv_bfloat16>) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(hi), "f"(lo));
  } else if constexpr (std::is_same_v<Out, __half>) {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(hi), "f"(lo));
  } else {
    static_assert(std::is_same_v<Out, uint8_t>, "RoundPair: 2-byte outputs and e4m3 bytes");
    uint16_t pair;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pair) : "f"(hi), "f"(lo));
    bits = pair;
  }
  return bits;
}

// Eight widened values stored at `dst` (16-byte aligned; e4m3 bytes: 8-byte aligned) in one store
// (two for float).
template <typename Out>
__device__ __forceinline__ void StoreEight(Out* dst, const float v[8]) {
  if constexpr (std::is_same_v<Out, float>) {
    float4* d = reinterpret_cast<float4*>(dst);
    d[0] = make_float4(v[0], v[1], v[2], v[3]);
    d[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else if constexpr (std::is_same_v<Out, uint8_t>) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(RoundPair<Out>(v[0], v[1]) | (RoundPair<Out>(v[2], v[3]) << 16),
                                                RoundPair<Out>(v[4], v[5]) | (RoundPair<Out>(v[6], v[7]) << 16));
  } else {
    *reinterpret_cast<uint4*>(dst) = make_uint4(RoundPair<Out>(v[0], v[1]), RoundPair<Out>(v[2], v[3]),
                                                RoundPair<Out>(v[4], v[5]), RoundPair<Out>(v[6], v[7]));
  }
}

template <Codes C, typename Out, ScaleKind S>
__global__ void WidenScalar(const uint8_t* q, Scales scale, Out* out, int64_t total, int64_t group) {
  for (int64_t e = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[e] = Round<Out>(ValueAt<C>(q, e) * ScaleAt<S>(scale, e / group));
  }
}

// The bytes of kChunks chunks of eight codes (4 bytes of int4 or 8 of an 8-bit format each) in one
// load of 4, 8 or 16 bytes, as 32-bit words.
template <int kBytes>
struct Words {
  uint32_t w[kBytes / 4];
};

template <int kBytes>
__device__ __forceinline__ Words<kBytes> LoadWords(const uint8_t* p) {
  Words<kBytes> r;
  if constexpr (kBytes == 16) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    r.w[0] = v.x, r.w[1] = v.y, r.w[2] = v.z, r.w[3] = v.w;
  } else if constexpr (kBytes == 8) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    r.w[0] = v.x, r.w[1] = v.y;
  } else {
    r.w[0] = *reinterpret_cast<const uint32_t*>(p);
  }
  return r;
}

// The eight values of chunk c (before scaling).
template <Codes C, int kBytes>
__device__ __forceinline__ void DecodeChunk(const Words<kBytes>& words, int c, float v[8]) {
  if constexpr (C == Codes::kInt4) {
    const uint32_t word = words.w[c];
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = Unbias((word >> (4 * j)) & 0xFu, 8388616.0f);  // nibble − 8
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const uint32_t b = (words.w[2 * c + j / 4] >> (8 * (j % 4))) & 0xFFu;
      if constexpr (C == Codes::kInt8) {
        v[j] = Unbias(b ^ 0x80u, 8388736.0f);  // The byte as two's complement: (b ^ 0x80) − 128.
      } else {
        v[j] = DecodeE4M3(b);
      }
    }
  }
}

// Item i of a weight: kChunks chunks of eight values from the multiple i · 8 · kChunks, each chunk
// under one scale (the group size is a multiple of 8; `shift` is log2 of it when it is a power of
// two, else −1), written with 16-byte stores (e4m3 bytes: 8-byte stores for one chunk).
template <Codes C, typename Out, ScaleKind S, int kChunks>
__device__ __forceinline__ void WidenItem(const uint8_t* q, const Scales& scale, Out* out, int64_t i, int64_t group,
                                          int shift) {
  constexpr int kBytes = kChunks * (C == Codes::kInt4 ? 4 : 8);
  const Words<kBytes> words = LoadWords<kBytes>(q + i * kBytes);
  const int64_t e0 = i * 8 * kChunks;
  uint32_t fp8[2 * kChunks];  // e4m3 outputs: four bytes a word.
  // Chunks of one group share its scale: read (for int4, decoded) once per group, not per chunk.
  int64_t last_g = -1;
  float s = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t e = e0 + 8 * c;
    const int64_t g = shift >= 0 ? e >> shift : e / group;
    if (g != last_g) {
      s = ScaleAt<S>(scale, g);
      last_g = g;
    }
    float v[8];
    DecodeChunk<C, kBytes>(words, c, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= s;
    if constexpr (std::is_same_v<Out, uint8_t> && kChunks > 1) {
      fp8[2 * c] = RoundPair<Out>(v[0], v[1]) | (RoundPair<Out>(v[2], v[3]) << 16);
      fp8[2 * c + 1] = RoundPair<Out>(v[4], v[5]) | (RoundPair<Out>(v[6], v[7]) << 16);
    } else {
      StoreEight(out + e, v);
    }
  }
  if constexpr (std::is_same_v<Out, uint8_t> && kChunks > 1) {
#pragma unroll
    for (int c = 0; c < kChunks; c += 2) {
      reinterpret_cast<uint4*>(out + e0)[c / 2] = make_uint4(fp8[2 * c], fp8[2 * c + 1], fp8[2 * c + 2], fp8[2 * c + 3]);
    }
  }
}

template <Codes C, typename Out, ScaleKind S, int kChunks>
__global__ void WidenVector(const uint8_t* q, Scales scale, Out* out, int64_t items, int64_t group, int shift) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < items;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    WidenItem<C, Out, S, kChunks>(q, scale, out, i, group, shift);
  }
}

// The coalesced layout: a warp widens a tile of 32 · kChunks chunks of eight values, lane l the
// chunks l, l + 32, ... of it, so that each load instruction of the warp reads one contiguous span of
// codes (128 bytes of int4, 256 of an 8-bit format) and each store writes one (512 bytes of bf16):
// the strided layout above gives each thread 16 consecutive bytes of codes, so a warp's store
// instruction scatters 16-byte pieces at 64-byte strides. Every chunk reads its own scale. A tile may
// end past the weight (`chunks`: its chunks of eight); its lanes past the end do nothing.
template <Codes C, typename Out, ScaleKind S, int kChunks>
__device__ __forceinline__ void WidenTile(const uint8_t* q, const Scales& scale, Out* out, int64_t tile, int lane,
                                          int64_t chunks, int64_t group, int shift) {
  constexpr int kBytes = C == Codes::kInt4 ? 4 : 8;  // Codes of one chunk.
  const int64_t first = tile * 32 * kChunks + lane;
  Words<kBytes> words[kChunks];
  // Every load issued before any is used: kChunks loads in flight a thread.
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t chunk = first + 32 * c;
    words[c] = chunk < chunks ? LoadWords<kBytes>(q + chunk * kBytes) : Words<kBytes>{};
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int64_t chunk = first + 32 * c;
    if (chunk >= chunks) break;
    const int64_t e = chunk * 8;
    const float s = ScaleAt<S>(scale, shift >= 0 ? e >> shift : e / group);
    float v[8];
    DecodeChunk<C, kBytes>(words[c], 0, v);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] *= s;
    StoreEight(out + e, v);
  }
}

constexpr int kWarpsPerBlock = kThreads / 32;

// Tiles of 32 lanes · `chunks_a_lane` chunks that cover `chunks` chunks.
__host__ __device__ __forceinline__ int64_t TilesOf(int64_t chunks, int chunks_a_lane) {
  return (chunks + 32 * chunks_a_lane - 1) / (32 * chunks_a_lane);
}

template <Codes C, typename Out, ScaleKind S, int kChunks>
__global__ void WidenTiles(const uint8_t* q, Scales scale, Out* out, int64_t chunks, int64_t group, int shift) {
  const int64_t tiles = TilesOf(chunks, kChunks);
  const int lane = static_cast<int>(threadIdx.x % 32);
  for (int64_t tile = blockIdx.x * static_cast<int64_t>(kWarpsPerBlock) + threadIdx.x / 32; tile < tiles;
       tile += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock) {
    WidenTile<C, Out, S, kChunks>(q, scale, out, tile, lane, chunks, group, shift);
  }
}

// Several weights of one launch (WidenMany): block b widens for job j where first_block[j] <= b <
// first_block[j + 1], one item a thread (the blocks of a job cover its items: no grid-stride loop).
template <typename Out>
struct ManyJobs {
  int count;
  int64_t first_block[kWidenManyJobs + 1];
  const uint8_t* q[kWidenManyJobs];
  Scales scale[kWidenManyJobs];
  Out* out[kWidenManyJobs];
  int64_t items[kWidenManyJobs];
  int64_t group[kWidenManyJobs];
  int shift[kWidenManyJobs];
};

template <Codes C, typename Out, ScaleKind S, int kChunks>
__global__ void WidenVectorMany(const ManyJobs<Out> jobs) {
  const int64_t block = blockIdx.x;
  int j = 0;
  while (j + 1 < jobs.count && block >= jobs.first_block[j + 1]) ++j;
  const int64_t i = (block - jobs.first_block[j]) * blockDim.x + threadIdx.x;
  if (i < jobs.items[j]) WidenItem<C, Out, S, kChunks>(jobs.q[j], jobs.scale[j], jobs.out[j], i, jobs.group[j], jobs.shift[j]);
}

template <Codes C, typename Out, ScaleKind S, int kChunks>
__global__ void WidenTilesMany(const ManyJobs<Out> jobs) {
  const int64_t block = blockIdx.x;
  int j = 0;
  while (j + 1 < jobs.count && block >= jobs.first_block[j + 1]) ++j;
  const int64_t tile = (block - jobs.first_block[j]) * kWarpsPerBlock + threadIdx.x / 32;
  WidenTile<C, Out, S, kChunks>(jobs.q[j], jobs.scale[j], jobs.out[j], tile, static_cast<int>(threadIdx.x % 32),
                                jobs.items[j], jobs.group[j], jobs.shift[j]);
}

bool Aligned(const void* p, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(p) % bytes == 0; }

int ShiftOf(int64_t group) {
  for (int b = 0; b < 62; ++b) {
    if (group == (int64_t{1} << b)) return b;
  }
  return -1;
}

template <Codes C, typename Out, ScaleKind S, int kChunks>
void LaunchVector(const uint8_t* q, Scales scale, Out* out, int64_t total, int64_t group, cudaStream_t stream) {
  const int64_t items = total / (8 * kChunks);
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (items + kThreads - 1) / kThreads));
  WidenVector<C, Out, S, kChunks><<<blocks, kThreads, 0, stream>>>(q, scale, out, items, group, ShiftOf(group));
}

// Chunks of eight in 16 bytes of codes.
template <Codes C>
constexpr int WideChunks() {
  return C == Codes::kInt4 ? 4 : 2;
}

// The 16-byte path takes the weight: whole items, a scale a chunk, 16-byte aligned codes and output.
template <Codes C>
bool WideLayout(const void* q, const void* out, int64_t total, int64_t group) {
  return total % (8 * WideChunks<C>()) == 0 && group % 8 == 0 && Aligned(out, 16) && Aligned(q, 16);
}

// The coalesced tiles, and the strided kernel's eight values a thread, take the weight: whole chunks
// of eight under one scale each, a chunk's codes aligned to their size (4 bytes of int4, 8 of an 8-bit
// format) and the output to 16 bytes.
template <Codes C>
bool TileLayout(const void* q, const void* out, int64_t total, int64_t group) {
  return total % 8 == 0 && group % 8 == 0 && Aligned(out, 16) && Aligned(q, C == Codes::kInt4 ? 4 : 8);
}

// The widest path the layout allows: coalesced tiles (unless the strided layout is chosen), else 16
// bytes of codes a thread (32 int4 values, 16 of an 8-bit format), else eight values a thread, else
// the scalar kernel.
template <Codes C, typename Out, ScaleKind S>
int Launch(const void* q, Scales scale, void* out, int64_t total, int64_t group, cudaStream_t stream) {
  const auto* qb = static_cast<const uint8_t*>(q);
  auto* o = static_cast<Out*>(out);
  if (CurrentLayout() == Layout::kCoalesced && TileLayout<C>(q, out, total, group)) {
    constexpr int kChunks = WideChunks<C>();
    const int64_t chunks = total / 8;
    const auto blocks = static_cast<unsigned>(
        std::min<int64_t>(kMaxBlocks, (TilesOf(chunks, kChunks) + kWarpsPerBlock - 1) / kWarpsPerBlock));
    WidenTiles<C, Out, S, kChunks><<<blocks, kThreads, 0, stream>>>(qb, scale, o, chunks, group, ShiftOf(group));
  } else if (WideLayout<C>(q, out, total, group)) {
    LaunchVector<C, Out, S, WideChunks<C>()>(qb, scale, o, total, group, stream);
  } else if (TileLayout<C>(q, out, total, group)) {
    LaunchVector<C, Out, S, 1>(qb, scale, o, total, group, stream);
  } else {
    const auto blocks = static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (total + kThreads - 1) / kThreads));
    WidenScalar<C, Out, S><<<blocks, kThreads, 0, stream>>>(qb, scale, o, total, group);
  }
  return static_cast<int>(cudaGetLastError());
}

// Widen of every job: those the 16-byte path takes share launches of up to kWidenManyJobs weights,
// the others launch alone (Launch).
template <Codes C, typename Out, ScaleKind S>
int LaunchMany(const WidenJob* jobs, int count, cudaStream_t stream) {
  constexpr int kWide = WideChunks<C>();
  const bool tiles = CurrentLayout() == Layout::kCoalesced;
  ManyJobs<Out> many{};
  int err = 0;
  auto flush = [&] {
    if (many.count == 0) return;
    const int64_t blocks = many.first_block[many.count];
    if (tiles) {
      WidenTilesMany<C, Out, S, kWide><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(many);
    } else {
      WidenVectorMany<C, Out, S, kWide><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(many);
    }
    const int launched = static_cast<int>(cudaGetLastError());
    if (err == 0) err = launched;
    many.count = 0;
  };
  for (int n = 0; n < count; ++n) {
    const WidenJob& job = jobs[n];
    const int64_t total = job.channels * job.k;
    if (total <= 0) continue;
    const Scales scale = ScalesOf(job.scale, job.channels, job.k / job.group_size);
    if (tiles ? !TileLayout<C>(job.q, job.out, total, job.group_size)
              : !WideLayout<C>(job.q, job.out, total, job.group_size)) {
      const int alone = Launch<C, Out, S>(job.q, scale, job.out, total, job.group_size, stream);
      if (err == 0) err = alone;
      continue;
    }
    // Coalesced: a job's units are its chunks of eight, a block's its warps' tiles; strided: items of
    // kWide chunks, one a thread.
    const int64_t items = tiles ? total / 8 : total / (8 * kWide);
    const int64_t blocks = tiles ? (TilesOf(items, kWide) + kWarpsPerBlock - 1) / kWarpsPerBlock
                                 : (items + kThreads - 1) / kThreads;
    const int j = many.count++;
    many.q[j] = static_cast<const uint8_t*>(job.q);
    many.scale[j] = scale;
    many.out[j] = static_cast<Out*>(job.out);
    many.items[j] = items;
    many.group[j] = job.group_size;
    many.shift[j] = ShiftOf(job.group_size);
    many.first_block[j + 1] = many.first_block[j] + blocks;
    if (many.count == kWidenManyJobs) flush();
  }
  flush();
  return err;
}

template <typename T>
struct Type {
  using type = T;
};

// Calls fn(Type<Out>{}) with the output type's C++ type.
template <typename Fn>
int ForOut(OutType out_type, Fn&& fn) {
  switch (out_type) {
    case OutType::kBFloat16:
      return fn(Type<__nv_bfloat16>{});
    case OutType::kHalf:
      return fn(Type<__half>{});
    case OutType::kFp8E4M3:
      return fn(Type<uint8_t>{});
    case OutType::kFloat:
      break;
  }
  return fn(Type<float>{});
}

// Calls fn(Type<Out>{}, std::integral_constant<ScaleKind, S>{}) for the 8-bit formats' fp32 scales
// or int4's rows-and-codes (kE4M3Rows is int4's only).
template <Codes C, typename Fn>
int ForKinds(ScaleKind kind, OutType out_type, Fn&& fn) {
  if (kind == ScaleKind::kE4M3Rows) {
    if constexpr (C == Codes::kInt4) {
      return ForOut(out_type, [&](auto out) { return fn(out, std::integral_constant<ScaleKind, ScaleKind::kE4M3Rows>{}); });
    } else {
      return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  return ForOut(out_type, [&](auto out) { return fn(out, std::integral_constant<ScaleKind, ScaleKind::kFloat>{}); });
}

// Calls ForKinds<C> for the codes.
template <typename Fn>
int ForCodes(Codes codes, ScaleKind kind, OutType out_type, Fn&& fn) {
  switch (codes) {
    case Codes::kInt8:
      return ForKinds<Codes::kInt8>(kind, out_type, [&](auto out, auto s) { return fn(std::integral_constant<Codes, Codes::kInt8>{}, out, s); });
    case Codes::kFp8E4M3:
      return ForKinds<Codes::kFp8E4M3>(kind, out_type, [&](auto out, auto s) { return fn(std::integral_constant<Codes, Codes::kFp8E4M3>{}, out, s); });
    case Codes::kInt4:
      break;
  }
  return ForKinds<Codes::kInt4>(kind, out_type, [&](auto out, auto s) { return fn(std::integral_constant<Codes, Codes::kInt4>{}, out, s); });
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

Layout CurrentLayout() {
  int layout = g_layout.load(std::memory_order_relaxed);
  if (layout < 0) {
    const char* env = std::getenv("STOWAGE_WIDEN_LAYOUT");
    layout = static_cast<int>(env != nullptr && std::strcmp(env, "strided") == 0 ? Layout::kStrided : Layout::kCoalesced);
    g_layout.store(layout, std::memory_order_relaxed);
  }
  return static_cast<Layout>(layout);
}

void SetLayout(Layout layout) { g_layout.store(static_cast<int>(layout), std::memory_order_relaxed); }

int EncodeE4M3(const float* x, uint8_t* out, int64_t n, void* stream) {
  if (n <= 0) return 0;
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(kMaxBlocks, (n + kThreads - 1) / kThreads));
  EncodeE4M3Kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(x, out, n);
  return static_cast<int>(cudaGetLastError());
}

int Widen(Codes codes, const void* q, const void* scale, ScaleKind scale_kind, void* out, OutType out_type,
          int64_t channels, int64_t k, int64_t group_size, void* stream) {
  const int64_t total = channels * k;
  if (total <= 0) return 0;
  if (group_size <= 0 || k % group_size != 0) return static_cast<int>(cudaErrorInvalidValue);
  auto s = static_cast<cudaStream_t>(stream);
  const Scales scales = ScalesOf(scale, channels, k / group_size);
  return ForCodes(codes, scale_kind, out_type, [&](auto c, auto o, auto kind) {
    return Launch<decltype(c)::value, typename decltype(o)::type, decltype(kind)::value>(q, scales, out, total,
                                                                                          group_size, s);
  });
}

int WidenMany(Codes codes, ScaleKind scale_kind, OutType out_type, const WidenJob* jobs, int count, void* stream) {
  for (int n = 0; n < count; ++n) {
    const WidenJob& job = jobs[n];
    if (job.channels * job.k > 0 && (job.group_size <= 0 || job.k % job.group_size != 0)) {
      return static_cast<int>(cudaErrorInvalidValue);
    }
  }
  auto s = static_cast<cudaStream_t>(stream);
  return ForCodes(codes, scale_kind, out_type, [&](auto c, auto o, auto kind) {
    return LaunchMany<decltype(c)::value, typename decltype(o)::type, decltype(kind)::value>(jobs, count, s);
  });
}

}  // namespace stowage::widen_cuda
