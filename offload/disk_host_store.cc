#include "offload/disk_host_store.h"

#include <malloc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <utility>

#include <xxhash.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

// A group's fingerprint (for file staleness): XXH3-64 over each tensor's name, dtype and shape,
// and bytes, each piece preceded by its length so that no two groups' pieces run together alike.
class Fingerprint {
 public:
  Fingerprint() : state_(XXH3_createState()) { XXH3_64bits_reset(state_); }
  ~Fingerprint() { XXH3_freeState(state_); }
  Fingerprint(const Fingerprint&) = delete;
  Fingerprint& operator=(const Fingerprint&) = delete;
  void Add(const void* data, size_t n) {
    const uint64_t length = n;
    XXH3_64bits_update(state_, &length, sizeof(length));
    XXH3_64bits_update(state_, data, n);
  }
  std::string Hex() const { return absl::StrCat("xxh3:", absl::Hex(XXH3_64bits_digest(state_), absl::kZeroPad16)); }

 private:
  XXH3_state_t* state_;
};

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
    Fingerprint hash;
    std::vector<std::pair<std::string, at::Tensor>> named;
    for (StoreTensor& t : g.tensors) {
      const at::Tensor& host = t.entry->host;
      const std::string name = t.entry->module->SlotPath(*t.entry->slot);
      hash.Add(name.data(), name.size());
      std::string meta = SafetensorsDtypeName(host.scalar_type());
      for (int64_t d : host.sizes()) absl::StrAppend(&meta, ",", d);
      hash.Add(meta.data(), meta.size());
      hash.Add(host.data_ptr(), host.nbytes());
      named.emplace_back(name, host);
    }
    const std::string fingerprint = hash.Hex();
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
