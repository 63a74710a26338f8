#include "offload/compressed_safetensors.h"

#include <set>

#include <memory>

#include <ATen/ATen.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "offload/safetensors.h"

namespace stowage {

absl::Status WriteCompressedSafetensors(const std::string& path,
                                        const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                        CompressFormat format) {
  if (format != CompressFormat::kInt8 && format != CompressFormat::kFp8E4M3) {
    return absl::InvalidArgumentError(absl::StrCat("WriteCompressedSafetensors needs int8 or fp8_e4m3, not ",
                                                   CompressFormatName(format),
                                                   " (grouped and 4-bit copies are made at load)"));
  }
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, t] : tensors) {
    if (IsCompressible(format, t.scalar_type(), t.sizes())) {
      QuantizedTensor q = Quantize(t, format);
      out.emplace_back(name, q.q);
      out.emplace_back(absl::StrCat(name, ".scale"), q.scale);
    } else {
      out.emplace_back(name, t);
    }
  }
  return WriteSafetensors(path, out, {{kCompressMetadataKey, CompressFormatName(format)}});
}

bool HoldsFloat8(const SafetensorsFile& file) {
  for (const auto& [name, info] : file.tensors()) {
    if (info.float8_e4m3) return true;
  }
  return false;
}

namespace {

// The common fp8 layouts (see the header): F8_E4M3 weights with a per-tensor or per-channel scale
// under one of the names trainers and quantizers write, or none (scale 1).
}  // namespace

std::vector<std::string> Float8ScaleNames(const std::string& name) {
  // compressed-tensors (llm-compressor, vLLM): "<layer>.weight_scale"; this server's convention:
  // "<weight>.scale"; ComfyUI's scaled fp8: "<layer>.scale_weight".
  std::vector<std::string> names = {name + "_scale", name + ".scale"};
  if (absl::EndsWith(name, ".weight")) names.push_back(name.substr(0, name.size() - 7) + ".scale_weight");
  return names;
}

bool IsFloat8Auxiliary(const std::string& name) {
  return absl::EndsWith(name, ".input_scale") || absl::EndsWith(name, ".scale_input") || name == "scaled_fp8" ||
         absl::EndsWith(name, ".scaled_fp8");
}

absl::StatusOr<at::Tensor> Float8ChannelScales(const at::Tensor& scale, int64_t out, const std::string& scale_name) {
  const std::vector<int64_t> shape = scale.sizes().vec();
  const bool shaped = shape.empty() || shape == std::vector<int64_t>{1} || shape == std::vector<int64_t>{out} ||
                      shape == std::vector<int64_t>{out, 1};
  if (!(scale.scalar_type() == at::kFloat || scale.scalar_type() == at::kBFloat16 ||
        scale.scalar_type() == at::kHalf) || !shaped) {
    return absl::InvalidArgumentError(absl::StrCat("scale '", scale_name.substr(0, 200),
                                                   "' must be F32, BF16 or F16 of shape [], [1], [", out, "] or [",
                                                   out, ", 1]"));
  }
  at::Tensor channels = scale.to(at::kFloat).reshape({-1}).expand({out}).contiguous().clone();
  if (!at::isfinite(channels).all().item<bool>() || !(channels > 0).all().item<bool>()) {
    return absl::InvalidArgumentError(absl::StrCat("scale '", scale_name.substr(0, 200),
                                                   "' holds a value that is not finite and positive"));
  }
  return channels;
}

namespace {

template <typename Invalid>
absl::StatusOr<CompressedCheckpoint> ReadFloat8Checkpoint(SafetensorsFile& file, const Invalid& invalid) {
  CompressedCheckpoint checkpoint;
  checkpoint.format = CompressFormat::kFp8E4M3;
  std::set<std::string> consumed;
  for (const auto& [name, info] : file.tensors()) {
    if (!info.float8_e4m3 || IsFloat8Auxiliary(name)) continue;  // ComfyUI's marker is an F8 tensor too.
    const std::string shown = absl::StrCat("F8_E4M3 tensor '", name.substr(0, 200), "'");
    if (info.shape.size() != 2) {
      return invalid(absl::StrCat(shown, " has rank ", info.shape.size(),
                                  "; fp8 checkpoints hold 2-D weights ([out, in]) only"));
    }
    const int64_t out = info.shape[0];
    at::Tensor scale;
    for (const std::string& candidate : Float8ScaleNames(name)) {
      auto found = file.tensors().find(candidate);
      if (found == file.tensors().end()) continue;
      if (found->second.float8_e4m3) {
        return invalid(absl::StrCat("scale '", candidate.substr(0, 200), "' of ", shown, " is F8_E4M3"));
      }
      ASSIGN_OR_RETURN(at::Tensor t, file.Get(candidate));
      absl::StatusOr<at::Tensor> channels = Float8ChannelScales(t, out, candidate);
      if (!channels.ok()) return invalid(absl::StrCat(channels.status().message(), " (of ", shown, ")"));
      scale = *channels;
      consumed.insert(candidate);
      break;
    }
    if (!scale.defined()) {
      scale = at::ones({out}, at::TensorOptions().dtype(at::kFloat));
      checkpoint.unscaled.push_back(name);
    }
    ASSIGN_OR_RETURN(at::Tensor q, file.Get(name));
    // 0x7F and 0xFF are e4m3fn's NaN: a weight that is not a number.
    if ((q.bitwise_and(0x7F) == 0x7F).any().item<bool>()) {
      return invalid(absl::StrCat(shown, " holds NaN bit patterns (0x7f / 0xff)"));
    }
    checkpoint.quantized[name] = QuantizedTensor{q.clone(), scale};
    consumed.insert(name);
  }
  for (const auto& [name, info] : file.tensors()) {
    if (consumed.count(name) > 0) continue;
    // Activation scales and markers of the fp8 layouts: this server quantizes activations itself.
    if (IsFloat8Auxiliary(name)) continue;
    ASSIGN_OR_RETURN(at::Tensor t, file.Get(name));
    checkpoint.plain[name] = t.clone();
  }
  RETURN_IF_ERROR(file.CheckUnchanged());
  return checkpoint;
}

}  // namespace

absl::StatusOr<CompressedCheckpoint> ReadCompressedSafetensors(const std::string& path) {
  ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("8-bit safetensors file '", path, "': ", what));
  };
  const auto meta = file->metadata().find(kCompressMetadataKey);
  if (meta == file->metadata().end()) {
    if (HoldsFloat8(*file)) return ReadFloat8Checkpoint(*file, invalid);
    return invalid(absl::StrCat("no \"", kCompressMetadataKey, "\" metadata and no F8_E4M3 tensors"));
  }
  CompressedCheckpoint checkpoint;
  absl::StatusOr<CompressFormat> format = ParseCompressFormat(meta->second);
  if (!format.ok() || (*format != CompressFormat::kInt8 && *format != CompressFormat::kFp8E4M3)) {
    return invalid("unknown compression format (checkpoints hold int8 or fp8_e4m3)");
  }
  checkpoint.format = *format;
  const at::ScalarType qtype = checkpoint.format == CompressFormat::kInt8 ? at::kChar : at::kByte;
  for (const auto& [name, info] : file->tensors()) {
    if (info.dtype != at::kChar && info.dtype != at::kByte) continue;
    if (info.dtype != qtype) {
      return invalid(absl::StrCat("tensor '", name.substr(0, 200), "' is ", SafetensorsDtypeName(info.dtype),
                                  ", not the format's ", SafetensorsDtypeName(qtype)));
    }
    const std::string scale_name = absl::StrCat(name, ".scale");
    const auto scale_info = file->tensors().find(scale_name);
    if (info.shape.size() < 2 || scale_info == file->tensors().end() ||
        (scale_info->second.dtype != at::kFloat && scale_info->second.dtype != at::kBFloat16) ||
        scale_info->second.shape != std::vector<int64_t>{info.shape[0]}) {
      return invalid(absl::StrCat("tensor '", name.substr(0, 200), "' needs a scale '.scale' of F32 or BF16 [",
                                  info.shape.empty() ? 0 : info.shape[0], "] and rank >= 2"));
    }
    ASSIGN_OR_RETURN(at::Tensor q, file->Get(name));
    ASSIGN_OR_RETURN(at::Tensor scale, file->Get(scale_name));
    // Copied out of the mapping: the store packs them into pinned memory anyway.
    checkpoint.quantized[name] = QuantizedTensor{q.clone(), scale.to(at::kFloat).contiguous().clone()};
  }
  for (const auto& [name, info] : file->tensors()) {
    if (checkpoint.quantized.count(name) > 0) continue;
    if (absl::EndsWith(name, ".scale") &&
        checkpoint.quantized.count(name.substr(0, name.size() - 6)) > 0) {
      continue;
    }
    ASSIGN_OR_RETURN(at::Tensor t, file->Get(name));
    checkpoint.plain[name] = t.clone();
  }
  RETURN_IF_ERROR(file->CheckUnchanged());
  return checkpoint;
}

}  // namespace stowage
