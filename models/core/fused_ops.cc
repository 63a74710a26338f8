#include "models/core/fused_ops.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#ifdef STOWAGE_HAS_FP8
#include <c10/util/Float8_e4m3fn.h>
#endif

#include "absl/strings/str_cat.h"
#include "base/fp8_e4m3.h"
#include "base/parallel_ranges.h"

#ifdef STOWAGE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "models/core/fused_kernels.h"
#endif

namespace stowage::fused {
namespace {

bool EnabledAtStart() {
  const char* env = std::getenv("STOWAGE_FUSED");
  return env == nullptr || std::strcmp(env, "0") != 0;
}

std::atomic<bool>& EnabledFlag() {
  static std::atomic<bool> enabled{EnabledAtStart()};
  return enabled;
}

#ifdef STOWAGE_WITH_CUDA
bool Aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// A bfloat16 row tensor the row kernels read with 16-byte loads: contiguous, rows of `dim`.
bool RowsOk(const at::Tensor& t, int64_t dim) {
  return t.scalar_type() == at::kBFloat16 && t.is_cuda() && t.is_contiguous() && t.size(-1) == dim &&
         Aligned16(t);
}

// A per-batch modulation row [Bm, 1, dim] with Bm 1 or `batch`: its batch stride in elements (0 for
// one row shared by the batch), or -1 when the kernels cannot read it.
int64_t ModulationStride(const at::Tensor& m, int64_t batch, int64_t dim) {
  if (!m.defined() || m.scalar_type() != at::kBFloat16 || !m.is_cuda() || m.dim() != 3 || m.size(1) != 1 ||
      m.size(2) != dim || m.stride(2) != 1 || !Aligned16(m)) {
    return -1;
  }
  if (m.size(0) == 1) return 0;
  if (m.size(0) != batch || m.stride(0) % 8 != 0) return -1;
  return m.stride(0);
}

// The distance in elements between consecutive rows of `t` viewed as [rows, t.size(-1)], when its
// leading dimensions collapse into rows of one stride (contiguous rows, or rows of one part of a wider
// tensor); -1 otherwise.
int64_t RowStride(const at::Tensor& t) {
  if (t.dim() < 1 || t.stride(-1) != 1) return -1;
  if (t.dim() == 1) return t.size(0);
  const int64_t stride = t.stride(-2);
  int64_t expected = stride * t.size(-2);
  for (int64_t d = t.dim() - 3; d >= 0; --d) {
    if (t.size(d) != 1 && t.stride(d) != expected) return -1;
    expected *= t.size(d);
  }
  return stride;
}

// [B, S, C] views with unit stride along C and 8-element-aligned strides: the row kernels' layout.
bool StridedRowsOk(const at::Tensor& t) {
  return t.dim() == 3 && t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.stride(2) == 1 && t.size(2) % 8 == 0 &&
         t.stride(1) % 8 == 0 && t.stride(0) % 8 == 0 && Aligned16(t) && t.numel() > 0;
}

fused_cuda::Rows RowsOf(const at::Tensor& t) { return fused_cuda::Rows{t.stride(0), t.stride(1)}; }

void* Stream(const at::Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

void Check(int error, const char* op) {
  TORCH_CHECK(error == 0, "fused ", op, ": CUDA launch failed with error ", error);
}

#ifdef STOWAGE_HAS_FP8
// The FP8 GEMM of a quantised input [m, k] and weight q [n, k] with their scales: bf16 [m, n].
at::Tensor ScaledMm(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& q, const at::Tensor& scale,
                    const at::Tensor& bias) {
  return at::_scaled_mm(xq, q.t(), x_scale, scale.view({1, q.size(0)}),
                        bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt, c10::nullopt, at::kBFloat16,
                        /*use_fast_accum=*/true);
}
#endif
#endif

}  // namespace

bool Compiled() {
#ifdef STOWAGE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

void SetEnabled(bool enabled) { EnabledFlag().store(enabled); }
bool Enabled() { return EnabledFlag().load(); }

bool Active(const at::Tensor& x) {
  return Compiled() && Enabled() && x.defined() && x.is_cuda() && x.scalar_type() == at::kBFloat16;
}

absl::Status Fp8Supported(const c10::Device& device) {
#ifndef STOWAGE_HAS_FP8
  (void)device;
  return absl::UnimplementedError(absl::StrCat("FP8 compute needs a LibTorch with float8 types (2.1 or later); this build has ",
                                               TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR));
#else
  if (!device.is_cuda()) {
    return absl::FailedPreconditionError(
        absl::StrCat("FP8 compute runs on CUDA devices with FP8 tensor cores; '", device.str(), "' is not one"));
  }
#ifdef STOWAGE_WITH_CUDA
  const cudaDeviceProp* prop = at::cuda::getDeviceProperties(device.index() < 0 ? 0 : device.index());
  if (prop->major * 10 + prop->minor < 89) {
    return absl::FailedPreconditionError(absl::StrCat("FP8 compute needs compute capability 8.9 or later; ", device.str(),
                                                      " (", prop->name, ") has ", prop->major, ".", prop->minor));
  }
  return absl::OkStatus();
#else
  return absl::FailedPreconditionError("FP8 compute: this build has no CUDA");
#endif
#endif
}

void QuantizeBf16RowsE4M3(const uint16_t* bf16, int64_t k, int64_t begin, int64_t end, uint8_t* codes,
                          float* scales) {
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* row = bf16 + r * k;
    // max |row| on the bits (for non-negative floats their order), in 16 lanes that vectorize: a
    // NaN's bits lie above infinity's, so a row with one gets a NaN maximum (and scale 1), as
    // LibTorch's amax gives.
    uint16_t lanes[16] = {};
    const int64_t blocks_end = k - k % 16;
    for (int64_t i = 0; i < blocks_end; i += 16) {
      for (int j = 0; j < 16; ++j) lanes[j] = std::max<uint16_t>(lanes[j], row[i + j] & 0x7FFFu);
    }
    uint16_t top = 0;
    for (int64_t i = blocks_end; i < k; ++i) top = std::max<uint16_t>(top, row[i] & 0x7FFFu);
    for (const uint16_t lane : lanes) top = std::max(top, lane);
    float scale = FloatFromBits(uint32_t{top} << 16) / 448.f;
    if (!(scale > 0.f)) scale = 1.f;
    scales[r] = scale;
    EncodeE4M3Scaled(row, k, scale, codes + r * k);  // Clamped to ±448 and rounded to nearest even.
  }
}

Fp8Weight QuantizeWeightFp8(const at::Tensor& w) {
#ifdef STOWAGE_HAS_FP8
  if (w.device().is_cpu() && w.scalar_type() == at::kBFloat16 && w.dim() == 2 && w.is_contiguous() && w.numel() > 0) {
    // A checkpoint's weight on the host (FP8 compute converts at load): one pass per row over the
    // bfloat16 values, no float32 temporaries, the rows split over threads of our own (at::parallel_for
    // compiled into this object never forks: it is not built with OpenMP) — the same arithmetic as the
    // reference below (float32 max, division by the scale, clamp, round to nearest e4m3).
    const int64_t n = w.size(0), k = w.size(1);
    Fp8Weight out{at::empty({n, k}, w.options().dtype(at::kFloat8_e4m3fn)), at::empty({n}, w.options().dtype(at::kFloat))};
    const auto* src = static_cast<const uint16_t*>(w.data_ptr());  // bfloat16 bits.
    auto* dst = static_cast<uint8_t*>(out.q.data_ptr());            // e4m3fn bits.
    auto* scales = static_cast<float*>(out.scale.data_ptr());
    auto rows = [&](int64_t begin, int64_t end) { QuantizeBf16RowsE4M3(src, k, begin, end, dst, scales); };
    constexpr int64_t kValuesPerThread = int64_t{1} << 20;  // Below this a thread costs more than it saves.
    ParallelRanges(n, std::max<int64_t>(1, kValuesPerThread / std::max<int64_t>(k, 1)), rows);
    return out;
  }
  return reference::QuantizeWeightFp8(w);
#else
  (void)w;
  TORCH_CHECK(false, "QuantizeWeightFp8: this LibTorch has no float8 types");
#endif
}

namespace reference {

Fp8Weight QuantizeWeightFp8(const at::Tensor& w) {
#ifdef STOWAGE_HAS_FP8
  const at::Tensor wf = w.to(at::kFloat);
  at::Tensor scale = wf.abs().amax({1}) / 448.0;
  scale = at::where(scale > 0, scale, at::ones_like(scale));
  return {(wf / scale.unsqueeze(1)).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn), scale};
#else
  (void)w;
  TORCH_CHECK(false, "QuantizeWeightFp8: this LibTorch has no float8 types");
#endif
}

at::Tensor Fp8Linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias) {
#ifdef STOWAGE_HAS_FP8
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor xs = xf.abs().amax({-1}, /*keepdim=*/true) / 448.0;
  xs = at::where(xs > 0, xs, at::ones_like(xs));
  const at::Tensor xq = (xf / xs).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn).to(at::kFloat) * xs;
  const at::Tensor w = q.to(at::kFloat) * scale.unsqueeze(1);
  return at::linear(xq, w, bias.defined() ? bias.to(at::kFloat) : at::Tensor()).to(x.scalar_type());
#else
  (void)x, (void)q, (void)scale, (void)bias;
  TORCH_CHECK(false, "Fp8Linear: this LibTorch has no float8 types");
#endif
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& scale) {
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = (xf * at::rsqrt(xf.pow(2).mean({-1}, /*keepdim=*/true) + eps)).to(weight.scalar_type()) * weight;
  return scale.defined() ? y * scale : y;
}

at::Tensor GatedRmsNormResidual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& y,
                                const at::Tensor& weight, double eps) {
  return residual + gate * RmsNorm(y, weight, eps, at::Tensor());
}

at::Tensor RmsNormRope(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t offset) {
  const at::Tensor h = weight.defined() ? RmsNorm(x, weight, eps, at::Tensor()) : x;
  const int64_t s = x.size(1);
  auto table = [&](const at::Tensor& t) {
    const at::Tensor rows = t.narrow(-2, offset, s);
    return (rows.dim() == 2 ? rows.unsqueeze(0) : rows).unsqueeze(2);  // [B or 1, S, 1, D / 2]
  };
  const at::Tensor c = table(cos), sn = table(sin);
  const at::Tensor pairs = h.to(at::kFloat).reshape({x.size(0), s, x.size(2), -1, 2});
  const at::Tensor x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
  return at::stack({x0 * c - x1 * sn, x1 * c + x0 * sn}, -1).flatten(3).to(x.scalar_type());
}

at::Tensor LayerNormModulate(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
  return at::layer_norm(x.to(at::kFloat), {x.size(-1)}, {}, {}, eps).to(x.scalar_type()) * scale + shift;
}

at::Tensor SiluMul(const at::Tensor& a, const at::Tensor& b) { return at::silu(a) * b; }

at::Tensor GeluTanh(const at::Tensor& x) { return at::gelu(x, "tanh"); }

at::Tensor ConcatTokens(const std::vector<at::Tensor>& parts) { return at::cat(parts, 1); }

at::Tensor GatedAdd(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) { return at::addcmul(x, gate, y); }

}  // namespace reference

Fp8Input QuantizeInputFp8(const at::Tensor& x) {
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  const int64_t k = x.size(-1);
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16 && k % 16 == 0 && x.numel() > 0) {
    c10::cuda::CUDAGuard guard(x.device());
    const at::Tensor x2d = x.reshape({-1, k}).contiguous();
    const int64_t m = x2d.size(0);
    Fp8Input input{at::empty({m, k}, x.options().dtype(at::kFloat8_e4m3fn)), at::empty({m, 1}, x.options().dtype(at::kFloat))};
    Check(fused_cuda::QuantizeRowsFp8(x2d.data_ptr(), input.q.data_ptr(), input.scale.data_ptr<float>(), m, k,
                                      Stream(x)),
          "QuantizeRowsFp8");
    return input;
  }
#else
  (void)x;
#endif
  return {};
}

at::Tensor GeluConcat(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu) {
  TORCH_CHECK(gelu.empty() || gelu.size() == parts.size(), "GeluConcat: ", gelu.size(), " GELU flags for ",
              parts.size(), " parts");
  std::vector<at::Tensor> values;
  values.reserve(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) values.push_back(!gelu.empty() && gelu[i] ? GeluTanh(parts[i]) : parts[i]);
  return values.size() == 1 ? values.front() : at::cat(values, -1);
}

Fp8Input QuantizeConcatInputFp8(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu) {
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  if (parts.empty() || parts.size() > static_cast<size_t>(fused_cuda::kMaxQuantParts) ||
      (!gelu.empty() && gelu.size() != parts.size())) {
    return {};
  }
  const at::Tensor& first = parts.front();
  // A fused kernel like the others: STOWAGE_FUSED=0 (or SetEnabled(false)) leaves the reference path
  // (GeluConcat's at::gelu, then the plain quantisation).
  if (!Active(first)) return {};
  std::vector<fused_cuda::QuantPart> specs;
  int64_t k = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    if (!StridedRowsOk(p) || p.device() != first.device() || p.size(0) != first.size(0) || p.size(1) != first.size(1)) {
      return {};
    }
    specs.push_back({p.data_ptr(), RowsOf(p), p.size(2), !gelu.empty() && gelu[i]});
    k += p.size(2);
  }
  if (k % 16 != 0 || k > fused_cuda::kMaxQuantConcatDim) return {};
  c10::cuda::CUDAGuard guard(first.device());
  const int64_t m = first.size(0) * first.size(1);
  Fp8Input input{at::empty({m, k}, first.options().dtype(at::kFloat8_e4m3fn)),
                 at::empty({m, 1}, first.options().dtype(at::kFloat))};
  Check(fused_cuda::QuantizeConcatRowsFp8(specs.data(), static_cast<int>(specs.size()), input.q.data_ptr(),
                                          input.scale.data_ptr<float>(), first.size(0), first.size(1), Stream(first)),
        "QuantizeConcatRowsFp8");
  return input;
#else
  (void)parts, (void)gelu;
  return {};
#endif
}

at::Tensor Fp8LinearConcat(const std::vector<at::Tensor>& parts, const std::vector<bool>& gelu, const at::Tensor& q,
                           const at::Tensor& scale, const at::Tensor& bias) {
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  const int64_t n = q.size(0);
  if (!parts.empty() && parts.front().is_cuda() && q.is_cuda() && q.scalar_type() == at::kFloat8_e4m3fn &&
      q.is_contiguous() && scale.scalar_type() == at::kFloat && n % 16 == 0 &&
      (!bias.defined() || bias.scalar_type() == at::kBFloat16)) {
    const Fp8Input quantized = QuantizeConcatInputFp8(parts, gelu);
    if (quantized.q.defined() && quantized.q.size(1) == q.size(1)) {
      c10::cuda::CUDAGuard guard(q.device());
      return ScaledMm(quantized.q, quantized.scale, q, scale, bias).view({parts.front().size(0), parts.front().size(1), n});
    }
  }
#endif
  return Fp8Linear(GeluConcat(parts, gelu), q, scale, bias);
}

at::Tensor Fp8Linear(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias,
                     const Fp8Input* input) {
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  const int64_t k = x.size(-1), n = q.size(0);
  if (x.is_cuda() && x.scalar_type() == at::kBFloat16 && q.is_cuda() && q.scalar_type() == at::kFloat8_e4m3fn &&
      q.is_contiguous() && scale.scalar_type() == at::kFloat && k % 16 == 0 && n % 16 == 0 && x.numel() > 0 &&
      (!bias.defined() || bias.scalar_type() == at::kBFloat16)) {
    c10::cuda::CUDAGuard guard(x.device());
    const Fp8Input quantized = input != nullptr && input->q.defined() ? *input : QuantizeInputFp8(x);
    std::vector<int64_t> shape = x.sizes().vec();
    shape.back() = n;
    return ScaledMm(quantized.q, quantized.scale, q, scale, bias).view(shape);
  }
#else
  (void)input;
#endif
  return reference::Fp8Linear(x, q, scale, bias);
}

bool Fp8GemmTakes(const at::Tensor& q, const at::Tensor& scale, const at::Tensor& bias) {
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  return q.defined() && q.is_cuda() && q.scalar_type() == at::kFloat8_e4m3fn && q.dim() == 2 && q.is_contiguous() &&
         q.size(0) % 16 == 0 && q.size(1) % 16 == 0 && scale.defined() && scale.scalar_type() == at::kFloat &&
         (!bias.defined() || bias.scalar_type() == at::kBFloat16);
#else
  (void)q, (void)scale, (void)bias;
  return false;
#endif
}

at::Tensor Fp8LinearQuantized(const Fp8Input& input, at::IntArrayRef sizes, const at::Tensor& q,
                              const at::Tensor& scale, const at::Tensor& bias) {
  TORCH_CHECK(input.q.defined(), "Fp8LinearQuantized: no quantised input");
  TORCH_CHECK(Fp8GemmTakes(q, scale, bias), "Fp8LinearQuantized: the FP8 GEMM does not take this weight");
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  c10::cuda::CUDAGuard guard(q.device());
  std::vector<int64_t> shape = sizes.vec();
  shape.back() = q.size(0);
  return ScaledMm(input.q, input.scale, q, scale, bias).view(shape);
#else
  (void)sizes, (void)q, (void)scale, (void)bias;
  TORCH_CHECK(false, "Fp8LinearQuantized: this build has no FP8 GEMMs");
#endif
}

Fp8Input LayerNormModulateFp8(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
#if defined(STOWAGE_WITH_CUDA) && defined(STOWAGE_HAS_FP8)
  if (Active(x) && x.dim() == 3 && x.size(2) % 16 == 0 && x.size(2) <= fused_cuda::kMaxRowKernelDim) {
    const int64_t dim = x.size(2), batch = x.size(0);
    const int64_t scale_stride = ModulationStride(scale, batch, dim);
    const int64_t shift_stride = ModulationStride(shift, batch, dim);
    if (RowsOk(x, dim) && scale_stride >= 0 && shift_stride >= 0 && x.numel() > 0) {
      c10::cuda::CUDAGuard guard(x.device());
      const int64_t rows = x.numel() / dim;
      Fp8Input input{at::empty({rows, dim}, x.options().dtype(at::kFloat8_e4m3fn)),
                     at::empty({rows, 1}, x.options().dtype(at::kFloat))};
      Check(fused_cuda::LayerNormModulateFp8(x.data_ptr(), scale.data_ptr(), scale_stride, shift.data_ptr(),
                                             shift_stride, input.q.data_ptr(), input.scale.data_ptr<float>(), rows,
                                             x.size(1), dim, static_cast<float>(eps), Stream(x)),
            "LayerNormModulateFp8");
      return input;
    }
  }
#else
  (void)x, (void)scale, (void)shift, (void)eps;
#endif
  return {};
}

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& scale) {
#ifdef STOWAGE_WITH_CUDA
  if (Active(x) && x.dim() == 3) {
    const int64_t dim = x.size(2), batch = x.size(0);
    const int64_t scale_stride = scale.defined() ? ModulationStride(scale, batch, dim) : 0;
    if (RowsOk(x, dim) && RowsOk(weight, dim) && weight.dim() == 1 && scale_stride >= 0 && x.numel() > 0) {
      c10::cuda::CUDAGuard guard(x.device());
      at::Tensor out = at::empty_like(x);
      Check(fused_cuda::RmsNorm(x.data_ptr(), weight.data_ptr(), scale.defined() ? scale.data_ptr() : nullptr,
                                scale_stride, nullptr, nullptr, 0, out.data_ptr(), x.numel() / dim, x.size(1), dim,
                                static_cast<float>(eps), Stream(x)),
            "RmsNorm");
      return out;
    }
  }
#endif
  return reference::RmsNorm(x, weight, eps, scale);
}

at::Tensor GatedRmsNormResidual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& y,
                                const at::Tensor& weight, double eps) {
#ifdef STOWAGE_WITH_CUDA
  if (Active(y) && y.dim() == 3 && residual.sizes() == y.sizes()) {
    const int64_t dim = y.size(2), batch = y.size(0);
    const int64_t gate_stride = ModulationStride(gate, batch, dim);
    if (RowsOk(y, dim) && RowsOk(residual, dim) && RowsOk(weight, dim) && weight.dim() == 1 && gate_stride >= 0 &&
        y.numel() > 0) {
      c10::cuda::CUDAGuard guard(y.device());
      at::Tensor out = at::empty_like(y);
      Check(fused_cuda::RmsNorm(y.data_ptr(), weight.data_ptr(), nullptr, 0, residual.data_ptr(), gate.data_ptr(),
                                gate_stride, out.data_ptr(), y.numel() / dim, y.size(1), dim, static_cast<float>(eps),
                                Stream(y)),
            "GatedRmsNormResidual");
      return out;
    }
  }
#endif
  return reference::GatedRmsNormResidual(residual, gate, y, weight, eps);
}

at::Tensor RmsNormRope(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                       const at::Tensor& sin, int64_t offset, const at::Tensor& out) {
#ifdef STOWAGE_WITH_CUDA
  if (Active(x) && x.dim() == 4 && cos.dim() >= 2 && cos.dim() <= 3) {
    const int64_t b = x.size(0), s = x.size(1), h = x.size(2), d = x.size(3);
    const int64_t cs_batch = cos.dim() == 3 ? cos.size(0) : 1;
    const int64_t cs_seq = cos.size(-2);
    const bool tables_ok = cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.is_cuda() &&
                           sin.is_cuda() && cos.is_contiguous() && sin.is_contiguous() &&
                           cos.sizes() == sin.sizes() && cos.size(-1) == d / 2 && (cs_batch == 1 || cs_batch == b) &&
                           offset >= 0 && offset + s <= cs_seq;
    const bool weight_ok = !weight.defined() || (weight.scalar_type() == at::kBFloat16 && weight.is_cuda() &&
                                                 weight.dim() == 1 && weight.size(0) == d && weight.is_contiguous());
    const bool out_ok = !out.defined() || (out.scalar_type() == at::kBFloat16 && out.is_cuda() && out.dim() == 4 &&
                                           out.size(0) == b && out.size(2) == h && out.size(3) == d &&
                                           offset + s <= out.size(1) && out.is_contiguous());
    // Heads contiguous within a token; tokens one stride apart (a part of a wider projection is fine).
    const int64_t token_stride = x.stride(1);
    const bool x_ok = x.stride(3) == 1 && x.stride(2) == d && token_stride >= h * d &&
                      (b == 1 || x.stride(0) == s * token_stride) && x.scalar_type() == at::kBFloat16;
    if (tables_ok && weight_ok && out_ok && x_ok && d % 2 == 0 && d <= 512 && x.numel() > 0 &&
        reinterpret_cast<uintptr_t>(x.data_ptr()) % 4 == 0) {
      c10::cuda::CUDAGuard guard(x.device());
      at::Tensor result = out.defined() ? out : at::empty({b, s, h, d}, x.options());
      Check(fused_cuda::RmsNormRope(x.data_ptr(), token_stride, weight.defined() ? weight.data_ptr() : nullptr,
                                    cos.data_ptr<float>(), sin.data_ptr<float>(), cs_batch, cs_seq, offset,
                                    result.data_ptr(), b, s, h, d, result.size(1), out.defined() ? offset : 0,
                                    static_cast<float>(eps), Stream(x)),
            "RmsNormRope");
      return result;
    }
  }
#endif
  at::Tensor result = reference::RmsNormRope(x, weight, eps, cos, sin, offset);
  if (!out.defined()) return result;
  out.narrow(1, offset, x.size(1)).copy_(result);
  return out;
}

at::Tensor LayerNormModulate(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
#ifdef STOWAGE_WITH_CUDA
  if (Active(x) && x.dim() == 3 && x.size(2) <= fused_cuda::kMaxRowKernelDim) {
    const int64_t dim = x.size(2), batch = x.size(0);
    const int64_t scale_stride = ModulationStride(scale, batch, dim);
    const int64_t shift_stride = ModulationStride(shift, batch, dim);
    if (RowsOk(x, dim) && scale_stride >= 0 && shift_stride >= 0 && x.numel() > 0) {
      c10::cuda::CUDAGuard guard(x.device());
      at::Tensor out = at::empty_like(x);
      Check(fused_cuda::LayerNormModulate(x.data_ptr(), scale.data_ptr(), scale_stride, shift.data_ptr(), shift_stride,
                                          out.data_ptr(), x.numel() / dim, x.size(1), dim, static_cast<float>(eps),
                                          Stream(x)),
            "LayerNormModulate");
      return out;
    }
  }
#endif
  return reference::LayerNormModulate(x, scale, shift, eps);
}

at::Tensor SiluMul(const at::Tensor& a, const at::Tensor& b) {
#ifdef STOWAGE_WITH_CUDA
  const int64_t a_stride = RowStride(a), b_stride = RowStride(b);
  const int64_t cols = a.dim() > 0 ? a.size(-1) : 0;
  if (Active(a) && a.sizes() == b.sizes() && b.scalar_type() == at::kBFloat16 && b.is_cuda() && a_stride > 0 &&
      b_stride > 0 && a_stride % 8 == 0 && b_stride % 8 == 0 && cols % 8 == 0 && a.numel() > 0 && Aligned16(a) &&
      Aligned16(b)) {
    c10::cuda::CUDAGuard guard(a.device());
    at::Tensor out = at::empty(a.sizes(), a.options().memory_format(at::MemoryFormat::Contiguous));
    Check(fused_cuda::SiluMul(a.data_ptr(), a_stride, b.data_ptr(), b_stride, out.data_ptr(), a.numel() / cols, cols,
                              Stream(a)),
          "SiluMul");
    return out;
  }
#endif
  return reference::SiluMul(a, b);
}

at::Tensor GeluTanh(const at::Tensor& x) {
#ifdef STOWAGE_WITH_CUDA
  if (Active(x) && StridedRowsOk(x)) {
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
    Check(fused_cuda::GeluTanh(x.data_ptr(), RowsOf(x), out.data_ptr(), RowsOf(out), x.size(0), x.size(1), x.size(2),
                               Stream(x)),
          "GeluTanh");
    return out;
  }
#endif
  return reference::GeluTanh(x);
}

at::Tensor ConcatTokens(const std::vector<at::Tensor>& parts) {
#ifdef STOWAGE_WITH_CUDA
  if (!parts.empty() && Active(parts.front()) && parts.front().dim() >= 3) {
    const at::Tensor& first = parts.front();
    std::vector<at::Tensor> flat;
    int64_t tokens = 0;
    bool ok = true;
    for (const at::Tensor& p : parts) {
      if (p.dim() != first.dim() || p.size(0) != first.size(0) || p.sizes().slice(2) != first.sizes().slice(2) ||
          p.scalar_type() != first.scalar_type() || p.device() != first.device()) {
        ok = false;
        break;
      }
      // Tokens of [B, S, ...] views whose trailing dims are contiguous flatten to [B, S, C] views.
      at::Tensor f = p.dim() == 3 ? p : p.flatten(2);
      ok = ok && StridedRowsOk(f) && f.is_alias_of(p);
      flat.push_back(std::move(f));
      tokens += p.size(1);
    }
    if (ok) {
      c10::cuda::CUDAGuard guard(first.device());
      std::vector<int64_t> shape = first.sizes().vec();
      shape[1] = tokens;
      at::Tensor out = at::empty(shape, first.options().memory_format(at::MemoryFormat::Contiguous));
      const at::Tensor out3 = out.view({first.size(0), tokens, -1});
      int64_t offset = 0;
      for (const at::Tensor& f : flat) {
        const at::Tensor dst = out3.narrow(1, offset, f.size(1));
        Check(fused_cuda::CopyRows(f.data_ptr(), RowsOf(f), dst.data_ptr(), RowsOf(dst), f.size(0), f.size(1),
                                   f.size(2), Stream(f)),
              "ConcatTokens");
        offset += f.size(1);
      }
      return out;
    }
  }
#endif
  return reference::ConcatTokens(parts);
}

at::Tensor GatedAdd(const at::Tensor& x, const at::Tensor& gate, const at::Tensor& y) {
#ifdef STOWAGE_WITH_CUDA
  if (Active(x) && x.dim() == 3 && x.sizes() == y.sizes()) {
    const int64_t dim = x.size(2);
    const int64_t gate_stride = ModulationStride(gate, x.size(0), dim);
    if (RowsOk(x, dim) && RowsOk(y, dim) && gate_stride >= 0 && dim % 8 == 0 && x.numel() > 0) {
      c10::cuda::CUDAGuard guard(x.device());
      at::Tensor out = at::empty_like(x);
      Check(fused_cuda::GatedAdd(x.data_ptr(), gate.data_ptr(), gate_stride, y.data_ptr(), out.data_ptr(), x.size(0),
                                 x.size(1), dim, Stream(x)),
            "GatedAdd");
      return out;
    }
  }
#endif
  return reference::GatedAdd(x, gate, y);
}

}  // namespace stowage::fused
