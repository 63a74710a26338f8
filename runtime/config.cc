#include "runtime/config.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <utility>
#include <vector>

#include "offload/host_spill.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "base/status_macros.h"
#include "models/pipeline_registry.h"
#include "offload/device_backend.h"
#include "base/text.h"

namespace stowage {

v1::DeviceConfig::Kind ResolvedKind(const v1::DeviceConfig& device) {
  if (device.kind() != v1::DeviceConfig::KIND_UNSPECIFIED) return device.kind();
  return CudaAvailable() ? v1::DeviceConfig::KIND_CUDA : v1::DeviceConfig::KIND_SIMULATED;
}

std::string DeviceNameOf(const v1::DeviceConfig& device) {
  return absl::StrCat(ResolvedKind(device) == v1::DeviceConfig::KIND_CUDA ? "cuda:" : "sim:", device.index());
}

bool IsValidTenant(const std::string& tenant) {
  if (tenant.size() > kMaxTenantLength) return false;
  for (char c : tenant) {
    if (!absl::ascii_isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') return false;
  }
  return true;
}

SchedulerOptions ToSchedulerOptions(const v1::SchedulerConfig& config) {
  SchedulerOptions options;
  options.max_reorder_delay = absl::Milliseconds(config.max_reorder_delay_ms());
  options.priority_mode = config.priority_mode() == v1::SchedulerConfig::PRIORITY_WEIGHTED ? PriorityMode::kWeighted
                                                                                          : PriorityMode::kStrict;
  for (const auto& [tenant, weight] : config.tenant_weights()) options.tenant_weights[tenant] = weight;
  options.tenant_burst = config.has_tenant_burst_work() ? config.tenant_burst_work() : kDefaultTenantBurstWork;
  switch (config.preemption()) {
    case v1::SchedulerConfig::PREEMPTION_PRIORITY:
      options.preemption = Preemption::kPriority;
      break;
    case v1::SchedulerConfig::PREEMPTION_RESIDENT:
      options.preemption = Preemption::kResident;
      break;
    default:
      options.preemption = Preemption::kNone;
      break;
  }
  return options;
}
namespace {

class CollectErrors : public google::protobuf::io::ErrorCollector {
 public:
  void AddError(int line, google::protobuf::io::ColumnNumber column,
                const std::string& message) override {
    errors.push_back(absl::StrCat("line ", line + 1, " column ", column + 1, ": ", message));
  }
  std::vector<std::string> errors;
};

bool ValidName(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char c : name) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return false;
  }
  return true;
}

// Paths from the config are echoed up to this many bytes.
constexpr size_t kEchoedPathBytes = 256;

std::string Quoted(const std::string& text, size_t max_bytes = 64) {
  return absl::StrCat("'", Truncated(text, max_bytes), "'");
}

// `field`: `value` unless it lies in [lo, hi]; `allowed` describes the range for the message.
absl::Status CheckRange(const std::string& field, int64_t value, int64_t lo, int64_t hi,
                        const std::string& allowed) {
  if (value >= lo && value <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", value, " is out of range; allowed: ", allowed));
}

absl::Status CheckNonNegative(const std::string& field, int64_t value, const std::string& zero) {
  return CheckRange(field, value, 0, INT64_MAX, absl::StrCat(">= 0 (0: ", zero, ")"));
}

// OK when `path` is a regular file this process can read; else why not, after `prefix`
// ("tls.cert_file: "): "cannot read '<path>': it is a directory".
absl::Status CheckReadableFile(const std::string& path, const std::string& prefix) {
  const std::string head = absl::StrCat(prefix, "cannot read ", Quoted(path, kEchoedPathBytes), ": ");
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    const int error = errno;
    if (error == ENOENT || error == ENOTDIR) return absl::NotFoundError(absl::StrCat(head, "no such file"));
    return absl::PermissionDeniedError(absl::StrCat(head, std::strerror(error)));
  }
  if (S_ISDIR(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(head, "it is a directory"));
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(head, "not a regular file"));
  if (::access(path.c_str(), R_OK) != 0) return absl::PermissionDeniedError(absl::StrCat(head, "permission denied"));
  return absl::OkStatus();
}

// A TLS file must hold a PEM block of the right kind: gRPC would otherwise fail later, at listen,
// with a message about the port.
absl::Status CheckPemFile(const std::string& path, const std::string& field, const std::vector<std::string>& kinds) {
  RETURN_IF_ERROR(CheckReadableFile(path, absl::StrCat(field, ": ")));
  std::ifstream file(path);
  std::string head(64 * 1024, '\0');
  file.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(file.gcount()));
  for (const std::string& kind : kinds) {
    if (head.find(absl::StrCat("-----BEGIN ", kind, "-----")) != std::string::npos) return absl::OkStatus();
  }
  return absl::InvalidArgumentError(absl::StrCat(field, ": ", Quoted(path, kEchoedPathBytes),
                                                 " is not a PEM file with a '-----BEGIN ", kinds.front(),
                                                 "-----' block"));
}

absl::Status CheckModelDir(const std::string& dir, const std::string& field) {
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0) {
    const int error = errno;
    if (error == ENOENT || error == ENOTDIR) {
      return absl::NotFoundError(absl::StrCat(field, ": ", Quoted(dir, kEchoedPathBytes), " does not exist"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": cannot read ", Quoted(dir, kEchoedPathBytes), ": ", std::strerror(error)));
  }
  if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": ", Quoted(dir, kEchoedPathBytes), " is not a directory"));
  }
  if (::access(dir.c_str(), R_OK | X_OK) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat(field, ": cannot read ", Quoted(dir, kEchoedPathBytes), ": permission denied"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path) {
  RETURN_IF_ERROR(CheckReadableFile(path, ""));
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read ", Quoted(path, kEchoedPathBytes)));
  std::stringstream text;
  text << file.rdbuf();
  v1::ServerConfig config;
  if (absl::EndsWith(path, ".json")) {
    google::protobuf::util::JsonParseOptions options;
    options.ignore_unknown_fields = false;
    const auto status = google::protobuf::util::JsonStringToMessage(text.str(), &config, options);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("config '", path, "' is not a valid ServerConfig JSON: ", status.ToString()));
    }
    return config;
  }
  google::protobuf::TextFormat::Parser parser;
  CollectErrors errors;
  parser.RecordErrorsTo(&errors);
  if (!parser.ParseFromString(text.str(), &config)) {
    return absl::InvalidArgumentError(absl::StrCat("config '", path, "' is not a valid ServerConfig: ",
                                                   absl::StrJoin(errors.errors, "; ")));
  }
  return config;
}

namespace {

// What `config` asks of LibTorch's allocator: each asking field and its PYTORCH_CUDA_ALLOC_CONF part.
std::vector<std::pair<std::string, std::string>> AllocatorAsks(const v1::ServerConfig& config) {
  std::vector<std::pair<std::string, std::string>> asks;
  if (config.cuda_expandable_segments()) asks.emplace_back("cuda_expandable_segments", "expandable_segments:True");
  if (config.cuda_max_split_size_mb() != 0) {
    asks.emplace_back("cuda_max_split_size_mb", absl::StrCat("max_split_size_mb:", config.cuda_max_split_size_mb()));
  }
  return asks;
}

}  // namespace

std::string CudaAllocatorConf(const v1::ServerConfig& config) {
  return absl::StrJoin(AllocatorAsks(config), ",",
                       [](std::string* out, const auto& ask) { out->append(ask.second); });
}

CudaAllocatorSettings ApplyCudaAllocatorSettings(const v1::ServerConfig& config) {
  CudaAllocatorSettings applied;
  const std::string setting = CudaAllocatorConf(config);
  if (setting.empty()) return applied;
  // The config fields that asked, for the note.
  const std::string asked = absl::StrJoin(AllocatorAsks(config), ", ",
                                          [](std::string* out, const auto& ask) { out->append(ask.first); });
  const char* cuda = std::getenv("PYTORCH_CUDA_ALLOC_CONF");
  const char* any = std::getenv("PYTORCH_ALLOC_CONF");  // LibTorch 2.9+ reads it first.
  const bool cuda_set = cuda != nullptr && cuda[0] != '\0';
  const bool any_set = any != nullptr && any[0] != '\0';
  if (cuda_set && std::string(cuda) == setting && !any_set) {
    applied.note = absl::StrCat(asked, ": PYTORCH_CUDA_ALLOC_CONF=", setting);
    return applied;
  }
  if (cuda_set || any_set) {
    const char* name = any_set ? "PYTORCH_ALLOC_CONF" : "PYTORCH_CUDA_ALLOC_CONF";
    applied.note = absl::StrCat(asked, ": the environment's ", name, "=", Truncated(any_set ? any : cuda),
                                " is used as it is");
    return applied;
  }
  // An empty PYTORCH_ALLOC_CONF would still be the one LibTorch reads.
  if (any != nullptr) ::unsetenv("PYTORCH_ALLOC_CONF");
  ::setenv("PYTORCH_CUDA_ALLOC_CONF", setting.c_str(), /*overwrite=*/1);
  applied.note = absl::StrCat(asked, ": PYTORCH_CUDA_ALLOC_CONF=", setting);
  applied.changed_environment = true;
  return applied;
}

void AddDefaultPipelines(v1::ServerConfig& config, const std::string& demo_dir) {
  if (!config.pipelines().empty()) return;
  if (!demo_dir.empty()) {
    v1::PipelineConfig* demo = config.add_pipelines();
    demo->set_name(kDemoPipelineName);
    demo->set_model_dir(demo_dir);
    demo->set_default_size(kDemoImageSize);
    demo->set_default_(true);
  }
  // Z-Image's architecture at a tiny size, random weights: what the engine's tests run.
  v1::PipelineConfig* builtin = config.add_pipelines();
  builtin->set_name(kDefaultPipelineName);
  builtin->set_builtin(kDefaultPipelineName);
}

absl::Status FinalizePipelineConfig(v1::PipelineConfig& p, const std::string& field,
                                    const PipelineRegistry* registry_or_null) {
  const PipelineRegistry& registry = registry_or_null != nullptr ? *registry_or_null : DefaultPipelineRegistry();
  if (!ValidName(p.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".name: ", Quoted(p.name()), " must match [a-z0-9_-]{1,64}"));
  }
  if (p.source_case() == v1::PipelineConfig::SOURCE_NOT_SET) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": no source; set builtin (one of: ",
                     absl::StrJoin(registry.BuiltinNames(), ", "), ") or model_dir"));
  }
  if (p.source_case() == v1::PipelineConfig::kModelDir) {
    if (p.model_dir().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".model_dir: empty path"));
    }
    RETURN_IF_ERROR(CheckModelDir(p.model_dir(), absl::StrCat(field, ".model_dir")));
  } else if (!registry.HasBuiltin(p.builtin())) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".builtin: unknown built-in ", Quoted(p.builtin()),
                                                   "; available: ",
                                                   absl::StrJoin(registry.BuiltinNames(), ", ")));
  }
  if (p.dtype().empty()) p.set_dtype("float32");
  if (p.dtype() != "float32" && p.dtype() != "bfloat16") {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: ", Quoted(p.dtype()),
                                                   " is not supported; use float32 or bfloat16"));
  }
  if (p.default_size() != 0) {
    RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".default_size"), p.default_size(), kMinDefaultSize,
                               kMaxDefaultSize, absl::StrCat("0 (the architecture's) or ", kMinDefaultSize,
                                                             "..", kMaxDefaultSize)));
  }
  if (p.group_offload().enabled()) {
    auto options = ToPipelineGroupOffloadOptions(p.group_offload(), absl::StrCat(field, ".group_offload"));
    if (!options.ok()) return options.status();
  }
  std::set<std::string> named_devices;
  for (int j = 0; j < p.devices_size(); ++j) {
    const std::string entry = absl::StrCat(field, ".devices[", j, "]");
    if (p.devices(j).empty()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": empty device name (a device of this server such as "
                                                     "\"cuda:0\" or \"sim:0\")"));
    }
    if (!named_devices.insert(p.devices(j)).second) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": ", Quoted(p.devices(j)), " is listed twice"));
    }
  }
  // Split layout: the shape of each entry here; which devices and components exist is checked
  // where they are known (DeviceSet, and the load once the pipeline is built).
  if (p.component_devices_size() > 0 && p.devices_size() > 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, ".component_devices: a split pipeline has one home device, but ", field, ".devices names ",
        p.devices_size(), " (replicas); name at most one device, or load one split pipeline per home device"));
  }
  std::set<std::string> split;
  for (int j = 0; j < p.component_devices_size(); ++j) {
    const v1::ComponentDevice& c = p.component_devices(j);
    const std::string entry = absl::StrCat(field, ".component_devices[", j, "]");
    if (c.component().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ".component: required (a component name such as \"text_encoder\")"));
    }
    if (c.device().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ".device: required (a device of this server such as \"sim:1\")"));
    }
    if (!split.insert(c.component()).second) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ".component: ", Quoted(c.component()),
                                                     " is listed twice; each component at most once"));
    }
  }
  for (const auto& [component, mode] : p.compute()) {
    const std::string entry = absl::StrCat(field, ".compute[", Quoted(component), "]");
    if (!ValidName(component)) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": a component name must match [a-z0-9_-]{1,64}"));
    }
    if (mode != v1::COMPUTE_DEFAULT && mode != v1::COMPUTE_FP8) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": unknown compute mode ", static_cast<int>(mode),
                                                     "; use COMPUTE_DEFAULT or COMPUTE_FP8"));
    }
    if (mode == v1::COMPUTE_FP8 && p.dtype() != "bfloat16") {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": FP8 compute needs dtype \"bfloat16\" (activations "
                                                     "and everything that is not an FP8 GEMM); this pipeline's dtype is ",
                                                     Quoted(p.dtype())));
    }
  }
  if (!p.host_spill_dir().empty()) {
    const std::string entry = absl::StrCat(field, ".host_spill_dir");
    RETURN_IF_ERROR(CheckModelDir(p.host_spill_dir(), entry));
    if (::access(p.host_spill_dir().c_str(), W_OK | X_OK) != 0) {
      return absl::PermissionDeniedError(
          absl::StrCat(entry, ": cannot write in ", Quoted(p.host_spill_dir(), kEchoedPathBytes)));
    }
    if (OnRamFilesystem(p.host_spill_dir())) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": ", Quoted(p.host_spill_dir(), kEchoedPathBytes),
                                                     " is on a tmpfs or ramfs, which keeps its files in RAM; "
                                                     "choose a directory on a disk"));
    }
  }
  for (const auto& [component, seed] : p.component_weight_seeds()) {
    const std::string entry = absl::StrCat(field, ".component_weight_seeds[", Quoted(component), "]");
    if (!ValidName(component)) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": a component name must match [a-z0-9_-]{1,64}"));
    }
    if (p.source_case() == v1::PipelineConfig::kModelDir && !p.random_weights()) {
      return absl::InvalidArgumentError(absl::StrCat(entry, ": seeds draw random weights; this pipeline reads its "
                                                     "weights from model_dir (set random_weights, or drop the seed)"));
    }
  }
  return FinalizeBatchingConfig(*p.mutable_batching(), absl::StrCat(field, ".batching"));
}

absl::Status FinalizeBatchingConfig(v1::BatchingConfig& b, const std::string& field) {
  RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".max_batch_size"), b.max_batch_size(), 0, kMaxBatchSize,
                             absl::StrCat("0 or 1 (off) or 2..", kMaxBatchSize)));
  RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".max_queue_delay_ms"), b.max_queue_delay_ms(), 0,
                             kMaxBatchQueueDelayMs, absl::StrCat("0..", kMaxBatchQueueDelayMs)));
  if (b.max_batch_size() == 0) b.set_max_batch_size(1);
  return absl::OkStatus();
}

absl::Status CheckSchedulerConfig(const v1::SchedulerConfig& scheduler, int queue_depth) {
  if (!v1::SchedulerConfig::PriorityMode_IsValid(scheduler.priority_mode())) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler.priority_mode: unknown value ",
                                                   static_cast<int>(scheduler.priority_mode()),
                                                   "; use PRIORITY_STRICT or PRIORITY_WEIGHTED"));
  }
  if (!v1::SchedulerConfig::Preemption_IsValid(scheduler.preemption())) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler.preemption: unknown value ",
                                                   static_cast<int>(scheduler.preemption()),
                                                   "; use PREEMPTION_NONE, PREEMPTION_PRIORITY or PREEMPTION_RESIDENT"));
  }
  if (scheduler.preemption() == v1::SchedulerConfig::PREEMPTION_RESIDENT && scheduler.max_reorder_delay_ms() <= 0) {
    return absl::InvalidArgumentError(
        "scheduler.preemption: PREEMPTION_RESIDENT bounds how long a running request may be paused by "
        "max_reorder_delay_ms, which is 0; set scheduler.max_reorder_delay_ms (1..60000) or use PREEMPTION_PRIORITY");
  }
  RETURN_IF_ERROR(CheckRange("scheduler.max_reorder_delay_ms", scheduler.max_reorder_delay_ms(), 0, kMaxReorderDelayMs,
                             absl::StrCat("0 (first come, first served) ..", kMaxReorderDelayMs)));
  RETURN_IF_ERROR(CheckRange("scheduler.tenant_queue_limit", scheduler.tenant_queue_limit(), 0, queue_depth,
                             absl::StrCat("0 (off) ..queue_depth (", queue_depth, ")")));
  if (scheduler.has_tenant_burst_work() &&
      !(scheduler.tenant_burst_work() >= 0 && scheduler.tenant_burst_work() <= kMaxTenantBurstWork)) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler.tenant_burst_work: ", scheduler.tenant_burst_work(),
                                                   " is out of range; allowed: 0 (no credit) ..", kMaxTenantBurstWork,
                                                   " (unset: ", kDefaultTenantBurstWork, ")"));
  }
  if (scheduler.tenant_weights_size() > kMaxTenantWeights) {
    return absl::InvalidArgumentError(absl::StrCat("scheduler.tenant_weights: ", scheduler.tenant_weights_size(),
                                                   " tenants; at most ", kMaxTenantWeights));
  }
  for (const auto& [tenant, weight] : scheduler.tenant_weights()) {
    if (tenant.empty() || !IsValidTenant(tenant)) {
      return absl::InvalidArgumentError(absl::StrCat("scheduler.tenant_weights: tenant ", Quoted(tenant),
                                                     " is not 1..", kMaxTenantLength, " characters of [A-Za-z0-9._-]"));
    }
    if (!(weight > 0) || !(weight <= kMaxTenantWeight)) {
      return absl::InvalidArgumentError(absl::StrCat("scheduler.tenant_weights[", tenant, "]: ", weight,
                                                     " is out of range; allowed: (0, ", kMaxTenantWeight, "]"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ServerConfig> FinalizeServerConfig(v1::ServerConfig config, const PipelineRegistry* registry) {
  if (config.grpc_address().empty()) config.set_grpc_address(kDefaultGrpcAddress);
  if (config.metrics_address().empty()) config.set_metrics_address(kDefaultMetricsAddress);
  RETURN_IF_ERROR(CheckRange("queue_depth", config.queue_depth(), 0, kMaxQueueDepth,
                             absl::StrCat("0 (default ", kDefaultQueueDepth, ") or 1..", kMaxQueueDepth)));
  if (config.queue_depth() == 0) config.set_queue_depth(kDefaultQueueDepth);
  RETURN_IF_ERROR(CheckSchedulerConfig(config.scheduler(), config.queue_depth()));
  // The HTTP API's limits: 0 takes the default.
  v1::HttpConfig* http = config.mutable_http();
  auto zero_or = [](const std::string& field, int64_t value, int64_t lo, int64_t hi, int64_t fallback) {
    return value == 0 ? absl::OkStatus()
                      : CheckRange(field, value, lo, hi, absl::StrCat("0 (default ", fallback, ") or ", lo, "..", hi));
  };
  RETURN_IF_ERROR(zero_or("http.read_timeout_ms", http->read_timeout_ms(), 1000, 600000, 10000));
  if (http->read_timeout_ms() == 0) http->set_read_timeout_ms(10000);
  RETURN_IF_ERROR(zero_or("http.max_connections", http->max_connections(), 1, 100000, 1024));
  if (http->max_connections() == 0) http->set_max_connections(1024);
  RETURN_IF_ERROR(zero_or("http.max_connections_per_client", http->max_connections_per_client(), 1,
                          http->max_connections(), 32));
  if (http->max_connections_per_client() == 0) {
    http->set_max_connections_per_client(std::min(32, http->max_connections()));
  }
  RETURN_IF_ERROR(zero_or("http.max_body_bytes", http->max_body_bytes(), 1024, 64 << 20, 16 << 20));
  if (http->max_body_bytes() == 0) http->set_max_body_bytes(16 << 20);
  if (config.cuda_max_split_size_mb() != 0) {
    RETURN_IF_ERROR(CheckRange("cuda_max_split_size_mb", config.cuda_max_split_size_mb(), kMinCudaMaxSplitSizeMb,
                               kMaxCudaMaxSplitSizeMb,
                               absl::StrCat("0 (LibTorch's default: no limit) or ", kMinCudaMaxSplitSizeMb, "..",
                                            kMaxCudaMaxSplitSizeMb)));
  }
  RETURN_IF_ERROR(CheckRange("cpu_threads", config.cpu_threads(), 0, kMaxCpuThreads,
                             absl::StrCat("0 (LibTorch's default) or 1..", kMaxCpuThreads)));
  if (config.has_device() && config.devices_size() > 0) {
    return absl::InvalidArgumentError("device and devices: set one or the other (devices for several)");
  }
  std::vector<std::pair<std::string, const v1::DeviceConfig*>> device_configs;
  if (config.devices_size() == 0) {
    device_configs.emplace_back("device", &config.device());
  } else {
    for (int i = 0; i < config.devices_size(); ++i) {
      device_configs.emplace_back(absl::StrCat("devices[", i, "]"), &config.devices(i));
    }
  }
  for (const auto& [path, device_ptr] : device_configs) {
    const v1::DeviceConfig& device = *device_ptr;
    RETURN_IF_ERROR(CheckRange(absl::StrCat(path, ".index"), device.index(), 0, kMaxDeviceIndex,
                               absl::StrCat("0..", kMaxDeviceIndex)));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".memory_budget_bytes"), device.memory_budget_bytes(),
                                     "the whole device, or no limit when simulated"));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".simulated_bandwidth_bytes_per_second"),
                                     device.simulated_bandwidth_bytes_per_second(), "unlimited"));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".simulated_context_bytes"), device.simulated_context_bytes(),
                                     "none"));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".peer_bandwidth_bytes_per_second"),
                                     device.peer_bandwidth_bytes_per_second(), "peer eviction off"));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".streamed_group_cache.margin_bytes"),
                                     device.streamed_group_cache().margin_bytes(), "the default margin"));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".host_memory_budget_bytes"),
                                     device.host_memory_budget_bytes(), "no host memory budget"));
    RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(path, ".host_to_device_bandwidth_bytes_per_second"),
                                     device.host_to_device_bandwidth_bytes_per_second(),
                                     "the simulated bandwidth, or 2.5e10 on CUDA"));
    if (device.memory_budget_bytes() > 0 && device.simulated_context_bytes() >= device.memory_budget_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat(path, ".simulated_context_bytes: ",
                                                     device.simulated_context_bytes(),
                                                     " leaves nothing of memory_budget_bytes (",
                                                     device.memory_budget_bytes(), ")"));
    }
  }
  if (config.strategy().has_footprint()) {
    RETURN_IF_ERROR(CheckNonNegative("strategy.footprint.reserve_bytes",
                                     config.strategy().footprint().reserve_bytes(), "no reserve"));
  }
  const v1::TlsConfig& tls = config.tls();
  if (tls.cert_file().empty() != tls.key_file().empty()) {
    return absl::InvalidArgumentError("tls: set both cert_file and key_file, or neither");
  }
  if (!tls.cert_file().empty()) {
    RETURN_IF_ERROR(CheckPemFile(tls.cert_file(), "tls.cert_file", {"CERTIFICATE"}));
    RETURN_IF_ERROR(CheckPemFile(tls.key_file(), "tls.key_file",
                                 {"PRIVATE KEY", "RSA PRIVATE KEY", "EC PRIVATE KEY", "ENCRYPTED PRIVATE KEY"}));
  }
  if (!config.auth().admin_token().empty() && !config.auth().admin_token_file().empty()) {
    return absl::InvalidArgumentError("auth: set admin_token or admin_token_file, not both");
  }
  if (!config.auth().admin_token_file().empty()) {
    RETURN_IF_ERROR(CheckReadableFile(config.auth().admin_token_file(), "auth.admin_token_file: "));
  }
  if (!config.auth().api_key().empty() && !config.auth().api_key_file().empty()) {
    return absl::InvalidArgumentError("auth: set api_key or api_key_file, not both");
  }
  if (!config.auth().api_key_file().empty()) {
    RETURN_IF_ERROR(CheckReadableFile(config.auth().api_key_file(), "auth.api_key_file: "));
  }
  if (config.http_address() == "none") config.clear_http_address();
  AddDefaultPipelines(config, "");
  std::set<std::string> names;
  int defaults = 0;
  for (int i = 0; i < config.pipelines_size(); ++i) {
    v1::PipelineConfig* p = config.mutable_pipelines(i);
    const std::string field = absl::StrCat("pipelines[", i, "]");
    RETURN_IF_ERROR(FinalizePipelineConfig(*p, field, registry));
    if (!names.insert(p->name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".name: ", Quoted(p->name()), " is used by another pipeline"));
    }
    if (p->default_()) ++defaults;
  }
  if (defaults > 1) {
    return absl::InvalidArgumentError("pipelines: more than one pipeline sets default: true");
  }
  if (defaults == 0) config.mutable_pipelines(0)->set_default_(true);
  return config;
}

absl::StatusOr<GroupOffloadOptions> ToGroupOffloadOptions(const v1::GroupOffloadConfig& c,
                                                          const std::string& field) {
  GroupOffloadOptions o;
  o.type = c.offload_type() == v1::GroupOffloadConfig::LEAF_LEVEL ? OffloadType::kLeafLevel
                                                                   : OffloadType::kBlockLevel;
  RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".num_blocks_per_group"), c.num_blocks_per_group(), 0,
                             kMaxNumBlocksPerGroup, absl::StrCat("0 (= 1) or 1..", kMaxNumBlocksPerGroup)));
  if (c.num_blocks_per_group() > 0) o.num_blocks_per_group = c.num_blocks_per_group();
  o.block_modules.assign(c.block_modules().begin(), c.block_modules().end());
  switch (c.target()) {
    case v1::GroupOffloadConfig::PAGEABLE_HOST:
      o.target = OffloadTarget::kPageableHost;
      break;
    case v1::GroupOffloadConfig::DISK:
      o.target = OffloadTarget::kDisk;
      if (c.disk_dir().empty()) {
        return absl::InvalidArgumentError(absl::StrCat(field, ".disk_dir: required for target DISK"));
      }
      break;
    default:
      o.target = OffloadTarget::kPinnedHost;
  }
  o.use_stream = c.use_stream();
  RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".prefetch_depth"), c.prefetch_depth(), 0, kMaxPrefetchDepth,
                             absl::StrCat("0 (the engine's choice) or 1..", kMaxPrefetchDepth)));
  o.prefetch_depth = c.prefetch_depth();  // 0: the engine's per-level default.
  o.disk_dir = c.disk_dir();
  RETURN_IF_ERROR(CheckNonNegative(absl::StrCat(field, ".budget_bytes"), c.budget_bytes(), "stream every group"));
  o.budget_bytes = c.budget_bytes();
  if (c.staging_buffer_bytes() != 0) {
    RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".staging_buffer_bytes"), c.staging_buffer_bytes(),
                               kMinStagingBufferBytes, kMaxStagingBufferBytes,
                               absl::StrCat("0 (64 MiB) or ", kMinStagingBufferBytes, "..", kMaxStagingBufferBytes,
                                            " (1 MiB..4 GiB)")));
  }
  RETURN_IF_ERROR(CheckRange(absl::StrCat(field, ".staging_buffers"), c.staging_buffers(), 0, kMaxStagingBuffers,
                             absl::StrCat("0 (= 2) or 1..", kMaxStagingBuffers)));
  if (c.staging_buffer_bytes() > 0) o.staging_buffer_bytes = c.staging_buffer_bytes();
  if (c.staging_buffers() > 0) o.staging_buffers = c.staging_buffers();
  o.pin_in_place = !c.never_pin_in_place();
  switch (c.compress()) {
    case v1::GroupOffloadConfig::COMPRESS_NONE:
      o.compress = CompressFormat::kNone;
      break;
    case v1::GroupOffloadConfig::COMPRESS_INT8:
      o.compress = CompressFormat::kInt8;
      break;
    case v1::GroupOffloadConfig::COMPRESS_FP8:
      o.compress = CompressFormat::kFp8E4M3;
      break;
    case v1::GroupOffloadConfig::COMPRESS_INT8_GROUPED:
      o.compress = CompressFormat::kInt8Grouped;
      break;
    case v1::GroupOffloadConfig::COMPRESS_INT4:
      o.compress = CompressFormat::kInt4;
      break;
    case v1::GroupOffloadConfig::COMPRESS_AUTO:
      o.choose_compress = true;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(field, ".compress: ", static_cast<int>(c.compress()),
                                                     " is out of range; allowed: COMPRESS_NONE (0), "
                                                     "COMPRESS_INT8 (1), COMPRESS_FP8 (2), COMPRESS_INT8_GROUPED (3), "
                                                     "COMPRESS_INT4 (4), COMPRESS_AUTO (5)"));
  }
  if ((o.compress != CompressFormat::kNone || o.choose_compress) && o.target != OffloadTarget::kPinnedHost) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".compress: needs target PINNED_HOST (the compressed groups live in pinned memory)"));
  }
  return o;
}

absl::StatusOr<PipelineGroupOffloadOptions> ToPipelineGroupOffloadOptions(
    const v1::PipelineGroupOffload& c, const std::string& field) {
  PipelineGroupOffloadOptions o;
  auto defaults = ToGroupOffloadOptions(c.defaults(), absl::StrCat(field, ".defaults"));
  if (!defaults.ok()) return defaults.status();
  o.defaults = *defaults;
  o.exclude.assign(c.exclude().begin(), c.exclude().end());
  for (const auto& [name, override_config] : c.overrides()) {
    auto converted =
        ToGroupOffloadOptions(override_config, absl::StrCat(field, ".overrides[", Quoted(name), "]"));
    if (!converted.ok()) return converted.status();
    o.overrides[name] = *converted;
  }
  return o;
}

absl::StatusOr<std::unique_ptr<OffloadStrategy>> ToOffloadStrategy(
    const v1::OffloadStrategy& strategy, const std::vector<std::string>& components,
    const std::vector<std::string>& ids) {
  switch (strategy.strategy_case()) {
    case v1::OffloadStrategy::kFootprint:
    {
      RETURN_IF_ERROR(CheckNonNegative("strategy.footprint.reserve_bytes", strategy.footprint().reserve_bytes(),
                                       "no reserve"));
      const auto& keep = strategy.footprint().keep_resident();
      if (keep.size() > kMaxKeepResident) {
        return absl::InvalidArgumentError(absl::StrCat("strategy.footprint.keep_resident: ", keep.size(),
                                                       " entries; at most ", kMaxKeepResident));
      }
      const std::set<std::string> known(components.begin(), components.end());
      const std::set<std::string> known_ids(ids.begin(), ids.end());
      for (int i = 0; i < keep.size(); ++i) {
        const std::string& k = keep[i];
        // A name keeps that component of every pipeline; an id, the one registered under it (a
        // component shared by content is registered under the first pipeline that loaded it).
        const bool is_id = k.find('/') != std::string::npos;
        if (is_id ? known_ids.count(k) == 0 : known.count(k) == 0) {
          return absl::InvalidArgumentError(absl::StrCat(
              "strategy.footprint.keep_resident[", i, "]: '", Truncated(k), "' is no hosted component ",
              is_id ? "id; hosted ids: " : "name; hosted names: ", absl::StrJoin(is_id ? known_ids : known, ", ")));
        }
      }
      return MakeFootprintStrategy(strategy.footprint().reserve_bytes(),
                                   std::vector<std::string>(keep.begin(), keep.end()));
    }
    case v1::OffloadStrategy::kCustom:
      return MakeCustomStrategy(strategy.custom());
    case v1::OffloadStrategy::kWorkflow: {
      std::vector<WorkflowRule> rules;
      for (int i = 0; i < strategy.workflow().rules_size(); ++i) {
        const v1::WorkflowRule& r = strategy.workflow().rules(i);
        WorkflowRule rule;
        switch (r.rule_case()) {
          case v1::WorkflowRule::kAfter:
          case v1::WorkflowRule::kBefore: {
            const v1::WorkflowRule::Trigger& t = r.has_after() ? r.after() : r.before();
            rule.kind = r.has_after() ? WorkflowRule::Kind::kAfter : WorkflowRule::Kind::kBefore;
            rule.component = t.component();
            rule.offload.assign(t.offload().begin(), t.offload().end());
            break;
          }
          case v1::WorkflowRule::kKeepResident:
            rule.kind = WorkflowRule::Kind::kKeepResident;
            rule.component = r.keep_resident();
            break;
          default:
            return absl::InvalidArgumentError(absl::StrCat(
                "strategy.workflow.rules[", i, "]: empty rule; set after, before or keep_resident"));
        }
        rules.push_back(std::move(rule));
      }
      auto made = MakeWorkflowStrategy(std::move(rules), components);
      if (!made.ok()) {
        return absl::Status(made.status().code(),
                            absl::StrCat("strategy.workflow.", made.status().message()));
      }
      return made;
    }
    default:
      return absl::InvalidArgumentError("strategy: empty; set footprint, workflow or custom");
  }
}

}  // namespace stowage
