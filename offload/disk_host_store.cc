#include "offload/disk_host_store.h"

#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

// A fast 64-bit content hash (for file staleness), 8 bytes at a time.
uint64_t HashBytes(const uint8_t* data, int64_t n, uint64_t h) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, data + i, 8);
    h = (h ^ w) * 0x9E3779B97F4A7C15ULL;
    h ^= h >> 29;
  }
  for (; i < n; ++i) h = (h ^ data[i]) * 0x100000001B3ULL;
  return h;
}

}  // namespace

absl::StatusOr<std::unique_ptr<HostStore>> DiskHostStore::Create(const HostStoreOptions& options,
                                                                 const std::vector<PlannedGroup>& planned,
                                                                 HostWeights& weights,
                                                                 DeviceBackend& backend) {
  const std::string& component = options.component;
  if (options.disk_dir.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("component '", component,
                                                   "': offload target disk needs disk_dir"));
  }
  const std::string dir = absl::StrCat(options.disk_dir, "/", component);
  for (const std::string& d : {options.disk_dir, dir}) {
    if (::mkdir(d.c_str(), 0755) != 0 && errno != EEXIST) {
      return absl::PermissionDeniedError(absl::StrCat("component '", component, "': disk_dir '", d,
                                                      "' cannot be created: ", std::strerror(errno)));
    }
  }
  if (::access(dir.c_str(), W_OK) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("component '", component, "': disk_dir '", dir, "' is not writable"));
  }
  std::vector<StoreGroup> groups = ResolveGroups(planned, weights);
  HostStoreStats stats;
  std::vector<std::shared_ptr<SafetensorsFile>> files;
  for (StoreGroup& g : groups) {
    if (g.resident) continue;
    std::string file_name = g.name;
    std::replace(file_name.begin(), file_name.end(), '/', '_');
    const std::string path = absl::StrCat(dir, "/", file_name, ".safetensors");
    // Fingerprint: names, dtypes, shapes and contents of the group's tensors.
    uint64_t h = 1469598103934665603ULL;
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (StoreTensor& t : g.tensors) {
      const at::Tensor& host = t.entry->host;
      const std::string name = t.entry->module->SlotPath(*t.entry->slot);
      h = HashBytes(reinterpret_cast<const uint8_t*>(name.data()), static_cast<int64_t>(name.size()), h);
      std::string meta = SafetensorsDtypeName(host.scalar_type());
      for (int64_t d : host.sizes()) absl::StrAppend(&meta, ",", d);
      h = HashBytes(reinterpret_cast<const uint8_t*>(meta.data()), static_cast<int64_t>(meta.size()), h);
      h = HashBytes(static_cast<const uint8_t*>(host.data_ptr()), static_cast<int64_t>(host.nbytes()), h);
      named.emplace_back(name, host);
    }
    const std::string fingerprint = absl::StrCat(h);
    std::shared_ptr<SafetensorsFile> file;
    auto existing = SafetensorsFile::Open(path);
    const bool reuse = existing.ok() && (*existing)->metadata().count("stowage_fingerprint") > 0 &&
                       (*existing)->metadata().at("stowage_fingerprint") == fingerprint;
    if (reuse) {
      ++stats.disk_files_reused;
      file = *existing;
    } else {
      RETURN_IF_ERROR(WriteSafetensors(path, named, {{"stowage_fingerprint", fingerprint}}));
      ++stats.disk_files_written;
      ASSIGN_OR_RETURN(file, SafetensorsFile::Open(path));
    }
    // The mapping becomes the host copy: the RAM copy is released.
    named.clear();
    for (StoreTensor& t : g.tensors) {
      ASSIGN_OR_RETURN(at::Tensor mapped, file->Get(t.entry->module->SlotPath(*t.entry->slot)));
      weights.ReplaceHost(*t.entry, mapped);
    }
    files.push_back(std::move(file));
  }
  ::malloc_trim(0);
  stats.bytes_per_forward = NonResidentTensorBytes(groups);
  std::unique_ptr<DiskHostStore> store(
      new DiskHostStore(backend, std::move(groups), std::move(stats), std::move(files)));
  RETURN_IF_ERROR(store->StartStaging(options));
  return std::unique_ptr<HostStore>(std::move(store));
}

}  // namespace stowage
