// float8 e4m3fn encoding on the host, shared by the compressed formats (offload/compression.cc) and
// FP8 compute's conversion of weights at load (models/core/fused_ops.cc).
//
// EncodeE4M3(f): the e4m3fn bits of f, rounded to nearest even; |f| >= 448 (infinities too)
// saturates to ±448 (0x7E with f's sign) and NaN stays NaN (0x7F with f's sign) — what LibTorch's
// float8 conversion gives a value clamped to [-448, 448] first. Bit arithmetic with selects and no
// branches, so loops of it vectorize: |f| at or above 2^-6 keeps its exponent rebiased from 127 to 7
// and its mantissa rounded from 23 bits to 3 (adding 0x7FFFF plus the lowest kept bit rounds half
// to even; a carry moves into the exponent); below 2^-6 it is a multiple of the subnormal step
// 2^-9, rounded by the FPU in adding 2^14, whose ulp is 2^-9 (the sum's low bits are the code,
// 0..8; 8 is the smallest normal's pattern). Equal to EncodeE4M3Reference for all 2^32 inputs
// (checked once exhaustively; compressed_offload_test compares a sweep and the edge cases); its
// speed against it: bench/fp8_encode_bench.cc, bench/results/fp8_encode_cpu/.
//
// EncodeE4M3Reference(f): the same bits by the plain formulation (frexp / ldexp, rounding with the
// FPU's nearest-even), the one the compressed formats used before; what tests and the benchmark hold
// EncodeE4M3 to. Slow (branches, library calls): not for loops over weights.
//
// EncodeE4M3Floats(x, n, out): out[i] = EncodeE4M3(x[i]); EncodeE4M3Scaled(x, n, scale, out):
// out[i] = EncodeE4M3(x[i] / scale) for bf16 inputs (their bits as uint16). In blocks of 16 that GCC
// vectorizes at -O2 (x and out must not overlap).
//
// Thread-safety: pure functions.
#ifndef STOWAGE_BASE_FP8_E4M3_H_
#define STOWAGE_BASE_FP8_E4M3_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace stowage {

inline float FloatFromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline uint32_t BitsOfFloat(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
}

inline uint8_t EncodeE4M3(float f) {
  constexpr uint32_t kMaxBits = 0x43E00000u;       // 448.0f
  constexpr uint32_t kMinNormalBits = 0x3C800000u;  // 2^-6
  constexpr float kSubnormalAlign = 16384.0f;       // 2^14: its ulp is 2^-9.
  constexpr uint32_t kSubnormalAlignBits = 0x46800000u;
  const uint32_t bits = BitsOfFloat(f);
  const uint32_t sign = (bits >> 24) & 0x80u;
  const uint32_t magnitude = bits & 0x7FFFFFFFu;
  const uint32_t a = std::min(magnitude, kMaxBits);
  const uint32_t subnormal = BitsOfFloat(FloatFromBits(a) + kSubnormalAlign) - kSubnormalAlignBits;
  const uint32_t normal = (a + 0x7FFFFu + ((a >> 20) & 1u) - (uint32_t{127 - 7} << 23)) >> 20;
  const uint32_t is_subnormal = 0u - static_cast<uint32_t>(a < kMinNormalBits);
  const uint32_t is_nan = 0u - static_cast<uint32_t>(magnitude > 0x7F800000u);
  uint32_t code = (subnormal & is_subnormal) | (normal & ~is_subnormal);
  code = (0x7Fu & is_nan) | (code & ~is_nan);
  return static_cast<uint8_t>(code | sign);
}

inline uint8_t EncodeE4M3Reference(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7F;
  const float a = std::fabs(f);
  if (a >= 448.0f) return sign | 0x7E;
  int e = 0;
  (void)std::frexp(a, &e);  // a = m · 2^e, m in [0.5, 1).
  const int exponent = e - 1;
  // Subnormal: k · 2^-9, k in 0..8 (8 is the pattern of the smallest normal, 2^-6).
  if (a == 0.0f || exponent < -6) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  auto mantissa = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exponent)));  // In [8, 16].
  int biased = exponent + 7;
  if (mantissa == 16) {
    mantissa = 8;
    ++biased;
  }
  return sign | static_cast<uint8_t>((biased << 3) | (mantissa - 8));
}

inline void EncodeE4M3Floats(const float* __restrict x, int64_t n, uint8_t* __restrict out) {
  const int64_t blocks_end = n - n % 16;
  for (int64_t i = 0; i < blocks_end; i += 16) {  // A fixed trip count: vectorized at -O2.
    for (int j = 0; j < 16; ++j) out[i + j] = EncodeE4M3(x[i + j]);
  }
  for (int64_t i = blocks_end; i < n; ++i) out[i] = EncodeE4M3(x[i]);
}

inline void EncodeE4M3Scaled(const uint16_t* __restrict bf16, int64_t n, float scale, uint8_t* __restrict out) {
  const int64_t blocks_end = n - n % 16;
  for (int64_t i = 0; i < blocks_end; i += 16) {  // A fixed trip count: vectorized at -O2.
    for (int j = 0; j < 16; ++j) out[i + j] = EncodeE4M3(FloatFromBits(uint32_t{bf16[i + j]} << 16) / scale);
  }
  for (int64_t i = blocks_end; i < n; ++i) out[i] = EncodeE4M3(FloatFromBits(uint32_t{bf16[i]} << 16) / scale);
}

}  // namespace stowage

#endif  // STOWAGE_BASE_FP8_E4M3_H_
