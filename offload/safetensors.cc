#include "offload/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"

namespace stowage {

absl::StatusOr<at::ScalarType> SafetensorsDtype(const std::string& name) {
  if (name == "F32") return at::kFloat;
  if (name == "BF16") return at::kBFloat16;
  if (name == "F16") return at::kHalf;
  if (name == "F64") return at::kDouble;
  if (name == "I64") return at::kLong;
  if (name == "I32") return at::kInt;
  if (name == "U8") return at::kByte;
  if (name == "I8") return at::kChar;
  if (name == "BOOL") return at::kBool;
  return absl::InvalidArgumentError(absl::StrCat("unsupported safetensors dtype '", name, "'"));
}

std::string SafetensorsDtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "F32";
    case at::kBFloat16: return "BF16";
    case at::kHalf: return "F16";
    case at::kDouble: return "F64";
    case at::kLong: return "I64";
    case at::kInt: return "I32";
    case at::kByte: return "U8";
    case at::kChar: return "I8";
    case at::kBool: return "BOOL";
    default: return "UNKNOWN";
  }
}

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  google::protobuf::Struct header;
  std::vector<at::Tensor> contiguous;
  int64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (!tensor.device().is_cpu()) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", name, "' is not on the CPU"));
    }
    at::Tensor t = tensor.contiguous();
    google::protobuf::Struct info;
    (*info.mutable_fields())["dtype"].set_string_value(SafetensorsDtypeName(t.scalar_type()));
    auto* shape = (*info.mutable_fields())["shape"].mutable_list_value();
    for (int64_t d : t.sizes()) shape->add_values()->set_number_value(static_cast<double>(d));
    auto* offsets = (*info.mutable_fields())["data_offsets"].mutable_list_value();
    offsets->add_values()->set_number_value(static_cast<double>(offset));
    offset += static_cast<int64_t>(t.nbytes());
    offsets->add_values()->set_number_value(static_cast<double>(offset));
    *(*header.mutable_fields())[name].mutable_struct_value() = info;
    contiguous.push_back(std::move(t));
  }
  if (!metadata.empty()) {
    auto* meta = (*header.mutable_fields())["__metadata__"].mutable_struct_value();
    for (const auto& [k, v] : metadata) (*meta->mutable_fields())[k].set_string_value(v);
  }
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(header, &json).ok()) {
    return absl::InternalError("could not serialise the safetensors header");
  }
  while (json.size() % 8 != 0) json.push_back(' ');  // Keep the data section 8-byte aligned.
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", tmp, "'"));
    const uint64_t n = json.size();
    char len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    out.write(len, 8);
    out.write(json.data(), static_cast<std::streamsize>(json.size()));
    for (const at::Tensor& t : contiguous) {
      out.write(static_cast<const char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
    }
    out.flush();
    if (!out) {
      std::remove(tmp.c_str());
      return absl::ResourceExhaustedError(absl::StrCat("writing '", tmp, "' failed (disk full?)"));
    }
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    return absl::PermissionDeniedError(absl::StrCat("cannot rename '", tmp, "' to '", path, "'"));
  }
  return absl::OkStatus();
}

namespace {

// Live mappings: begin address → end address.
ABSL_CONST_INIT absl::Mutex mappings_mu(absl::kConstInit);
std::map<uintptr_t, uintptr_t>& Mappings() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mappings_mu) {
  static auto* mappings = new std::map<uintptr_t, uintptr_t>();
  return *mappings;
}

}  // namespace

absl::StatusOr<std::shared_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    return absl::InternalError(absl::StrCat("cannot stat '", path, "'"));
  }
  const int64_t size = st.st_size;
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors file '", path, "': ", why));
  };
  if (size < 8) {
    ::close(fd);
    return bad("shorter than its 8-byte header length (truncated?)");
  }
  void* mapping = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  ::close(fd);
  if (mapping == MAP_FAILED) return absl::InternalError(absl::StrCat("cannot mmap '", path, "'"));
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->self_ = file;
  file->path_ = path;
  file->mapping_ = mapping;
  file->mapping_bytes_ = size;
  {
    absl::MutexLock lock(&mappings_mu);
    Mappings()[reinterpret_cast<uintptr_t>(mapping)] = reinterpret_cast<uintptr_t>(mapping) + size;
  }
  const auto* bytes = static_cast<const uint8_t*>(mapping);
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  if (header_len > static_cast<uint64_t>(size - 8)) {
    return bad(absl::StrCat("header of ", header_len, " bytes exceeds the file (truncated?)"));
  }
  file->data_ = bytes + 8 + header_len;
  file->data_bytes_ = size - 8 - static_cast<int64_t>(header_len);
  google::protobuf::Struct header;
  const std::string json(reinterpret_cast<const char*>(bytes + 8), header_len);
  if (!google::protobuf::util::JsonStringToMessage(json, &header).ok()) {
    return bad("header is not valid JSON");
  }
  for (const auto& [name, value] : header.fields()) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : value.struct_value().fields()) file->metadata_[k] = v.string_value();
      continue;
    }
    const auto& fields = value.struct_value().fields();
    auto dtype_it = fields.find("dtype");
    auto shape_it = fields.find("shape");
    auto offsets_it = fields.find("data_offsets");
    if (dtype_it == fields.end() || shape_it == fields.end() || offsets_it == fields.end()) {
      return bad(absl::StrCat("tensor '", name, "' lacks dtype, shape or data_offsets"));
    }
    TensorInfo info;
    auto dtype = SafetensorsDtype(dtype_it->second.string_value());
    if (!dtype.ok()) return bad(absl::StrCat("tensor '", name, "': ", dtype.status().message()));
    info.dtype = *dtype;
    int64_t numel = 1;
    for (const auto& d : shape_it->second.list_value().values()) {
      if (d.number_value() < 0) return bad(absl::StrCat("tensor '", name, "' has a negative dimension"));
      info.shape.push_back(static_cast<int64_t>(d.number_value()));
      numel *= info.shape.back();
    }
    const auto& offsets = offsets_it->second.list_value().values();
    if (offsets.size() != 2) return bad(absl::StrCat("tensor '", name, "' needs two data_offsets"));
    info.begin = static_cast<int64_t>(offsets[0].number_value());
    info.end = static_cast<int64_t>(offsets[1].number_value());
    if (info.begin < 0 || info.end < info.begin || info.end > file->data_bytes_) {
      return bad(absl::StrCat("tensor '", name, "' bytes [", info.begin, ", ", info.end,
                              ") lie outside the data section of ", file->data_bytes_,
                              " bytes (truncated?)"));
    }
    const int64_t expected = numel * static_cast<int64_t>(c10::elementSize(info.dtype));
    if (info.end - info.begin != expected) {
      return bad(absl::StrCat("tensor '", name, "' holds ", info.end - info.begin,
                              " bytes but its dtype and shape need ", expected));
    }
    file->tensors_.emplace(name, std::move(info));
  }
  return file;
}


int64_t ReleaseMappedPages(const void* ptr, int64_t bytes) {
  if (bytes <= 0) return 0;
  static const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(ptr);
  const uintptr_t end = begin + static_cast<uintptr_t>(bytes);
  absl::MutexLock lock(&mappings_mu);
  auto it = Mappings().upper_bound(begin);
  if (it == Mappings().begin()) return 0;
  --it;
  if (end > it->second) return 0;  // Not inside one mapping.
  const uintptr_t first = (begin + page - 1) / page * page;  // Whole pages only.
  const uintptr_t last = end / page * page;
  if (last <= first) return 0;
  if (::madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED) != 0) return 0;
  return static_cast<int64_t>(last - first);
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) {
    {
      absl::MutexLock lock(&mappings_mu);
      Mappings().erase(reinterpret_cast<uintptr_t>(mapping_));
    }
    ::munmap(mapping_, static_cast<size_t>(mapping_bytes_));
  }
}

absl::StatusOr<at::Tensor> SafetensorsFile::Get(const std::string& name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", name, "' not in '", path_, "'"));
  }
  std::shared_ptr<SafetensorsFile> keep = self_.lock();
  const TensorInfo& info = it->second;
  return at::from_blob(const_cast<uint8_t*>(data_ + info.begin), info.shape,
                       [keep](void*) {}, at::TensorOptions().dtype(info.dtype));
}

}  // namespace stowage
