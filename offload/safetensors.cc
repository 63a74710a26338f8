#include "offload/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <atomic>
#include <map>
#include <tuple>

#include <ATen/Functions.h>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "base/json_limits.h"
#include "base/status_macros.h"
#include "base/text.h"
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
  return absl::InvalidArgumentError(absl::StrCat("unsupported safetensors dtype '", Truncated(name, 16), "'"));
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

namespace {

// The bytes before the data (length and header, padded so the data starts at a multiple of
// `data_align`), and each tensor contiguous, in order.
struct Serialized {
  std::string head;
  std::vector<at::Tensor> contiguous;
};

absl::StatusOr<Serialized> Serialize(const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                     const std::map<std::string, std::string>& metadata, int64_t data_align) {
  if (data_align < 8 || (data_align & (data_align - 1)) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("safetensors data alignment ", data_align,
                                                   " is not a power of two of at least 8"));
  }
  google::protobuf::Struct header;
  Serialized out;
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
    out.contiguous.push_back(std::move(t));
  }
  if (!metadata.empty()) {
    auto* meta = (*header.mutable_fields())["__metadata__"].mutable_struct_value();
    for (const auto& [k, v] : metadata) (*meta->mutable_fields())[k].set_string_value(v);
  }
  std::string json;
  if (!google::protobuf::util::MessageToJsonString(header, &json).ok()) {
    return absl::InternalError("could not serialise the safetensors header");
  }
  // The data section starts after the 8-byte length and the header: pad the header to align it.
  while ((8 + json.size()) % static_cast<size_t>(data_align) != 0) json.push_back(' ');
  const uint64_t n = json.size();
  out.head.resize(8);
  for (int i = 0; i < 8; ++i) out.head[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  out.head += json;
  return out;
}

}  // namespace

absl::Status WriteSafetensors(const std::string& path,
                              const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  ASSIGN_OR_RETURN(const Serialized serialized, Serialize(tensors, metadata, 8));
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return absl::PermissionDeniedError(absl::StrCat("cannot write '", tmp, "'"));
    out.write(serialized.head.data(), static_cast<std::streamsize>(serialized.head.size()));
    for (const at::Tensor& t : serialized.contiguous) {
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

absl::Status WriteSafetensorsToDescriptor(int fd, const std::string& what,
                                          const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                          const std::map<std::string, std::string>& metadata, int64_t data_align) {
  ASSIGN_OR_RETURN(const Serialized serialized, Serialize(tensors, metadata, data_align));
  auto write_all = [fd](const char* p, size_t n) {
    while (n > 0) {
      const ssize_t wrote = ::write(fd, p, n);
      if (wrote < 0 && errno == EINTR) continue;
      if (wrote <= 0) return false;
      p += wrote;
      n -= static_cast<size_t>(wrote);
    }
    return true;
  };
  // The file's blocks are reserved before anything is written, so a full disk shows here and not as a
  // fault when a mapping of it is read later; the kernel then writes the pages back in its own time,
  // started at once (with an fdatasync here, converting and spilling a Z-Image's FP8 copies took 7.8 s
  // on an H100 host, against 2.1-2.7 s for converting alone). Linux's fallocate, not posix_fallocate:
  // glibc's emulates a filesystem without it by writing a byte into every block first.
  off_t total = static_cast<off_t>(serialized.head.size());
  for (const at::Tensor& t : serialized.contiguous) total += static_cast<off_t>(t.nbytes());
  const off_t at = ::lseek(fd, 0, SEEK_CUR);  // -1 on a pipe or socket: nothing to reserve.
  int reserve_error = ENOTSUP;
  if (at >= 0 && total > 0) {
    int rc;
    do {
      rc = ::fallocate(fd, 0, at, total);
    } while (rc != 0 && errno == EINTR);
    reserve_error = rc == 0 ? 0 : errno;
  }
  const bool reserved = reserve_error == 0;
  // Where blocks cannot be reserved (a device, a filesystem without fallocate) the writes' own errors
  // stand, and the file is synced at the end as before; any other refusal is the disk's answer.
  if (!reserved && reserve_error != EOPNOTSUPP && reserve_error != ENOSYS && reserve_error != EINVAL &&
      reserve_error != ENODEV && reserve_error != ESPIPE && reserve_error != ENOTSUP) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot reserve ", total, " bytes for '", what,
                                                     "': ", std::strerror(reserve_error), " (disk full?)"));
  }
  bool ok = write_all(serialized.head.data(), serialized.head.size());
  for (size_t i = 0; ok && i < serialized.contiguous.size(); ++i) {
    const at::Tensor& t = serialized.contiguous[i];
    ok = write_all(static_cast<const char*>(t.data_ptr()), t.nbytes());
  }
  if (ok && reserved) {
    (void)::sync_file_range(fd, at, total, SYNC_FILE_RANGE_WRITE);  // Start the write-back; no wait.
  } else if (ok && ::fdatasync(fd) != 0 && errno != EINVAL && errno != EROFS) {
    ok = false;  // Unreserved: written back before the caller frees what it wrote (EINVAL: a device).
  }
  if (!ok) {
    return absl::ResourceExhaustedError(
        absl::StrCat("writing '", what, "' failed: ", std::strerror(errno), " (disk full?)"));
  }
  return absl::OkStatus();
}

namespace {

// Live mappings: begin address → end address and the file (whose destructor erases it under the
// lock, before the munmap).
struct LiveMapping {
  uintptr_t end;
  SafetensorsFile* file;
};
ABSL_CONST_INIT absl::Mutex mappings_mu(absl::kConstInit);
std::map<uintptr_t, LiveMapping>& Mappings() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mappings_mu) {
  static auto* mappings = new std::map<uintptr_t, LiveMapping>();
  return *mappings;
}

// The SIGBUS handler's view of the live mappings: a fixed table of atomics, because a signal
// handler may take no lock. Writers (Open, the destructor) hold mappings_mu, so they never race each
// other; the handler only reads a slot's range and sets its damaged flag. A slot is published by
// storing `end` last (release) and retired by clearing `end` first.
struct GuardedRange {
  std::atomic<uintptr_t> begin{0};
  std::atomic<uintptr_t> end{0};  // 0: free.
  std::atomic<uint32_t> damaged{0};
};
static_assert(std::atomic<uintptr_t>::is_always_lock_free, "the SIGBUS handler needs lock-free atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "the SIGBUS handler needs lock-free atomics");
GuardedRange g_guarded[kMaxGuardedMappings];
// One past the highest slot ever used: the handler scans [0, g_guarded_high).
std::atomic<int> g_guarded_high{0};
uintptr_t g_page_size = 4096;
struct sigaction g_previous_sigbus;

// Passes a SIGBUS that is not ours on to the disposition that was there before.
void ChainSigbus(int sig, siginfo_t* info, void* context) {
  const struct sigaction& previous = g_previous_sigbus;
  if ((previous.sa_flags & SA_SIGINFO) != 0 && previous.sa_sigaction != nullptr) {
    previous.sa_sigaction(sig, info, context);
    return;
  }
  if (previous.sa_handler == SIG_IGN && (info == nullptr || info->si_code <= 0)) return;
  if (previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
    previous.sa_handler(sig);
    return;
  }
  // Default action: reset it and let the signal happen again — a fault re-executes the faulting
  // instruction on return; a signal sent by kill() is raised again (pending until we return).
  struct sigaction dfl;
  std::memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  sigemptyset(&dfl.sa_mask);
  ::sigaction(SIGBUS, &dfl, nullptr);
  if (info == nullptr || info->si_code <= 0) ::raise(SIGBUS);
}

// Async-signal-safe: atomics, mmap, sigaction, raise only.
void OnSigbus(int sig, siginfo_t* info, void* context) {
  if (info != nullptr && info->si_code > 0) {  // A fault (BUS_ADRERR), not kill().
    const auto address = reinterpret_cast<uintptr_t>(info->si_addr);
    const int high = g_guarded_high.load(std::memory_order_acquire);
    for (int i = 0; i < high; ++i) {
      GuardedRange& range = g_guarded[i];
      const uintptr_t end = range.end.load(std::memory_order_acquire);
      if (end == 0 || address >= end) continue;
      const uintptr_t begin = range.begin.load(std::memory_order_relaxed);
      if (address < begin) continue;
      // The file shrank under the mapping. Zero pages from the faulting page to the end of the
      // mapping: one fault per file, not one per page, and the pages past the new end are all gone.
      const uintptr_t first = address & ~(g_page_size - 1);
      const uintptr_t last = (end + g_page_size - 1) & ~(g_page_size - 1);
      range.damaged.store(1, std::memory_order_release);
      void* patched = ::mmap(reinterpret_cast<void*>(first), last - first, PROT_READ,
                             MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (patched != MAP_FAILED) return;  // The faulting instruction runs again, reading zeros.
      break;
    }
  }
  ChainSigbus(sig, info, context);
}

void InstallSigbusHandlerOnce() {
  static const bool installed = [] {
    g_page_size = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
    struct sigaction action;
    std::memset(&action, 0, sizeof(action));
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESTART;
    sigemptyset(&action.sa_mask);
    if (::sigaction(SIGBUS, &action, &g_previous_sigbus) != 0) {
      std::fprintf(stderr, "stowage: cannot install the SIGBUS handler: a model file truncated "
                           "under the server will crash it\n");
      return false;
    }
    return true;
  }();
  (void)installed;
}

// Returns the slot, or -1 when the table is full.
int GuardRange(uintptr_t begin, uintptr_t end) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mappings_mu) {
  const int high = g_guarded_high.load(std::memory_order_relaxed);
  int slot = -1;
  for (int i = 0; i < high && slot < 0; ++i) {
    if (g_guarded[i].end.load(std::memory_order_relaxed) == 0) slot = i;
  }
  if (slot < 0) {
    if (high == kMaxGuardedMappings) {
      static bool warned = false;
      if (!warned) {
        warned = true;
        std::fprintf(stderr, "stowage: more than %d safetensors mappings; the rest are not guarded "
                             "against files truncated under them\n", kMaxGuardedMappings);
      }
      return -1;
    }
    slot = high;
  }
  GuardedRange& range = g_guarded[slot];
  range.damaged.store(0, std::memory_order_relaxed);
  range.begin.store(begin, std::memory_order_relaxed);
  range.end.store(end, std::memory_order_release);
  if (slot == high) g_guarded_high.store(high + 1, std::memory_order_release);
  return slot;
}

void UnguardRange(int slot) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mappings_mu) {
  if (slot < 0) return;
  g_guarded[slot].end.store(0, std::memory_order_release);
  g_guarded[slot].begin.store(0, std::memory_order_relaxed);
}

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

namespace {

// Largest integer a JSON number (an IEEE double) holds exactly.
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53

// A JSON number that is an integer in [0, 2^53] (rejects strings, fractions, negatives, NaN, inf).
bool AsIndex(const google::protobuf::Value& value, int64_t* out) {
  if (!value.has_number_value()) return false;
  const double d = value.number_value();
  if (!(d >= 0.0 && d <= kMaxExactInteger) || d != std::floor(d)) return false;
  *out = static_cast<int64_t>(d);
  return true;
}

}  // namespace

absl::StatusOr<SafetensorsHeader> ParseSafetensorsHeader(absl::string_view json, int64_t data_bytes,
                                                         absl::string_view what) {
  auto bad = [&](absl::string_view why) { return absl::InvalidArgumentError(absl::StrCat(what, ": ", why)); };
  // Linear pre-scan first: protobuf's parser is quadratic in the nesting depth.
  RETURN_IF_ERROR(CheckJsonLimits(json, kSafetensorsHeaderLimits, absl::StrCat(what, ": header")));
  google::protobuf::Struct header;
  // Protobuf's error text quotes the input: say only that it failed.
  if (!google::protobuf::util::JsonStringToMessage(std::string(json), &header).ok()) {
    return bad("header is not a valid JSON object");
  }
  if (static_cast<int64_t>(header.fields_size()) > kMaxSafetensorsTensors + 1) {
    return bad(absl::StrCat("header lists ", header.fields_size(), " entries; at most ", kMaxSafetensorsTensors,
                            " tensors are accepted"));
  }
  SafetensorsHeader out;
  std::vector<std::tuple<int64_t, int64_t, const std::string*>> spans;
  for (const auto& [name, value] : header.fields()) {
    const std::string shown = absl::StrCat("tensor '", Truncated(name), "'");
    if (name == "__metadata__") {
      if (!value.has_struct_value()) return bad("__metadata__ is not an object");
      for (const auto& [k, v] : value.struct_value().fields()) {
        if (!v.has_string_value()) {
          return bad(absl::StrCat("__metadata__ entry '", Truncated(k), "' is not a string"));
        }
        out.metadata[k] = v.string_value();
      }
      continue;
    }
    if (!value.has_struct_value()) return bad(absl::StrCat(shown, " is not an object"));
    const auto& fields = value.struct_value().fields();
    auto dtype_it = fields.find("dtype");
    auto shape_it = fields.find("shape");
    auto offsets_it = fields.find("data_offsets");
    if (dtype_it == fields.end() || shape_it == fields.end() || offsets_it == fields.end()) {
      return bad(absl::StrCat(shown, " lacks dtype, shape or data_offsets"));
    }
    SafetensorsTensorInfo info;
    if (!dtype_it->second.has_string_value()) return bad(absl::StrCat(shown, ": dtype is not a string"));
    const std::string& dtype_name = dtype_it->second.string_value();
    info.float8_e4m3 = dtype_name == "F8_E4M3";
    auto dtype = info.float8_e4m3 ? absl::StatusOr<at::ScalarType>(at::kByte) : SafetensorsDtype(dtype_name);
    if (!dtype.ok()) return bad(absl::StrCat(shown, ": ", dtype.status().message()));
    info.dtype = *dtype;
    if (!shape_it->second.has_list_value()) return bad(absl::StrCat(shown, ": shape is not a list"));
    const auto& dims = shape_it->second.list_value().values();
    if (dims.size() > kMaxSafetensorsRank) {
      return bad(absl::StrCat(shown, " has rank ", dims.size(), "; at most ", kMaxSafetensorsRank, " is accepted"));
    }
    int64_t bytes = static_cast<int64_t>(c10::elementSize(info.dtype));
    bool overflow = false;
    for (int i = 0; i < dims.size(); ++i) {  // dims.size() <= kMaxSafetensorsRank.
      int64_t d = 0;
      if (!AsIndex(dims[i], &d)) {
        return bad(absl::StrCat(shown, ": shape[", i, "] is not an integer in [0, 2^53]"));
      }
      info.shape.push_back(d);
      overflow = overflow || __builtin_mul_overflow(bytes, d, &bytes);
    }
    // A zero dimension makes any other dimension harmless; only then may the product overflow.
    if (overflow && std::find(info.shape.begin(), info.shape.end(), 0) == info.shape.end()) {
      return bad(absl::StrCat(shown, ": its shape's byte size overflows 64 bits"));
    }
    if (overflow) bytes = 0;
    if (!offsets_it->second.has_list_value() || offsets_it->second.list_value().values_size() != 2) {
      return bad(absl::StrCat(shown, " needs two data_offsets"));
    }
    const auto& offsets = offsets_it->second.list_value().values();
    if (!AsIndex(offsets[0], &info.begin) || !AsIndex(offsets[1], &info.end)) {
      return bad(absl::StrCat(shown, ": data_offsets are not integers in [0, 2^53]"));
    }
    if (info.end < info.begin || info.end > data_bytes) {
      return bad(absl::StrCat(shown, " bytes [", info.begin, ", ", info.end, ") lie outside the data section of ",
                              data_bytes, " bytes (truncated?)"));
    }
    if (info.end - info.begin != bytes) {
      return bad(absl::StrCat(shown, " holds ", info.end - info.begin, " bytes but its dtype ",
                              SafetensorsDtypeName(info.dtype), " and shape need ", bytes));
    }
    if (info.end > info.begin) spans.emplace_back(info.begin, info.end, &name);
    out.tensors.emplace(name, std::move(info));
  }
  // Overlapping byte spans would alias two tensors: refused (empty tensors overlap nothing).
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (std::get<0>(spans[i]) < std::get<1>(spans[i - 1])) {
      return bad(absl::StrCat("tensor '", Truncated(*std::get<2>(spans[i])), "' bytes [", std::get<0>(spans[i]), ", ",
                              std::get<1>(spans[i]), ") overlap tensor '", Truncated(*std::get<2>(spans[i - 1])), "'"));
    }
  }
  return out;
}

absl::StatusOr<SafetensorsHeader> ParseSafetensorsBytes(absl::string_view bytes, absl::string_view what) {
  auto bad = [&](absl::string_view why) { return absl::InvalidArgumentError(absl::StrCat(what, ": ", why)); };
  if (bytes.size() < 8) return bad("shorter than its 8-byte header length (truncated?)");
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  if (header_len > static_cast<uint64_t>(kSafetensorsHeaderLimits.max_bytes)) {
    return bad(absl::StrCat("header of ", header_len, " bytes exceeds the limit of ",
                            kSafetensorsHeaderLimits.max_bytes, " bytes"));
  }
  if (header_len > bytes.size() - 8) {
    return bad(absl::StrCat("header of ", header_len, " bytes exceeds the file (truncated?)"));
  }
  return ParseSafetensorsHeader(bytes.substr(8, header_len), static_cast<int64_t>(bytes.size() - 8 - header_len),
                                what);
}

absl::StatusOr<std::shared_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot open '", path, "'"));
  absl::StatusOr<std::shared_ptr<SafetensorsFile>> file = OpenDescriptor(fd, path);
  ::close(fd);
  return file;
}

absl::StatusOr<std::shared_ptr<SafetensorsFile>> SafetensorsFile::OpenDescriptor(int fd, const std::string& path) {
  struct stat st;
  if (::fstat(fd, &st) != 0) return absl::InternalError(absl::StrCat("cannot stat '", path, "'"));
  const int64_t size = st.st_size;
  const std::string what = absl::StrCat("safetensors file '", path, "'");
  if (size < 8) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": shorter than its 8-byte header length (truncated?)"));
  }
  InstallSigbusHandlerOnce();
  void* mapping = ::mmap(nullptr, static_cast<size_t>(size), PROT_READ, MAP_SHARED, fd, 0);
  if (mapping == MAP_FAILED) return absl::InternalError(absl::StrCat("cannot mmap '", path, "'"));
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->self_ = file;
  file->path_ = path;
  file->dev_ = static_cast<uint64_t>(st.st_dev);
  file->ino_ = static_cast<uint64_t>(st.st_ino);
  file->mtime_ns_ = MtimeNs(st);
  file->mapping_ = mapping;
  file->mapping_bytes_ = size;
  {
    // Guarded before the first read: even the header may lie past a concurrent truncation.
    absl::MutexLock lock(&mappings_mu);
    const auto begin = reinterpret_cast<uintptr_t>(mapping);
    Mappings()[begin] = LiveMapping{begin + static_cast<uintptr_t>(size), file.get()};
    file->guard_slot_ = GuardRange(begin, begin + static_cast<uintptr_t>(size));
  }
  const auto* bytes = static_cast<const uint8_t*>(mapping);
  ASSIGN_OR_RETURN(SafetensorsHeader header,
                   ParseSafetensorsBytes(absl::string_view(reinterpret_cast<const char*>(bytes), size), what));
  uint64_t header_len = 0;
  for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(bytes[i]) << (8 * i);
  file->data_ = bytes + 8 + header_len;
  file->data_bytes_ = size - 8 - static_cast<int64_t>(header_len);
  file->tensors_ = std::move(header.tensors);
  file->metadata_ = std::move(header.metadata);
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
  if (end > it->second.end) return 0;  // Not inside one mapping.
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
      UnguardRange(guard_slot_);
    }
    ::munmap(mapping_, static_cast<size_t>(mapping_bytes_));
  }
}

bool SafetensorsFile::damaged() const {
  return guard_slot_ >= 0 && g_guarded[guard_slot_].damaged.load(std::memory_order_acquire) != 0;
}

absl::Status SafetensorsFile::CheckUnchanged() const {
  const bool was_damaged = damaged();
  struct stat st;
  const bool same_inode = ::stat(path_.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == dev_ &&
                          static_cast<uint64_t>(st.st_ino) == ino_;
  // Another file at the path (renamed over) or none (removed): the mapping still holds the old
  // inode, unchanged.
  if (!was_damaged && !same_inode) return absl::OkStatus();
  if (!was_damaged && st.st_size == mapping_bytes_ && MtimeNs(st) == mtime_ns_) return absl::OkStatus();
  std::string now = "truncated";
  if (same_inode) {
    now = absl::StrCat(static_cast<int64_t>(st.st_size));
    if (st.st_size == mapping_bytes_) absl::StrAppend(&now, ", rewritten");
  }
  return absl::FailedPreconditionError(absl::StrCat(
      "model file '", path_, "' changed on disk after it was loaded (size ", mapping_bytes_, " → ", now,
      "); unload and load the pipeline again"));
}

std::vector<std::shared_ptr<const SafetensorsFile>> MappedFilesContaining(
    const std::vector<const void*>& addresses) {
  std::vector<std::shared_ptr<const SafetensorsFile>> files;
  absl::MutexLock lock(&mappings_mu);
  const SafetensorsFile* last = nullptr;  // Consecutive tensors mostly share a file.
  for (const void* address : addresses) {
    const auto a = reinterpret_cast<uintptr_t>(address);
    auto it = Mappings().upper_bound(a);
    if (it == Mappings().begin()) continue;
    --it;
    if (a >= it->second.end || it->second.file == last) continue;
    last = it->second.file;
    bool seen = false;
    for (const auto& file : files) seen = seen || file.get() == last;
    if (seen) continue;
    // Null while the file is being destroyed (its destructor is waiting for the lock): skipped.
    // Never the last reference here: the destructor cannot run under the lock.
    std::shared_ptr<const SafetensorsFile> file = last->self_.lock();
    if (file != nullptr) files.push_back(std::move(file));
  }
  return files;
}

absl::StatusOr<at::Tensor> SafetensorsFile::Get(const std::string& name) {
  auto it = tensors_.find(name);
  if (it == tensors_.end()) {
    return absl::NotFoundError(absl::StrCat("tensor '", Truncated(name), "' not in '", path_, "'"));
  }
  std::shared_ptr<SafetensorsFile> keep = self_.lock();
  const TensorInfo& info = it->second;
  return at::from_blob(const_cast<uint8_t*>(data_ + info.begin), info.shape,
                       [keep](void*) {}, at::TensorOptions().dtype(info.dtype));
}

}  // namespace stowage
