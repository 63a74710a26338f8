#include "offload/load_quantizer.h"

#include <algorithm>
#include <utility>

#include <ATen/Functions.h>
#include <torch/version.h>
#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"
#include "offload/safetensors.h"

namespace stowage {
namespace {

// The bytes of a contiguous tensor, on its own device (the view does not own them).
at::Tensor BytesView(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), {static_cast<int64_t>(t.nbytes())}, t.options().dtype(at::kByte));
}

// Writes the quantized rows [start, start + n) of a tensor of `rows` rows into the whole tensor's
// layout (compression.h): q row by row; the scales row by row, but for kInt4 whose buffer is every
// row's fp32 scale first, then every row's group codes.
void PlaceChunk(const QuantizedTensor& part, CompressFormat format, int64_t rows, int64_t start, int64_t n,
                const at::Tensor& q_out, const at::Tensor& scale_out, bool non_blocking) {
  const at::Tensor q = part.q.contiguous();
  const at::Tensor scale = part.scale.contiguous();
  const int64_t q_row = static_cast<int64_t>(q.nbytes()) / n;
  q_out.narrow(0, start * q_row, n * q_row).copy_(BytesView(q), non_blocking);
  const at::Tensor scale_bytes = BytesView(scale);
  if (format == CompressFormat::kInt4) {
    const int64_t codes = (scale_bytes.numel() - 4 * n) / n;  // Group codes a row.
    scale_out.narrow(0, 4 * start, 4 * n).copy_(scale_bytes.narrow(0, 0, 4 * n), non_blocking);
    scale_out.narrow(0, 4 * rows + start * codes, n * codes)
        .copy_(scale_bytes.narrow(0, 4 * n, n * codes), non_blocking);
    return;
  }
  const int64_t scale_row = scale_bytes.numel() / n;
  scale_out.narrow(0, start * scale_row, n * scale_row).copy_(scale_bytes, non_blocking);
}

// Quantize(chunk, format), or with `fp8_scale_out` defined Quantize(its FP8 codes, format) after
// its FP8 scales (rows [start, start + n) of the weight) are copied into `fp8_scale_out`.
QuantizedTensor QuantizeChunk(const at::Tensor& chunk, CompressFormat format, const at::Tensor& fp8_scale_out,
                              int64_t start, int64_t n, bool non_blocking) {
  if (!fp8_scale_out.defined()) return Quantize(chunk, format);
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
  const QuantizedTensor fp8 = Quantize(chunk, CompressFormat::kFp8E4M3);
  fp8_scale_out.narrow(0, 4 * start, 4 * n).copy_(BytesView(fp8.scale.contiguous()), non_blocking);
  return Quantize(fp8.q.view(at::kFloat8_e4m3fn), format);
#else
  (void)format, (void)start, (void)n, (void)non_blocking;
  TORCH_CHECK(false, "QuantizeFp8Into: this LibTorch has no float8 types");
#endif
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadQuantizer>> LoadQuantizer::Create(DeviceBackend& backend, int64_t max_numel,
                                                                     int copy_threads, int64_t chunk_elements,
                                                                     bool stage_on_cpu) {
  if (copy_threads < 1) {
    return absl::InvalidArgumentError(absl::StrCat("load quantizer: copy_threads must be >= 1, not ", copy_threads));
  }
  if (chunk_elements < 1 || max_numel < 0) {
    return absl::InvalidArgumentError(absl::StrCat("load quantizer: chunk_elements ", chunk_elements,
                                                   " must be >= 1 and max_numel ", max_numel, " >= 0"));
  }
  std::unique_ptr<LoadQuantizer> quantizer(new LoadQuantizer(backend, chunk_elements));
  if ((backend.torch_device().is_cpu() && !stage_on_cpu) || max_numel == 0) return quantizer;
  quantizer->pool_ = std::make_unique<MemcpyPool>(copy_threads - 1);
  // Two halves of the largest chunk in bf16 (32 MB each at most: the staging is pinned and counts in
  // the host RSS while loading); an fp32 tensor goes through in chunks of half as many rows.
  quantizer->half_bytes_ = AlignScratch(std::min(max_numel, chunk_elements) * 2);
  auto staging = backend.AllocatePinnedHost(2 * quantizer->half_bytes_);
  // Where the host refuses pinned memory the halves are pageable: the device path still runs, its
  // copies in at pageable speed.
  quantizer->staging_ = staging.ok() ? *std::move(staging)
                                     : at::empty({2 * quantizer->half_bytes_}, at::TensorOptions().dtype(at::kByte));
  return quantizer;
}

LoadQuantizer::LoadQuantizer(DeviceBackend& backend, int64_t chunk_elements)
    : backend_(&backend), chunk_elements_(chunk_elements) {}

LoadQuantizer::~LoadQuantizer() { Finish(); }

void LoadQuantizer::Finish() {
  if (staging_.defined()) backend_->Synchronize();
}

bool LoadQuantizer::QuantizeInto(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out,
                                 const at::Tensor& scale_out) {
  return Run(w, format, q_out, scale_out, at::Tensor());
}

bool LoadQuantizer::QuantizeFp8Into(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out,
                                    const at::Tensor& scale_out, const at::Tensor& fp8_scale_out) {
  TORCH_CHECK(w.dim() >= 2 && fp8_scale_out.defined() && fp8_scale_out.scalar_type() == at::kByte &&
                  fp8_scale_out.numel() == 4 * w.size(0),
              "QuantizeFp8Into: want ", 4 * (w.dim() >= 1 ? w.size(0) : 0), " bytes of FP8 scales, got ",
              fp8_scale_out.defined() ? fp8_scale_out.numel() : 0);
  return Run(w, format, q_out, scale_out, fp8_scale_out);
}

bool LoadQuantizer::Run(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out,
                        const at::Tensor& scale_out, const at::Tensor& fp8_scale_out) {
  const QuantLayout layout = LayoutOf(format, w.sizes());
  TORCH_CHECK(q_out.numel() == layout.q_bytes && scale_out.numel() == layout.scale_bytes() &&
                  q_out.scalar_type() == at::kByte && scale_out.scalar_type() == at::kByte,
              "QuantizeInto: want ", layout.q_bytes, " + ", layout.scale_bytes(), " destination bytes, got ",
              q_out.numel(), " + ", scale_out.numel());
  const int64_t per_row = w.numel() / w.size(0);
  // The device path needs a staging half to hold at least one row.
  if (!staging_.defined() || per_row * static_cast<int64_t>(w.element_size()) > half_bytes_) {
    QuantizeOnHost(w, format, q_out, scale_out, fp8_scale_out);
    return true;
  }
  try {
    QuantizeOnDevice(w, format, q_out, scale_out, fp8_scale_out);
    return false;
  } catch (const c10::OutOfMemoryError&) {
    // The device refused (out of memory under a budget). Whatever it had queued for this tensor
    // must land before the host writes the same bytes. Any other error is a bug and propagates.
    backend_->Synchronize();
    ++host_fallbacks_;
    QuantizeOnHost(w, format, q_out, scale_out, fp8_scale_out);
    return true;
  }
}

void LoadQuantizer::QuantizeOnHost(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out,
                                   const at::Tensor& scale_out, const at::Tensor& fp8_scale_out) {
  const int64_t rows = w.size(0);
  const int64_t chunk_rows = std::max<int64_t>(1, chunk_elements_ / (w.numel() / rows));
  for (int64_t start = 0; start < rows; start += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - start);
    const at::Tensor chunk = w.narrow(0, start, n);
    PlaceChunk(QuantizeChunk(chunk, format, fp8_scale_out, start, n, /*non_blocking=*/false), format, rows, start, n,
               q_out, scale_out, /*non_blocking=*/false);
    if (chunk.is_contiguous()) {
      released_bytes_ += ReleaseMappedPages(chunk.data_ptr(), static_cast<int64_t>(chunk.nbytes()));
    }
  }
}

void LoadQuantizer::QuantizeOnDevice(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out,
                                     const at::Tensor& scale_out, const at::Tensor& fp8_scale_out) {
  const int64_t rows = w.size(0);
  const int64_t per_row = w.numel() / rows;
  const auto row_bytes = per_row * static_cast<int64_t>(w.element_size());
  const int64_t chunk_rows =
      std::max<int64_t>(1, std::min(chunk_elements_ / per_row, half_bytes_ / row_bytes));
  const at::Tensor src = w.contiguous();  // A view when it is already (the usual case).
  const auto* src_bytes = static_cast<const uint8_t*>(src.data_ptr());
  const c10::Device device = backend_->torch_device();  // Its launches guard their own device.
  for (int64_t start = 0; start < rows; start += chunk_rows) {
    const int64_t n = std::min(chunk_rows, rows - start);
    const int half = next_half_;
    next_half_ ^= 1;
    // The half's previous chunk has reached the device: its bytes may be overwritten.
    if (copied_[half] != nullptr) copied_[half]->Wait();
    uint8_t* staged = staging_.data_ptr<uint8_t>() + half * half_bytes_;
    pool_->Copy(staged, src_bytes + start * row_bytes, n * row_bytes);
    // Read: a source in a safetensors mapping leaves the RSS chunk by chunk, not a whole tensor at once.
    released_bytes_ += ReleaseMappedPages(src_bytes + start * row_bytes, n * row_bytes);
    const at::Tensor host_chunk = at::from_blob(staged, {n, per_row}, at::TensorOptions().dtype(w.scalar_type()));
    at::Tensor chunk = at::empty({n, per_row}, host_chunk.options().device(device));
    chunk.copy_(host_chunk, /*non_blocking=*/true);
    copied_[half] = backend_->RecordOnComputeStream();
    // Quantized where the copy landed (the current stream), straight into the pinned destination.
    PlaceChunk(QuantizeChunk(chunk, format, fp8_scale_out, start, n, /*non_blocking=*/true), format, rows, start, n,
               q_out, scale_out, /*non_blocking=*/true);
  }
}

}  // namespace stowage
