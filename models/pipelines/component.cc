#include "models/pipelines/component.h"

#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <xxhash.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

#include "base/status_macros.h"
#include "offload/host_spill.h"

namespace stowage {

absl::Status SpillComponentHostCopies(Module& module, const std::string& dir, const std::string& component) {
  absl::StatusOr<SpillStats> spilled = SpillHeapTensors(module, dir, component);
  if (spilled.ok()) return absl::OkStatus();
  return absl::Status(spilled.status().code(), absl::StrCat("pipeline.host_spill_dir: component '", component,
                                                            "': ", spilled.status().message()));
}

absl::StatusOr<std::unique_ptr<Component>> Component::Create(std::string name,
                                                             std::unique_ptr<Module> root,
                                                             at::ScalarType dtype) {
  ASSIGN_OR_RETURN(std::unique_ptr<HostWeights> weights, HostWeights::Capture(*root));
  return std::unique_ptr<Component>(
      new Component(std::move(name), std::move(root), dtype, std::move(weights)));
}

Component::Component(std::string name, std::unique_ptr<Module> root, at::ScalarType dtype,
                     std::unique_ptr<HostWeights> host_weights)
    : name_(std::move(name)),
      root_(std::move(root)),
      dtype_(dtype),
      host_weights_(std::move(host_weights)) {}

namespace {

constexpr int64_t kMaxHeaderBytes = int64_t{100} << 20;  // safetensors' own limit.

std::string Canonical(const std::string& path) {
  char resolved[PATH_MAX];
  return ::realpath(path.c_str(), resolved) != nullptr ? std::string(resolved) : path;
}

std::string Hex128(const XXH128_hash_t& h) {
  return absl::StrCat(absl::Hex(h.high64, absl::kZeroPad16), absl::Hex(h.low64, absl::kZeroPad16));
}

// JSON written the same way whatever its writer's key order and spacing (keys sorted); other bytes as
// they are.
// Deeper than this the bytes are taken as they are (dump() recurses per level; the loader's own
// parser refuses such files anyway).
constexpr int kMaxCanonicalDepth = 64;

int JsonDepth(const std::string& bytes) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : bytes) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

std::string CanonicalJson(const std::string& bytes) {
  if (JsonDepth(bytes) > kMaxCanonicalDepth) return bytes;
  const nlohmann::json parsed = nlohmann::json::parse(bytes, nullptr, /*allow_exceptions=*/false);
  return parsed.is_discarded() ? bytes : parsed.dump();
}

// What identifies a file's current contents cheaply: device, inode, size and modification time.
std::string FileIdentity(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return "missing";
  return absl::StrCat(st.st_dev, ":", st.st_ino, ":", st.st_size, ":", st.st_mtim.tv_sec, ".", st.st_mtim.tv_nsec);
}

std::string FilesIdentity(const std::vector<std::string>& files) {
  std::string out;
  for (const std::string& f : files) absl::StrAppend(&out, FileIdentity(f), "|");
  return out;
}

// A whole file's bytes (at most `limit`), or an error naming it.
absl::StatusOr<std::string> ReadAtMost(const std::string& path, int64_t limit) {
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) {
    return absl::NotFoundError(absl::StrCat(path, ": not a regular file"));
  }
  const auto size = std::filesystem::file_size(path, error);
  std::ifstream in(path, std::ios::binary);
  if (!in || error) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  std::string bytes;
  bytes.resize(static_cast<size_t>(std::min<int64_t>(limit, static_cast<int64_t>(size))));
  in.read(bytes.data(), limit);
  bytes.resize(static_cast<size_t>(in.gcount()));
  return bytes;
}

// A safetensors file's size, and its header (canonical JSON) and where its data starts; the header
// of a file that is not safetensors is empty (the loader reports what is wrong with it).
struct SafetensorsParts {
  int64_t size = 0;
  std::string header;
  int64_t data_offset = 0;
};

absl::StatusOr<SafetensorsParts> ReadSafetensorsParts(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot be read"));
  SafetensorsParts parts;
  in.seekg(0, std::ios::end);
  parts.size = static_cast<int64_t>(in.tellg());
  in.seekg(0);
  unsigned char prefix[8] = {};
  in.read(reinterpret_cast<char*>(prefix), 8);
  uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = (length << 8) | prefix[i];
  if (in.gcount() != 8 || length > static_cast<uint64_t>(std::min<int64_t>(parts.size - 8, kMaxHeaderBytes))) {
    return parts;  // Not a safetensors file: its bytes alone identify it.
  }
  std::string header(static_cast<size_t>(length), '\0');
  in.read(header.data(), static_cast<std::streamsize>(length));
  parts.header = CanonicalJson(header);
  parts.data_offset = 8 + static_cast<int64_t>(length);
  return parts;
}

}  // namespace

absl::StatusOr<ComponentSource> DescribeComponentSource(const std::string& role, const std::string& folder,
                                                        at::ScalarType dtype, bool random_weights, uint64_t seed,
                                                        const std::string& compute) {
  ComponentSource source;
  source.folder = Canonical(folder);
  const std::string config_path = absl::StrCat(folder, "/config.json");
  ASSIGN_OR_RETURN(const std::string bytes, ReadAtMost(config_path, kMaxHeaderBytes));
  const std::string config = CanonicalJson(bytes);
  source.key = absl::StrCat(role, "|", DtypeName(dtype), "|", compute, "|config:",
                            Hex128(XXH3_128bits(config.data(), config.size())));
  if (random_weights) {
    absl::StrAppend(&source.key, "|random:", seed);
    return source;
  }
  std::error_code error;
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(source.folder, error)) {
    const std::string name = entry.path().filename().string();
    std::error_code regular_error;
    if (absl::EndsWith(name, ".safetensors") && entry.is_regular_file(regular_error)) files.push_back(entry.path().string());
  }
  if (error) return absl::NotFoundError(absl::StrCat(folder, ": cannot be listed: ", error.message()));
  std::sort(files.begin(), files.end());
  for (const std::string& file : files) {
    ASSIGN_OR_RETURN(const SafetensorsParts parts, ReadSafetensorsParts(file));
    absl::StrAppend(&source.key, "|", std::filesystem::path(file).filename().string(), "=", parts.size, ":",
                    Hex128(XXH3_128bits(parts.header.data(), parts.header.size())));
    source.weight_files.push_back(Canonical(file));
  }
  return source;
}

absl::StatusOr<std::string> HashFiles(const std::vector<std::string>& files) {
  XXH3_state_t* state = XXH3_createState();
  if (state == nullptr) return absl::ResourceExhaustedError("hashing weight files: no memory for the hash state");
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> owned(state, &XXH3_freeState);
  XXH3_128bits_reset(state);
  std::vector<char> buffer(size_t{8} << 20);
  for (const std::string& file : files) {
    // The header as canonical JSON (its key order is the writer's), then the tensors' bytes.
    ASSIGN_OR_RETURN(const SafetensorsParts parts, ReadSafetensorsParts(file));
    XXH3_128bits_update(state, parts.header.data(), parts.header.size());
    std::ifstream in(file, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(file, ": cannot be read to compare its content"));
    in.seekg(parts.data_offset);
    while (in) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      XXH3_128bits_update(state, buffer.data(), static_cast<size_t>(in.gcount()));
    }
    if (in.bad()) return absl::DataLossError(absl::StrCat(file, ": read failed while comparing its content"));
  }
  return Hex128(XXH3_128bits_digest(state));
}

std::shared_ptr<Component> ComponentCache::FindMatch(const ComponentSource& source, std::string& source_hash) {
  struct Candidate {
    std::shared_ptr<Component> component;
    std::string folder;
    std::vector<std::string> files;
    std::string hash;
    std::string identity;
  };
  std::vector<Candidate> candidates;
  {
    absl::MutexLock lock(&mu_);
    auto it = entries_.find(source.key);
    if (it == entries_.end()) return nullptr;
    for (const Entry& entry : it->second) {
      std::shared_ptr<Component> live = entry.component.lock();
      if (live == nullptr) continue;
      if (entry.folder == source.folder || source.weight_files.empty()) return live;
      candidates.push_back({std::move(live), entry.folder, entry.weight_files, entry.content_hash, entry.identity});
    }
  }
  // Another folder with the same names, sizes and headers: the bytes decide.
  for (Candidate& c : candidates) {
    // Its folder changed since it was loaded (rewritten in place): its bytes are no longer its own.
    if (FilesIdentity(c.files) != c.identity) continue;
    if (source_hash.empty()) {
      absl::StatusOr<std::string> hash = HashFiles(source.weight_files);
      if (!hash.ok()) return nullptr;  // The load itself reports what is wrong with the files.
      source_hash = *hash;
    }
    if (c.hash.empty()) {
      absl::StatusOr<std::string> hash = HashFiles(c.files);
      if (!hash.ok()) continue;
      c.hash = *hash;
      absl::MutexLock lock(&mu_);
      for (Entry& entry : entries_[source.key]) {
        if (entry.folder == c.folder) entry.content_hash = c.hash;
      }
    }
    if (c.hash == source_hash) {
      absl::MutexLock lock(&mu_);
      ++shared_by_content_;
      return c.component;
    }
  }
  return nullptr;
}

absl::StatusOr<std::shared_ptr<Component>> ComponentCache::GetOrLoad(const ComponentSource& source,
                                                                    const Loader& load) {
  std::string source_hash;
  if (std::shared_ptr<Component> existing = FindMatch(source, source_hash)) return existing;
  const std::string identity = FilesIdentity(source.weight_files);  // Before reading: a change during the load shows.
  ASSIGN_OR_RETURN(std::unique_ptr<Component> loaded, load());
  std::shared_ptr<Component> shared = std::move(loaded);
  absl::MutexLock lock(&mu_);
  std::vector<Entry>& entries = entries_[source.key];
  // Another thread may have loaded it from the same folder meanwhile: keep the first, drop this copy.
  for (const Entry& entry : entries) {
    if (entry.folder != source.folder) continue;
    if (std::shared_ptr<Component> existing = entry.component.lock()) return existing;
  }
  entries.erase(std::remove_if(entries.begin(), entries.end(),
                               [](const Entry& e) { return e.component.expired(); }),
                entries.end());
  entries.push_back(Entry{shared, source.folder, source.weight_files, source_hash, identity});
  return shared;
}

int64_t ComponentCache::shared_by_content() const {
  absl::MutexLock lock(&mu_);
  return shared_by_content_;
}

absl::StatusOr<std::shared_ptr<Component>> LoadMaybeShared(ComponentCache* cache, const ComponentSource& source,
                                                           const ComponentCache::Loader& load) {
  if (cache != nullptr) return cache->GetOrLoad(source, load);
  ASSIGN_OR_RETURN(std::unique_ptr<Component> component, load());
  return std::shared_ptr<Component>(std::move(component));
}

absl::StatusOr<std::shared_ptr<Component>> LoadMaybeShared(ComponentCache* cache, const std::string& role,
                                                           const std::string& folder, at::ScalarType dtype,
                                                           bool random_weights, uint64_t seed,
                                                           const std::string& compute,
                                                           const ComponentCache::Loader& load) {
  if (cache == nullptr) return LoadMaybeShared(nullptr, ComponentSource(), load);
  ASSIGN_OR_RETURN(const ComponentSource source,
                   DescribeComponentSource(role, folder, dtype, random_weights, seed, compute));
  return cache->GetOrLoad(source, load);
}

uint64_t ComponentSeed(const std::map<std::string, uint64_t>& seeds, const std::string& name, uint64_t seed) {
  auto it = seeds.find(name);
  return it == seeds.end() ? seed : it->second;
}

std::string DtypeName(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return "float32";
    case at::kBFloat16:
      return "bfloat16";
    case at::kHalf:
      return "float16";
    default:
      return c10::toString(dtype);
  }
}

}  // namespace stowage
