// LoadQuantizer: quantizes host weights at load straight into the host buffers a compressed store
// keeps (its pinned groups), on the device when there is one.
//
// On a GPU a tensor goes through in chunks of rows (at most kQuantizeChunkElements values): the
// copy threads read a chunk from its source (a safetensors file's mapping or the heap) into one of
// two pinned staging halves, the device copies it in, quantizes it and copies its codes and scales
// straight into the destination — pinned memory, so at the link's speed with no pageable
// temporaries and no second host copy — while the threads already read the next chunk into the
// other half. The host's part is one parallel read of the weights; the device's runs beside it.
// On the CPU (and the simulator, whose tensors are CPU tensors) each chunk is quantized on the host
// from its source. Either way the bytes written are those of Quantize() on that device, chunk by
// chunk: every format is row-local, so for the 8-bit formats they equal the whole tensor's
// Quantize() bit for bit (int4: see kQuantizeChunkElements in compression.h). When the device refuses (out of
// memory under a budget) the tensor is quantized on the host instead.
//
// Thread-safety: one thread uses a LoadQuantizer (the device's worker, at load).
// Lifetime: the destination of each QuantizeInto must stay alive until Finish() returns; the source
// may go as soon as QuantizeInto returns (it has been read).
//
//   ASSIGN_OR_RETURN(auto quantizer, LoadQuantizer::Create(backend, /*max_numel=*/n, /*threads=*/8));
//   quantizer->QuantizeInto(w, CompressFormat::kInt4, q_bytes_view, scale_bytes_view);
//   ...
//   quantizer->Finish();  // Every destination written.
#ifndef STOWAGE_OFFLOAD_LOAD_QUANTIZER_H_
#define STOWAGE_OFFLOAD_LOAD_QUANTIZER_H_

#include <cstdint>
#include <memory>

#include <ATen/core/Tensor.h>

#include "absl/status/statusor.h"
#include "offload/compression.h"
#include "offload/device_backend.h"
#include "offload/memcpy_pool.h"

namespace stowage {

class LoadQuantizer {
 public:
  // `max_numel`: the largest tensor it will quantize (sizes the staging: two halves of
  // min(max_numel, chunk_elements) bf16 values, pinned; none on the CPU; a tensor with a row larger
  // than a half is quantized on the host). `copy_threads` (>= 1)
  // read the sources. `chunk_elements` (>= 1): values a chunk holds at most (tests set it small).
  // `stage_on_cpu`: take the device path (staging halves, copies, events) even where the device is
  // the CPU, so tests without a GPU run it; otherwise the CPU quantizes from the source.
  static absl::StatusOr<std::unique_ptr<LoadQuantizer>> Create(DeviceBackend& backend, int64_t max_numel,
                                                               int copy_threads,
                                                               int64_t chunk_elements = kQuantizeChunkElements,
                                                               bool stage_on_cpu = false);
  LoadQuantizer(const LoadQuantizer&) = delete;
  LoadQuantizer& operator=(const LoadQuantizer&) = delete;
  ~LoadQuantizer();

  // Quantizes `w` (host, contiguous or not, IsCompressible(format, ...), numel <= max_numel) into
  // `q_out` and `scale_out`: uint8 host tensors of LayoutOf(format, w.sizes()).q_bytes and
  // .scale_bytes(), laid out as Quantize()'s q and scale. The writes may still be in flight when it
  // returns (Finish waits for them); `w` has been read. True when it ran on the host (its
  // temporaries then came from the host heap; the device path allocates none there).
  bool QuantizeInto(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out, const at::Tensor& scale_out);

  // QuantizeInto of `w`'s FP8 form — kFp8E4M3's Quantize(w): e4m3 codes and one fp32 scale a row,
  // what FP8 compute makes of a weight — without making that form on the host: each chunk of w's
  // rows (fp32, bf16 or fp16, on the host) is quantized to FP8 where QuantizeInto would quantize it
  // (the device, or the host), its codes quantized on to `format` (which must take float8 e4m3:
  // kInt4) into `q_out` / `scale_out`, and its FP8 scales copied into `fp8_scale_out` (uint8, 4 bytes
  // a row). The bytes are those of QuantizeInto(the FP8 codes as float8) and of the FP8 scales: one
  // pass over the source instead of an FP8 copy written, kept and read again. Throws c10::Error where
  // this LibTorch has no float8 types. True when it ran on the host.
  bool QuantizeFp8Into(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out, const at::Tensor& scale_out,
                       const at::Tensor& fp8_scale_out);

  // Waits until every destination holds its bytes.
  void Finish();

  // Bytes of one staging half (0: no device path): a tensor whose row outgrows it is quantized on
  // the host.
  int64_t staging_half_bytes() const { return staging_.defined() ? half_bytes_ : 0; }

  // Tensors quantized on the host because the device refused them (out of memory).
  int64_t host_fallbacks() const { return host_fallbacks_; }

  // Bytes of sources in a safetensors mapping (ReleaseMappedPages) dropped from the RSS as their
  // chunks were read — a chunk at a time, so a tensor's source never sits in the RSS whole.
  int64_t released_bytes() const { return released_bytes_; }

 private:
  LoadQuantizer(DeviceBackend& backend, int64_t chunk_elements);
  // `fp8_scale_out` defined: `w` is quantized to FP8 first (QuantizeFp8Into).
  bool Run(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out, const at::Tensor& scale_out,
           const at::Tensor& fp8_scale_out);
  void QuantizeOnHost(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out, const at::Tensor& scale_out,
                      const at::Tensor& fp8_scale_out);
  void QuantizeOnDevice(const at::Tensor& w, CompressFormat format, const at::Tensor& q_out,
                        const at::Tensor& scale_out, const at::Tensor& fp8_scale_out);

  DeviceBackend* backend_;
  const int64_t chunk_elements_;
  std::unique_ptr<MemcpyPool> pool_;       // The device path only.
  at::Tensor staging_;                      // Pinned, two halves (the device path only).
  int64_t half_bytes_ = 0;
  std::unique_ptr<DeviceEvent> copied_[2];  // A half's last copy to the device is done.
  int next_half_ = 0;
  int64_t host_fallbacks_ = 0;
  int64_t released_bytes_ = 0;
};

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_LOAD_QUANTIZER_H_
