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
// Also read: the common fp8 checkpoint layouts, recognised by F8_E4M3 tensors (no metadata needed)
// and read as fp8_e4m3 with per-output-channel scales:
//   "<layer>.weight"        F8_E4M3 [out, in]
//   its scale, the first present of "<layer>.weight_scale" (compressed-tensors: llm-compressor,
//   vLLM), "<layer>.weight.scale" (the convention above) or "<layer>.scale_weight" (ComfyUI's scaled
//   fp8), F32/BF16/F16 of shape [] or [1] (per tensor, broadcast) or [out] or [out, 1] (per
//   channel); none: scale 1 (plain fp8 casts of a checkpoint).
//   "<layer>.input_scale", "<layer>.scale_input" and "scaled_fp8" (activation scales, a marker) are
//   dropped: activations are quantised per token on the device. Everything else is read as stored.
// Refused naming the tensor: an F8_E4M3 tensor that is not 2-D, NaN bit patterns (0x7f / 0xff), a
// scale of another shape or dtype, or one that is not finite and positive. F8_E5M2 is not read.
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
  // fp8 layouts: weights whose scale is not in this file (scale 1 here; a sharded checkpoint may
  // hold it in another shard: Float8ScaleNames says where to look, ApplyFloat8Scale applies it).
  std::vector<std::string> unscaled;
};

// The names an fp8 layout may give the scale of weight `name`, in the order they are looked for.
std::vector<std::string> Float8ScaleNames(const std::string& name);
// True for the fp8 layouts' activation scales and markers, which are not read.
bool IsFloat8Auxiliary(const std::string& name);
// `scale` (F32/BF16/F16, [], [1], [out] or [out, 1]) as weight `q`'s per-channel fp32 scales;
// INVALID_ARGUMENT naming `scale_name` otherwise, or when not finite and positive.
absl::StatusOr<at::Tensor> Float8ChannelScales(const at::Tensor& scale, int64_t out, const std::string& scale_name);

class SafetensorsFile;
// True when `file` holds an F8_E4M3 tensor (read it with ReadCompressedSafetensors).
bool HoldsFloat8(const SafetensorsFile& file);

// Reads a file written by WriteCompressedSafetensors (or any file following the convention), or a
// file in one of the common fp8 layouts.
// INVALID_ARGUMENT when the metadata is missing or unknown, a scale is missing or has the wrong
// shape or dtype, or an 8-bit tensor's dtype does not match the format.
absl::StatusOr<CompressedCheckpoint> ReadCompressedSafetensors(const std::string& path);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_COMPRESSED_SAFETENSORS_H_
