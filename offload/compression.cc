#include "offload/compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <unordered_map>

#include <ATen/Functions.h>
#include <ATen/Parallel.h>
#include <ATen/TensorOperators.h>
#include <torch/version.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/fp8_e4m3.h"

// On CUDA the widening is one kernel (widen_kernels.h); the LibTorch ops below are the portable
// path (what CPU CI and the simulator run).
#ifdef STOWAGE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "offload/widen_kernels.h"
#endif

namespace stowage {
namespace {

// float8 e4m3fn, the FP8 compute dtype; LibTorch builds before 2.1 (CI's Debian 1.13) have none.
bool IsFloat8(at::ScalarType dtype) {
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  return dtype == at::kFloat8_e4m3fn;
#else
  (void)dtype;
  return false;
#endif
}

float DecodeOne(uint8_t bits) {
  const int exponent = (bits >> 3) & 0xF;
  const int mantissa = bits & 0x7;
  float value;
  if (exponent == 0xF && mantissa == 0x7) {
    value = std::numeric_limits<float>::quiet_NaN();
  } else if (exponent == 0) {
    value = std::ldexp(static_cast<float>(mantissa), -9);
  } else {
    value = std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  }
  return (bits & 0x80) ? -value : value;
}

// Per-output-channel max magnitude of `w` as fp32 [C, K], and the scale that maps it to `top`
// (1 for an all-zero channel).
at::Tensor ChannelScale(const at::Tensor& w2d, float top) {
  const at::Tensor amax = w2d.abs().amax(1);
  // A tensor divisor: CUDA divides by a scalar through its reciprocal, which would round some
  // scales differently from the host's true division.
  return at::where(amax > 0, amax / at::full_like(amax, top), at::ones_like(amax)).contiguous();
}

// kInt4's scale buffer as its two parts: the fp32 row scales [C] and the e4m3 group codes [C, G].
struct Int4Scales {
  at::Tensor rows;
  at::Tensor codes;
};
Int4Scales SplitInt4Scales(const at::Tensor& scale, int64_t channels) {
  const at::Tensor flat = scale.view({-1});
  return {flat.narrow(0, 0, channels * 4).view(at::kFloat),
          flat.narrow(0, channels * 4, flat.numel() - channels * 4).view({channels, -1})};
}

// Fp8E4M3Table(kFloat) on a device (the CPU too), made once per device and only read after. The copy
// from the host is a blocking one, which waits for everything queued on the device's stream: made on
// each call, as before session 46, it stopped the int4 quantization at load six times a chunk (once
// per clipping candidate), so the copy threads reading the next chunk and the device quantizing this
// one took turns instead of overlapping. The tables are never freed (a device tensor must not outlive
// its driver at exit).
class DeviceFp8Tables {
 public:
  at::Tensor On(const c10::Device& device) ABSL_LOCKS_EXCLUDED(mu_) {
    absl::MutexLock lock(&mu_);
    auto it = tables_.find(device);
    if (it == tables_.end()) it = tables_.emplace(device, Fp8E4M3Table(at::kFloat).to(device)).first;
    return it->second;
  }

 private:
  absl::Mutex mu_;
  std::unordered_map<c10::Device, at::Tensor> tables_ ABSL_GUARDED_BY(mu_);
};

at::Tensor Fp8E4M3FloatTableOn(const c10::Device& device) {
  static DeviceFp8Tables* const tables = new DeviceFp8Tables;
  return tables->On(device);
}

// Each group's scale as the device uses it: e4m3(codes[c, g]) · rows[c], the product in fp32, [C, G]
// (Quantize's candidates and Dequantize; WidenInto's portable path does the same in its scratch).
at::Tensor Int4GroupScales(const at::Tensor& codes, const at::Tensor& rows) {
  const at::Tensor table = Fp8E4M3FloatTableOn(codes.device());
  return table.index_select(0, codes.reshape({-1}).to(at::kLong)).view(codes.sizes()) * rows.unsqueeze(1);
}

const at::Tensor& TableFor(const WidenScratch& scratch, at::ScalarType dtype) {
  switch (dtype) {
    case at::kBFloat16: return scratch.table_bf16;
    case at::kHalf: return scratch.table_f16;
    default: return scratch.table_f32;
  }
}

}  // namespace

const char* CompressFormatName(CompressFormat format) {
  switch (format) {
    case CompressFormat::kInt8: return "int8";
    case CompressFormat::kFp8E4M3: return "fp8_e4m3";
    case CompressFormat::kInt8Grouped: return "int8_grouped";
    case CompressFormat::kInt4: return "int4";
    case CompressFormat::kNone: break;
  }
  return "none";
}

absl::StatusOr<CompressFormat> ParseCompressFormat(absl::string_view name) {
  if (name == "none") return CompressFormat::kNone;
  if (name == "int8") return CompressFormat::kInt8;
  if (name == "fp8_e4m3") return CompressFormat::kFp8E4M3;
  if (name == "int8_grouped") return CompressFormat::kInt8Grouped;
  if (name == "int4") return CompressFormat::kInt4;
  return absl::InvalidArgumentError(absl::StrCat("unknown compression format '", name.substr(0, 32),
                                                 "' (none, int8, fp8_e4m3, int8_grouped, int4)"));
}

int64_t GroupSize(CompressFormat format, int64_t k) {
  int64_t preferred = 0;
  if (format == CompressFormat::kInt8Grouped) preferred = 128;
  if (format == CompressFormat::kInt4) preferred = 16;
  for (int64_t g = preferred; g >= 16; g /= 2) {
    if (k % g == 0) return g;
  }
  return k;
}

namespace {
int64_t InnerSize(at::IntArrayRef sizes) {
  int64_t k = 1;
  for (size_t i = 1; i < sizes.size(); ++i) k *= sizes[i];
  return k;
}
}  // namespace

bool IsCompressible(CompressFormat format, at::ScalarType dtype, at::IntArrayRef sizes) {
  if (format == CompressFormat::kNone || sizes.size() < 2) return false;
  // An FP8 weight (FP8 compute) is already 8-bit: only int4 makes its host copy smaller.
  if (IsFloat8(dtype) && format != CompressFormat::kInt4) return false;
  if (dtype != at::kFloat && dtype != at::kBFloat16 && dtype != at::kHalf && !IsFloat8(dtype)) return false;
  for (int64_t d : sizes) {
    if (d == 0) return false;
  }
  if (format == CompressFormat::kInt4 && InnerSize(sizes) % 2 != 0) return false;
  return true;
}

QuantLayout LayoutOf(CompressFormat format, at::IntArrayRef sizes) {
  QuantLayout layout;
  const int64_t c = sizes[0], k = InnerSize(sizes);
  switch (format) {
    case CompressFormat::kInt4:
      layout.q_bytes = c * (k / 2);
      layout.q_dtype = at::kByte;
      layout.q_shape = {c, k / 2};
      layout.scale_count = c * 4 + c * (k / GroupSize(format, k));
      layout.scale_dtype = at::kByte;
      break;
    case CompressFormat::kInt8Grouped:
      layout.q_bytes = c * k;
      layout.q_dtype = at::kChar;
      layout.q_shape = sizes.vec();
      layout.scale_count = c * (k / GroupSize(format, k));
      break;
    default:
      layout.q_bytes = c * k;
      layout.q_dtype = format == CompressFormat::kInt8 ? at::kChar : at::kByte;
      layout.q_shape = sizes.vec();
      layout.scale_count = c;
      break;
  }
  return layout;
}

at::Tensor EncodeFp8E4M3(const at::Tensor& x) {
  const at::Tensor in = x.to(at::kFloat).contiguous();
  at::Tensor out = at::empty(in.sizes(), in.options().dtype(at::kByte));
#ifdef STOWAGE_WITH_CUDA
  if (in.is_cuda()) {
    const c10::cuda::CUDAGuard guard(in.device());  // The launch goes to the tensor's device.
    const int err = widen_cuda::EncodeE4M3(in.data_ptr<float>(), out.data_ptr<uint8_t>(), in.numel(),
                                           c10::cuda::getCurrentCUDAStream(in.device().index()).stream());
    TORCH_CHECK(err == 0, "fp8 encoding kernel failed to launch (CUDA error ", err, ")");
    return out;
  }
#endif
  const float* src = in.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, in.numel(), int64_t{1} << 16,
                   [&](int64_t begin, int64_t end) { EncodeE4M3Floats(src + begin, end - begin, dst + begin); });
  return out;
}

at::Tensor Fp8E4M3Table(at::ScalarType dtype) {
  at::Tensor table = at::empty({256}, at::TensorOptions().dtype(at::kFloat));
  float* values = table.data_ptr<float>();
  for (int i = 0; i < 256; ++i) values[i] = DecodeOne(static_cast<uint8_t>(i));
  return table.to(dtype);  // Every finite e4m3 value is exact in bf16 and fp16.
}

QuantizedTensor Quantize(const at::Tensor& w, CompressFormat format) {
  const at::Tensor w2d = w.to(at::kFloat).reshape({w.size(0), -1});
  QuantizedTensor out;
  if (format == CompressFormat::kInt8Grouped || format == CompressFormat::kInt4) {
    const int64_t c = w2d.size(0), k = w2d.size(1), g = GroupSize(format, k);
    const float top = format == CompressFormat::kInt4 ? 7.0f : 127.0f;  // Largest code.
    const at::Tensor grouped = w2d.view({c * (k / g), g});
    if (format == CompressFormat::kInt4) {
      // 8-bit group scales under an fp32 row scale, chosen by a clipping search: with 15 levels the
      // group's largest value sets a coarse step for all the others, and a scale a little below max/7
      // (clipping the few largest) often loses less. Each group keeps the candidate (as stored: an e4m3
      // code times the row scale) of least squared error.
      const at::Tensor amax = grouped.abs().amax(1);  // [C * G]
      const at::Tensor row_amax = amax.view({c, k / g}).amax(1);
      // Tensor divisors, as ChannelScale: the same rounding on CUDA as on the host.
      const at::Tensor rows =
          at::where(row_amax > 0, row_amax / at::full_like(row_amax, top * kFp8E4M3Max), at::ones_like(row_amax))
              .contiguous();
      const at::Tensor top_scale = (amax / at::full_like(amax, top)).view({c, k / g});
      at::Tensor best_error = at::full_like(amax, std::numeric_limits<float>::infinity());
      at::Tensor best_scale = at::zeros_like(amax);
      at::Tensor best_code = at::zeros({c * (k / g)}, amax.options().dtype(at::kByte));
      for (const float ratio : {1.0f, 0.95f, 0.9f, 0.85f, 0.8f, 0.75f}) {
        const at::Tensor code = EncodeFp8E4M3((top_scale * ratio) / rows.unsqueeze(1));  // [C, G]
        const at::Tensor candidate = Int4GroupScales(code, rows).view({-1});
        // A code of 0 (a zero group, or one under the row's range) reconstructs zeros.
        const at::Tensor q = at::round(grouped / candidate.clamp_min(1e-30f).unsqueeze(1)).clamp_(-top, top);
        const at::Tensor error = (q * candidate.unsqueeze(1) - grouped).pow(2).sum(1);
        const at::Tensor better = error < best_error;
        best_scale = at::where(better, candidate, best_scale);
        best_code = at::where(better, code.view({-1}), best_code);
        best_error = at::where(better, error, best_error);
      }
      const at::Tensor q =
          at::round(grouped / best_scale.clamp_min(1e-30f).unsqueeze(1)).clamp_(-top, top).view({c, k});
      const at::Tensor nibbles = (q + 8.0f).to(at::kByte).view({c, k / 2, 2});
      out.q = at::bitwise_or(nibbles.select(2, 0), at::bitwise_left_shift(nibbles.select(2, 1), 4)).contiguous();
      out.scale = at::cat({rows.view(at::kByte), best_code}).contiguous();
      return out;
    }
    out.scale = ChannelScale(grouped, top).view({c, k / g}).contiguous();
    const at::Tensor q = at::round(grouped / out.scale.view({-1, 1})).clamp_(-top, top);
    out.q = q.to(at::kChar).reshape(w.sizes()).contiguous();
    return out;
  }
  if (format == CompressFormat::kInt8) {
    out.scale = ChannelScale(w2d, 127.0f);
    out.q = at::round(w2d / out.scale.unsqueeze(1)).clamp_(-127, 127).to(at::kChar).reshape(w.sizes());
  } else {
    out.scale = ChannelScale(w2d, kFp8E4M3Max);
    out.q = EncodeFp8E4M3(w2d / out.scale.unsqueeze(1)).reshape(w.sizes());
  }
  out.q = out.q.contiguous();
  return out;
}

at::Tensor Dequantize(const QuantizedTensor& t, CompressFormat format, at::ScalarType dtype, at::IntArrayRef sizes) {
  if (!sizes.empty()) return Dequantize(t, format, dtype).reshape(sizes).contiguous();
  if (format == CompressFormat::kInt8Grouped || format == CompressFormat::kInt4) {
    const int64_t c = t.q.size(0);
    at::Tensor values;  // [C, K] fp32.
    if (format == CompressFormat::kInt4) {
      const at::Tensor packed = t.q.view({c, -1});
      values = at::stack({at::bitwise_and(packed, 15), at::bitwise_right_shift(packed, 4)}, 2).view({c, -1}).to(at::kFloat) - 8.0f;
    } else {
      values = t.q.reshape({c, -1}).to(at::kFloat);
    }
    at::Tensor scales;  // [C, groups] fp32.
    if (format == CompressFormat::kInt4) {
      const Int4Scales parts = SplitInt4Scales(t.scale, c);
      scales = Int4GroupScales(parts.codes, parts.rows);
    } else {
      scales = t.scale.to(at::kFloat);
    }
    const int64_t groups = scales.size(1);
    const at::Tensor scaled = values.view({c, groups, -1}) * scales.unsqueeze(2);
    const at::Tensor widened = scaled.to(dtype).view({c, -1});
    return (format == CompressFormat::kInt4 ? widened : widened.reshape(t.q.sizes())).contiguous();
  }
  const at::Tensor q2d = t.q.reshape({t.q.size(0), -1});
  at::Tensor values = format == CompressFormat::kInt8
                          ? q2d.to(at::kFloat)
                          : Fp8E4M3FloatTableOn(q2d.device())
                                .index_select(0, q2d.reshape({-1}).to(at::kLong))
                                .view(q2d.sizes());
  return (values * t.scale.to(at::kFloat).unsqueeze(1)).to(dtype).reshape(t.q.sizes()).contiguous();
}

#ifdef STOWAGE_WITH_CUDA
namespace {

// A CUDA widening's arguments (widen_kernels.h), checked.
struct CudaWiden {
  widen_cuda::Codes codes;
  widen_cuda::ScaleKind scale_kind;
  widen_cuda::OutType out_type;
  widen_cuda::WidenJob job;
};

CudaWiden CudaWidenOf(const at::Tensor& out, const at::Tensor& q, const at::Tensor& scale, CompressFormat format) {
  TORCH_CHECK(out.is_contiguous() && q.is_contiguous() && scale.is_contiguous(), "WidenInto: not contiguous");
  TORCH_CHECK(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf ||
                  out.scalar_type() == at::kFloat || IsFloat8(out.scalar_type()),
              "WidenInto: unsupported compute dtype ", out.scalar_type());
  const bool int4 = format == CompressFormat::kInt4;
  TORCH_CHECK(scale.scalar_type() == (int4 ? at::kByte : at::kFloat), "WidenInto: ", CompressFormatName(format),
              " scales are ", int4 ? "bytes" : "float32", ", not ", scale.scalar_type());
  const int64_t channels = q.size(0);
  const int64_t k = out.numel() / std::max<int64_t>(1, channels);
  const bool grouped = format == CompressFormat::kInt8Grouped || int4;
  const int64_t groups = int4 ? (scale.numel() - 4 * channels) / channels : scale.numel() / channels;
  TORCH_CHECK(groups > 0 && k % groups == 0, "WidenInto: ", scale.numel(), " scale bytes or values for ", channels,
              " channels of ", k, " values");
  CudaWiden w;
  w.codes = format == CompressFormat::kFp8E4M3 ? widen_cuda::Codes::kFp8E4M3
            : int4                             ? widen_cuda::Codes::kInt4
                                               : widen_cuda::Codes::kInt8;
  w.scale_kind = int4 ? widen_cuda::ScaleKind::kE4M3Rows : widen_cuda::ScaleKind::kFloat;
  w.out_type = out.scalar_type() == at::kBFloat16 ? widen_cuda::OutType::kBFloat16
               : out.scalar_type() == at::kHalf   ? widen_cuda::OutType::kHalf
               : IsFloat8(out.scalar_type())      ? widen_cuda::OutType::kFp8E4M3
                                                  : widen_cuda::OutType::kFloat;
  w.job.q = q.data_ptr();
  w.job.scale = scale.data_ptr();
  w.job.out = out.data_ptr();
  w.job.channels = channels;
  w.job.k = k;
  w.job.group_size = grouped ? k / groups : k;
  return w;
}

}  // namespace
#endif

bool SetWideningLayout(absl::string_view name) {
  if (name != "coalesced" && name != "strided") return false;
#ifdef STOWAGE_WITH_CUDA
  widen_cuda::SetLayout(name == "strided" ? widen_cuda::Layout::kStrided : widen_cuda::Layout::kCoalesced);
#endif
  return true;
}

std::string WideningLayoutName() {
#ifdef STOWAGE_WITH_CUDA
  if (widen_cuda::CurrentLayout() == widen_cuda::Layout::kStrided) return "strided";
#endif
  return "coalesced";
}

void WidenAllInto(const std::vector<WidenTarget>& targets, CompressFormat format, const WidenScratch& scratch) {
#ifdef STOWAGE_WITH_CUDA
  // By output type (one format: one codes and scale kind), the CUDA targets' jobs; the rest alone.
  std::vector<widen_cuda::WidenJob> jobs[4];
  CudaWiden last{};
  c10::Device device = at::kCPU;
  for (const WidenTarget& t : targets) {
    if (!t.out.is_cuda()) {
      WidenInto(t.out, t.q, t.scale, format, scratch);
      continue;
    }
    TORCH_CHECK(device.is_cpu() || t.out.device() == device, "WidenAllInto: outputs on two devices");
    device = t.out.device();
    last = CudaWidenOf(t.out, t.q, t.scale, format);
    jobs[static_cast<int>(last.out_type)].push_back(last.job);
  }
  if (device.is_cpu()) return;
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index()).stream();
  for (int type = 0; type < 4; ++type) {
    if (jobs[type].empty()) continue;
    const int err = widen_cuda::WidenMany(last.codes, last.scale_kind, static_cast<widen_cuda::OutType>(type),
                                          jobs[type].data(), static_cast<int>(jobs[type].size()), stream);
    TORCH_CHECK(err == 0, "widening kernels failed to launch (CUDA error ", err, ")");
  }
#else
  for (const WidenTarget& t : targets) WidenInto(t.out, t.q, t.scale, format, scratch);
#endif
}

void WidenInto(const at::Tensor& out, const at::Tensor& q, const at::Tensor& scale, CompressFormat format,
               const WidenScratch& scratch) {
  const int64_t channels = q.size(0);
#ifdef STOWAGE_WITH_CUDA
  if (out.is_cuda()) {
    const c10::cuda::CUDAGuard guard(out.device());
    const CudaWiden w = CudaWidenOf(out, q, scale, format);
    const int err = widen_cuda::Widen(w.codes, w.job.q, w.job.scale, w.scale_kind, w.job.out, w.out_type,
                                      w.job.channels, w.job.k, w.job.group_size,
                                      c10::cuda::getCurrentCUDAStream(out.device().index()).stream());
    TORCH_CHECK(err == 0, "widening kernel failed to launch (CUDA error ", err, ")");
    return;
  }
#endif
  // FP8 compute runs on CUDA only (fused::Fp8Supported), so FP8 weights are widened there only.
  TORCH_CHECK(!IsFloat8(out.scalar_type()), "WidenInto: widening into float8 runs on CUDA only");
  if (format == CompressFormat::kInt4) {
    const at::Tensor packed = q.view({channels, -1});
    const at::Tensor pairs = out.view({channels, -1, 2});
    at::Tensor nibbles = scratch.nibbles.narrow(0, 0, packed.numel()).view(packed.sizes());
    at::bitwise_and_out(nibbles, packed, 15);
    pairs.select(2, 0).copy_(nibbles);
    at::bitwise_right_shift_out(nibbles, packed, 4);
    pairs.select(2, 1).copy_(nibbles);
    out.sub_(8);
    // The group scales, rows in chunks through the (now free) nibble buffer: an int32 index of the
    // codes and their fp32 values, 8 bytes a group.
    const Int4Scales parts = SplitInt4Scales(scale, channels);
    const int64_t groups = parts.codes.size(1);
    const int64_t chunk_rows = std::max<int64_t>(1, scratch.nibbles.numel() / 8 / groups);
    TORCH_CHECK(scratch.nibbles.numel() >= 8 * groups, "WidenInto: int4 scratch of ", scratch.nibbles.numel(),
                " bytes holds no row of ", groups, " scales");
    const at::Tensor out3 = out.view({channels, groups, -1});
    for (int64_t row = 0; row < channels; row += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, channels - row);
      const int64_t n = rows * groups;
      const at::Tensor index = scratch.nibbles.narrow(0, 0, 4 * n).view(at::kInt);
      at::Tensor values = scratch.nibbles.narrow(0, 4 * n, 4 * n).view(at::kFloat);
      index.copy_(parts.codes.narrow(0, row, rows).reshape({-1}));
      at::index_select_out(values, scratch.table_f32, 0, index);
      const at::Tensor group_scales = values.view({rows, groups});
      group_scales.mul_(parts.rows.narrow(0, row, rows).unsqueeze(1));
      out3.narrow(0, row, rows).mul_(group_scales.unsqueeze(2));
    }
    return;
  }
  if (format == CompressFormat::kInt8Grouped) {
    const int64_t groups = scale.numel() / channels;
    out.copy_(q);
    out.view({channels, groups, -1}).mul_(scale.view({channels, groups, 1}));
    return;
  }
  if (format == CompressFormat::kInt8) {
    out.copy_(q);
  } else {
    const at::Tensor& table = TableFor(scratch, out.scalar_type());
    const at::Tensor out_flat = out.view({-1});
    const at::Tensor q_flat = q.view({-1});
    const int64_t n = q_flat.numel();
    const int64_t chunk = scratch.index.numel();
    for (int64_t start = 0; start < n; start += chunk) {
      const int64_t len = std::min(chunk, n - start);
      const at::Tensor index = scratch.index.narrow(0, 0, len);
      index.copy_(q_flat.narrow(0, start, len));
      at::Tensor slice = out_flat.narrow(0, start, len);
      at::index_select_out(slice, table, 0, index);
    }
  }
  out.view({channels, -1}).mul_(scale.unsqueeze(1));
}

int64_t TensorScratchBytes(CompressFormat format, at::ScalarType dtype, at::IntArrayRef sizes) {
  if (!IsCompressible(format, dtype, sizes)) return 0;
  const QuantLayout layout = LayoutOf(format, sizes);
  return AlignScratch(layout.q_bytes) + AlignScratch(layout.scale_bytes());
}

int64_t FixedScratchBytes(CompressFormat format, bool has_f32, bool has_bf16, bool has_f16, int64_t max_numel) {
  if (format == CompressFormat::kInt4 && max_numel > 0) return Int4TableOffset(max_numel) + AlignScratch(256 * 4);
  if (format != CompressFormat::kFp8E4M3 || max_numel <= 0) return 0;
  return (has_f32 ? AlignScratch(256 * 4) : 0) + (has_bf16 ? AlignScratch(256 * 2) : 0) +
         (has_f16 ? AlignScratch(256 * 2) : 0) + AlignScratch(4 * std::min(max_numel, kFp8DecodeChunkElements));
}

}  // namespace stowage
