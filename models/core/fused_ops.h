// Fused operations of the transformer forward, with their plain references.
//
// On a CUDA build, for bfloat16 tensors on a CUDA device, each op runs one fused kernel
// (fused_kernels.cu): a norm, its modulation, its gate and the residual add in one pass over the
// activations instead of five to ten LibTorch kernels with float32 round trips. Everywhere else
// (the CPU, the simulated device, float32, shapes a kernel does not take) the same op runs its
// reference below: the plain LibTorch ops the model code ran before, which is also what diffusers
// runs eagerly. The GPU suite's conformance test (tests/models/fused_ops_conformance_test.cc) holds
// every kernel to its reference across shapes, batch sizes and strides.
//
// Callers (models/*_transformer.cc) ask Active(x) once per forward and keep their own eager code
// for the inactive case, so CPU results are bit-identical to the code before the fused ops.
//
// Thread-safety: SetEnabled is process-wide (an atomic) and meant for start-up, benches and tests.
#ifndef STOWAGE_MODELS_CORE_FUSED_OPS_H_
#define STOWAGE_MODELS_CORE_FUSED_OPS_H_

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/version.h>

#include "absl/status/status.h"

// Float8 types and FP8 GEMMs (at::_scaled_mm) came with LibTorch 2.1; CI's Debian LibTorch (1.13)
// has neither, and FP8 compute is refused there.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
#define STOWAGE_HAS_FP8 1
#endif

namespace stowage::fused {

// Whether this build has the CUDA kernels.
bool Compiled();
// Process-wide switch, default on (environment STOWAGE_FUSED=0 turns it off at start-up). Off: every
// op runs its reference, on any device (benches compare the two in one process).
void SetEnabled(bool enabled);
bool Enabled();
// Whether the fused kernels serve `x`: compiled, enabled, on a CUDA device, bfloat16.
bool Active(const at::Tensor& x);

// RMS normalisation over the last dimension as diffusers' RMSNorm (float32 statistics, cast to the
// weight's dtype before the weight): n = (x · rsqrt(mean(x²) + eps)).to(w) · w; then, when `scale`
// ([B or 1, 1, D]) is defined, n · scale.
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& scale = {});

// residual + gate · RmsNorm(y, weight): the gated residual add of Z-Image's blocks. gate: [B or 1, 1, D].
at::Tensor GatedRmsNormResidual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& y,
                                const at::Tensor& weight, double eps);

// Rotary embedding of x [B, S, H, D] after an optional RMS normalisation of each head vector
// (weight [D]; undefined: none): pairs (x0, x1) become (x0·c − x1·s, x1·c + x0·s) in float32, cast
// back to x's dtype. cos, sin: float32 [S_total, D / 2] or [B, S_total, D / 2]; x's row s uses table
// row s + offset. When `out` is defined ([B, S_out, H, D], contiguous), the result is written into
// rows [offset, offset + S) of it and `out` is returned (how Flux's joint attention builds its
// concatenated text + image queries without a copy).
at::Tensor RmsNormRope(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t offset = 0, const at::Tensor& out = {});

// LayerNorm over the last dimension without affine parameters, computed in float32 and cast back,
// then modulated: ln(x) · scale + shift (scale is 1 + the model's scale; both [B or 1, 1, D]).
at::Tensor LayerNormModulate(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps);

// silu(a) · b (SwiGLU's gate).
at::Tensor SiluMul(const at::Tensor& a, const at::Tensor& b);

// gelu_tanh(x) for x [B, S, C] whose rows may be strided (a part of a wider GEMM output); the result
// is contiguous.
at::Tensor GeluTanh(const at::Tensor& x);
// at::cat(parts, 1) of [B, S_i, ...] tensors whose tokens may be strided (views of wider outputs).
at::Tensor ConcatTokens(const std::vector<at::Tensor>& parts);
// x + gate · y (at::addcmul) for contiguous x, y [B, S, C] and gate [B or 1, 1, C].
at::Tensor GatedAdd(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y);

// FP8 compute: weights in float8 e4m3 with one float32 scale per output channel, activations
// quantised per token (row) on the device, one FP8 GEMM with both scales, bfloat16 out.
// OK when this build and `device` can run FP8 GEMMs (a LibTorch with float8, CUDA compute capability
// 8.9 or later); otherwise FAILED_PRECONDITION or UNIMPLEMENTED saying which is missing.
absl::Status Fp8Supported(const c10::Device& device);
// w [N, K] (any floating dtype) → q float8 e4m3 [N, K] and scale float32 [N] with
// q · scale ≈ w: scale = max |w_row| / 448. UNIMPLEMENTED without float8 in the build.
struct Fp8Weight {
  at::Tensor q;
  at::Tensor scale;
};
Fp8Weight QuantizeWeightFp8(const at::Tensor& w);
// QuantizeWeightFp8's host path for bfloat16 weights, float8-free so every build tests it: rows
// [begin, end) of a [*, k] bfloat16 weight (its bits) → e4m3fn codes (bits) and fp32 scales,
// scale = max |row| / 448 (1 for a row of zeros or one holding a NaN, as the reference gives), code =
// e4m3(row / scale) clamped to ±448 and rounded to nearest even — bit for bit the reference's.
void QuantizeBf16RowsE4M3(const uint16_t* bf16, int64_t k, int64_t begin, int64_t end, uint8_t* codes,
                          float* scales);
// x's per-token FP8 quantisation, made once for several FP8 layers that read the same x (Q, K and V
// projections; SwiGLU's two). q and scale are undefined where the FP8 GEMM path does not apply.
struct Fp8Input {
  at::Tensor q;      // float8 e4m3 [rows, K]
  at::Tensor scale;  // float32 [rows, 1]
};
Fp8Input QuantizeInputFp8(const at::Tensor& x);
// x [..., K] · (q · scale)ᵀ + bias, in x's dtype. On CUDA with FP8 support: the per-token
// quantisation kernel (or `input`, x's quantisation made by QuantizeInputFp8) and at::_scaled_mm;
// elsewhere the reference (the same quantisation, then a float32 GEMM of the dequantised values).
at::Tensor Fp8Linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias,
                     const Fp8Input* input = nullptr);
// Whether the FP8 GEMM takes this weight (CUDA float8 e4m3, contiguous, both dimensions multiples of
// 16, float32 scales, no bias or a bfloat16 one); Fp8Linear runs its reference otherwise.
bool Fp8GemmTakes(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias);
// Fp8Linear from x's quantisation alone (x of `sizes` is not needed): `input` defined, made by
// QuantizeInputFp8 or LayerNormModulateFp8, and Fp8GemmTakes(q, scale, bias).
at::Tensor Fp8LinearQuantized(const Fp8Input& input, at::IntArrayRef sizes, const at::Tensor& q,
                              const at::Tensor& scale, const at::Tensor& bias);
// QuantizeInputFp8(LayerNormModulate(x, scale, shift, eps)), bit for bit, by one kernel that never
// writes the bfloat16 values; undefined where that kernel does not apply (the fused kernels off or
// absent, no FP8, shapes LayerNormModulate's kernel does not take, a row not a multiple of 16).
Fp8Input LayerNormModulateFp8(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps);

// Fp8Linear(x, q, scale, bias) for x = at::cat(parts, -1), the parts flagged in `gelu` (empty: none)
// entering as gelu_tanh(part) — a layer that reads the concatenation of two outputs, or the GELU of
// one, without that tensor ever being written: on the fused FP8 path one kernel quantises the parts
// where they lie ([B, S, C] views of strided rows; the GELU applied as it reads), bit-identical to
// quantising the built concatenation; elsewhere exactly Fp8Linear of the built concatenation.
at::Tensor Fp8LinearConcat(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu, const at::Tensor& q,
                           const at::Tensor& scale, const at::Tensor& bias);
// That quantisation alone (undefined where the fused FP8 path does not take the parts, and where the
// fused kernels are off: Active(parts.front()) false).
Fp8Input QuantizeConcatInputFp8(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu);
// at::cat(parts, -1) with GeluTanh applied to the flagged parts: what the two above stand for.
at::Tensor GeluConcat(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu);

namespace reference {
Fp8Weight QuantizeWeightFp8(const at::Tensor& w);  // LibTorch ops in float32, any device and dtype.
at::Tensor Fp8Linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias);
at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& scale);
at::Tensor GatedRmsNormResidual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& y,
                                const at::Tensor& weight, double eps);
at::Tensor RmsNormRope(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t offset);
at::Tensor LayerNormModulate(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps);
at::Tensor SiluMul(const at::Tensor& a, const at::Tensor& b);
at::Tensor GeluTanh(const at::Tensor& x);
at::Tensor ConcatTokens(const std::vector<at::Tensor>& parts);
at::Tensor GatedAdd(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y);
}  // namespace reference

}  // namespace stowage::fused

#endif  // STOWAGE_MODELS_CORE_FUSED_OPS_H_
