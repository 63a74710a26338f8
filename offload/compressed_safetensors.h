// 8-bit safetensors checkpoints: the on-disk convention for weights kept as int8 or fp8 e4m3 with
// per-output-channel scales, a writer, and a reader whose result feeds the compressed store
// (HostStoreOptions::prequantized) and the module's compute-dtype host copies.
//
// Convention (one file; any tensor names):
//   metadata  {"stowage_compress": "int8" | "fp8_e4m3"}
//   "W"        I8 (int8) or U8 (fp8 e4m3fn bits), W's shape: every compressed weight (rank >= 2,
//              floating in the source; offload/compression.h says which)
//   "W.scale"  F32 or BF16, shape [W's dim 0]: its per-output-channel scales
//   "B"        any other tensor (biases, norms) in its compute dtype, uncompressed
// A name ending in ".scale" whose prefix is an I8/U8 tensor is a scale; every I8/U8 tensor needs
// its scale.
//
// Where it is used: the diffusers-format loader (models/core/diffusers_format.cc) recognises such files
// in a component folder by their metadata, dequantizes them into the module and hands the 8-bit
// values to the component (Component::set_prequantized); placement passes those to 8-bit group
// offloading of the same format, which then streams the checkpoint's bytes as they are
// (tests/placement/quantized_checkpoint_test.cc).
//
// Thread-safety: reentrant.
#ifndef STOWAGE_OFFLOAD_COMPRESSED_SAFETENSORS_H_
#define STOWAGE_OFFLOAD_COMPRESSED_SAFETENSORS_H_

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "offload/compression.h"

namespace stowage {

inline constexpr char kCompressMetadataKey[] = "stowage_compress";

// Quantizes every compressible tensor of `tensors` (CPU, compute dtype) to `format` (int8 or
// fp8_e4m3) and writes the file atomically.
absl::Status WriteCompressedSafetensors(const std::string& path,
                                        const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                        CompressFormat format);

struct CompressedCheckpoint {
  CompressFormat format = CompressFormat::kNone;
  PrequantizedWeights quantized;         // By name: q (I8/U8, in RAM) and fp32 scales.
  std::map<std::string, at::Tensor> plain;  // Everything else, as stored.
};

// Reads a file written by WriteCompressedSafetensors (or any file following the convention).
// INVALID_ARGUMENT when the metadata is missing or unknown, a scale is missing or has the wrong
// shape or dtype, or an 8-bit tensor's dtype does not match the format.
absl::StatusOr<CompressedCheckpoint> ReadCompressedSafetensors(const std::string& path);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_COMPRESSED_SAFETENSORS_H_
