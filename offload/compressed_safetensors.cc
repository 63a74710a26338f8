#include "offload/compressed_safetensors.h"

#include <memory>

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

absl::StatusOr<CompressedCheckpoint> ReadCompressedSafetensors(const std::string& path) {
  ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  auto invalid = [&](const std::string& what) {
    return absl::InvalidArgumentError(absl::StrCat("8-bit safetensors file '", path, "': ", what));
  };
  const auto meta = file->metadata().find(kCompressMetadataKey);
  if (meta == file->metadata().end()) return invalid(absl::StrCat("no \"", kCompressMetadataKey, "\" metadata"));
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
