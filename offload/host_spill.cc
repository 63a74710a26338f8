#include "offload/host_spill.h"

#include <malloc.h>
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <map>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "offload/safetensors.h"

namespace stowage {
namespace {

constexpr int64_t kAlign = 64;  // Each tensor's bytes start 64-byte aligned in the file.

std::string SafeLabel(absl::string_view label) {
  std::string out(label.empty() ? "weights" : label);
  for (char& c : out) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' ||
                    c == '_' || c == '.';
    if (!ok) c = '_';
  }
  return out.substr(0, 64);
}

// The memory a slot's tensor views: tensors with the same key are the same values.
using Key = std::tuple<const void*, int64_t, int, std::vector<int64_t>, std::vector<int64_t>>;
Key KeyOf(const at::Tensor& t) {
  return {t.data_ptr(), static_cast<int64_t>(t.nbytes()), static_cast<int>(t.scalar_type()), t.sizes().vec(),
          t.strides().vec()};
}

}  // namespace

bool OnRamFilesystem(const std::string& dir) {
  struct statfs fs;
  if (::statfs(dir.c_str(), &fs) != 0) return false;
  return fs.f_type == TMPFS_MAGIC || fs.f_type == RAMFS_MAGIC;
}

absl::StatusOr<SpillStats> SpillHeapTensors(Module& root, const std::string& dir, absl::string_view label,
                                            int64_t min_bytes) {
  if (dir.empty()) return absl::InvalidArgumentError("spilling host tensors needs a directory (empty)");
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("spill directory '", dir, "' is not a writable directory"));
  }
  if (OnRamFilesystem(dir)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "spill directory '", dir, "' is on a tmpfs or ramfs: its files stay in RAM; choose one on a disk"));
  }

  // What to spill: each distinct CPU tensor outside every mapping, with the slots that view it.
  struct Spilled {
    at::Tensor value;
    std::vector<TensorSlot*> slots;
  };
  std::vector<Spilled> spilled;
  std::map<Key, size_t> index;
  SpillStats stats;
  root.ForEachModule([&](Module& m) {
    std::set<int> deferred;  // A deferred FP8 weight's unwritten codes and scales: nothing to move.
    for (const DeferredFp8& d : m.deferred_fp8()) deferred.insert({d.codes, d.scales});
    for (size_t i = 0; i < m.slots().size(); ++i) {
      if (deferred.count(static_cast<int>(i)) > 0) continue;
      TensorSlot& slot = m.slots()[i];
      const at::Tensor& v = slot.value;
      if (!v.defined() || !v.device().is_cpu() || static_cast<int64_t>(v.nbytes()) < min_bytes) continue;
      if (!MappedFilesContaining({v.data_ptr()}).empty()) continue;  // Already a file's view.
      const Key key = KeyOf(v);
      auto [it, added] = index.emplace(key, spilled.size());
      if (added) spilled.push_back({v, {}});
      spilled[it->second].slots.push_back(&slot);
    }
  });
  if (spilled.empty()) return stats;

  std::vector<std::pair<std::string, at::Tensor>> tensors;
  int64_t offset = 0;
  for (size_t i = 0; i < spilled.size(); ++i) {
    const int64_t pad = (kAlign - offset % kAlign) % kAlign;
    if (pad > 0) {
      tensors.emplace_back(absl::StrCat("pad", i), at::zeros({pad}, at::kByte));
      offset += pad;
    }
    const at::Tensor bytes = spilled[i].value.contiguous().view({-1}).view(at::kByte);
    tensors.emplace_back(absl::StrCat("t", i), bytes);
    offset += static_cast<int64_t>(bytes.nbytes());
    stats.bytes += static_cast<int64_t>(bytes.nbytes());
  }
  // A name of its own (mkostemp), removed as soon as it exists: from then on only the descriptor and
  // the mapping hold the file, so nothing is left behind whatever ends the process, and no other
  // process (another container with the same pid, say) can reach it.
  std::string path = absl::StrCat(dir, "/stowage-spill-", SafeLabel(label), "-XXXXXX");
  const int fd = ::mkostemp(path.data(), O_CLOEXEC);
  if (fd < 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot create a file in spill directory '", dir, "': ", std::strerror(errno)));
  }
  ::unlink(path.c_str());
  const absl::Status written = WriteSafetensorsToDescriptor(fd, path, tensors, {}, kAlign);
  tensors.clear();
  absl::StatusOr<std::shared_ptr<SafetensorsFile>> file =
      written.ok() ? SafetensorsFile::OpenDescriptor(fd, path) : absl::StatusOr<std::shared_ptr<SafetensorsFile>>(written);
  ::close(fd);
  if (!file.ok()) return file.status();

  // Views first, so that nothing changes unless every one is there.
  std::vector<at::Tensor> views;
  views.reserve(spilled.size());
  for (size_t i = 0; i < spilled.size(); ++i) {
    absl::StatusOr<at::Tensor> bytes = (*file)->Get(absl::StrCat("t", i));
    if (!bytes.ok()) return bytes.status();
    const at::Tensor& v = spilled[i].value;
    views.push_back(bytes->view(v.scalar_type()).view(v.sizes()));
  }
  for (size_t i = 0; i < spilled.size(); ++i) {
    for (TensorSlot* slot : spilled[i].slots) {
      slot->value = views[i];
      ++stats.tensors;
    }
  }
  spilled.clear();  // The last references to the heap copies the slots held.
  // Blocks below glibc's mmap threshold go back to the system only when trimmed; a trim walks every
  // arena, so not for a few small tensors.
  if (stats.bytes >= (int64_t{16} << 20)) ::malloc_trim(0);
  return stats;
}

}  // namespace stowage
