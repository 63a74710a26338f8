// Server configuration: loading (protobuf text format or JSON, parsed by protobuf itself),
// defaults, and validation that names the offending field.
#ifndef STOWAGE_RUNTIME_CONFIG_H_
#define STOWAGE_RUNTIME_CONFIG_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "placement/placement_manager.h"
#include "runtime/scheduler.h"
#include "stowage/v1/config.pb.h"

namespace stowage {

class PipelineRegistry;  // models/pipeline_registry.h

inline constexpr char kDefaultGrpcAddress[] = "127.0.0.1:50051";
inline constexpr char kDefaultMetricsAddress[] = "127.0.0.1:9464";
inline constexpr int kDefaultQueueDepth = 16;
// The pipeline served when the config names none: the built-in tiny Z-Image (random weights).
inline constexpr char kDefaultPipelineName[] = "zimage-tiny";
// The trained demo pipeline (models/demo) that stowage_server serves, as its default, beside
// kDefaultPipelineName when started without --config and the demo's folder is found.
inline constexpr char kDemoPipelineName[] = "shapes";
inline constexpr int kDemoImageSize = 128;

// Ranges of the numeric options, enforced by FinalizeServerConfig / ToGroupOffloadOptions (and so
// by the admin API, which converts through the same functions); out of range is INVALID_ARGUMENT
// naming the field path and the range. README.md "Configuration reference" lists them. The upper
// bounds keep a typo from allocating gigabytes or spawning thousands of threads at start.
// queue_depth: 0 (the default, kDefaultQueueDepth) or 1..4096.
inline constexpr int kMaxQueueDepth = 4096;
// cpu_threads: 0 (LibTorch's default) ..1024.
inline constexpr int kMaxCpuThreads = 1024;
// ServerConfig.cuda_max_split_size_mb: LibTorch's allocator needs more than its 20 MiB large-buffer
// size; the top is a sanity bound (1 TiB).
inline constexpr int64_t kMinCudaMaxSplitSizeMb = 21;
inline constexpr int64_t kMaxCudaMaxSplitSizeMb = 1 << 20;
// device.index: 0..127 (c10::DeviceIndex is an int8_t in LibTorch 1.13).
inline constexpr int kMaxDeviceIndex = 127;
// batching.max_batch_size: 0 or 1 (off) ..64; batching.max_queue_delay_ms: 0..60000.
inline constexpr int kMaxBatchSize = 64;
inline constexpr int kMaxBatchQueueDelayMs = 60000;
// pipelines[i].default_size: 0 (the architecture's) or 16..8192.
inline constexpr int kMinDefaultSize = 16;
inline constexpr int kMaxDefaultSize = 8192;
// group offload prefetch_depth: 0 (the engine's choice) ..64; each step adds a device slot.
inline constexpr int kMaxPrefetchDepth = 64;
// strategy.footprint.keep_resident: at most this many entries.
inline constexpr int kMaxKeepResident = 64;
// group offload num_blocks_per_group: 0 (= 1) ..4096.
inline constexpr int kMaxNumBlocksPerGroup = 4096;
// group offload staging_buffer_bytes: 0 (64 MiB) or 1 MiB..4 GiB, pinned host memory each.
inline constexpr int64_t kMinStagingBufferBytes = int64_t{1} << 20;
inline constexpr int64_t kMaxStagingBufferBytes = int64_t{4} << 30;
// group offload staging_buffers: 0 (= 2) ..64.
inline constexpr int kMaxStagingBuffers = 64;
// Byte budgets, bandwidths and reserves (device.memory_budget_bytes,
// device.simulated_bandwidth_bytes_per_second, group offload budget_bytes,
// strategy.footprint.reserve_bytes): 0..2^63-1, 0 meaning unlimited / whole device / none.

// Reads `path`: JSON if it ends in ".json", protobuf text format otherwise. Errors name the file and
// the line/column or field; a path that is not a readable regular file (missing, a directory,
// unreadable) is NOT_FOUND, INVALID_ARGUMENT or PERMISSION_DENIED naming it.
// The kind of device `device` configures: its own kind, or when unspecified CUDA where LibTorch sees
// a GPU and the simulated accelerator elsewhere. The one place that rule lives.
v1::DeviceConfig::Kind ResolvedKind(const v1::DeviceConfig& device);
// The name of the device `device` configures ("cuda:0", "sim:1"), as its backend names itself.
// DeviceNameOf(v1::DeviceConfig()) is the device a server without `devices` runs on.
std::string DeviceNameOf(const v1::DeviceConfig& device);

// Scheduler bounds (ServerConfig.scheduler, GenerateRequest.priority/tenant).
inline constexpr int kMaxReorderDelayMs = 60000;
inline constexpr size_t kMaxTenantLength = 64;
// GenerateRequest.partial_images: previews per image (OpenAI's bound on partial_images).
inline constexpr int kMaxPartialImages = 3;
// GenerateRequest.loras: adapters per request and the range of their scales.
inline constexpr int kMaxLorasPerRequest = 8;
inline constexpr float kMaxLoraScale = 10.0f;
inline constexpr int kMaxTenantWeights = 256;
inline constexpr double kMaxTenantWeight = 1000;
// SchedulerConfig.tenant_burst_work: its default (four 8-step 1024x1024 images) and its bound.
inline constexpr double kDefaultTenantBurstWork = 32;
inline constexpr double kMaxTenantBurstWork = 10000;

// True for a tenant name the scheduler accepts: at most kMaxTenantLength of [A-Za-z0-9._-]
// (empty is the default tenant).
bool IsValidTenant(const std::string& tenant);
// The scheduler options of a validated ServerConfig.scheduler.
SchedulerOptions ToSchedulerOptions(const v1::SchedulerConfig& config);
// INVALID_ARGUMENT naming the field ("scheduler.max_reorder_delay_ms: ...") for a SchedulerConfig
// out of range (tenant_queue_limit against `queue_depth`); FinalizeServerConfig and the admin
// SetScheduler RPC use it.
absl::Status CheckSchedulerConfig(const v1::SchedulerConfig& scheduler, int queue_depth);

absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path);

// Fills unset fields with their documented defaults (including the built-in pipeline when none is
// configured), then validates: ranges, names, that model_dir is a directory and that the TLS and
// token files are readable regular files. Errors are INVALID_ARGUMENT with the field path (NOT_FOUND
// for a model_dir or file that does not exist), e.g.
// "pipelines[1].name: 'Tiny!' must match [a-z0-9_-]{1,64}",
// "queue_depth: 5000 is out of range; allowed: 0 (default 16) or 1..4096".
// Text from the config is echoed cut to a short printable prefix (base/text.h Truncated).
// Built-in pipeline names are checked against `registry` (null: DefaultPipelineRegistry()).
absl::StatusOr<v1::ServerConfig> FinalizeServerConfig(v1::ServerConfig config,
                                                      const PipelineRegistry* registry = nullptr);

// The PYTORCH_CUDA_ALLOC_CONF value `config` asks for (cuda_expandable_segments,
// cuda_max_split_size_mb; "" when none), e.g. "expandable_segments:True,max_split_size_mb:256".
std::string CudaAllocatorConf(const v1::ServerConfig& config);

// Applies the process-wide CUDA allocator settings of `config` (CudaAllocatorConf) to the
// environment LibTorch's allocator reads (PYTORCH_CUDA_ALLOC_CONF), unless the environment already
// configures the allocator (a non-empty PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF: it wins).
// `note`: what it found or did, for the start-up log ("" when the config asks nothing);
// `changed_environment`: it set the variable, so a process whose CUDA libraries may already have
// read theirs should start again (stowage_server re-executes itself, as for CUDA_MODULE_LOADING).
// Not thread-safe (setenv).
struct CudaAllocatorSettings {
  std::string note;
  bool changed_environment = false;
};
CudaAllocatorSettings ApplyCudaAllocatorSettings(const v1::ServerConfig& config);

// The pipelines of a server whose config names none: the trained demo from `demo_dir` (name
// kDemoPipelineName, the default pipeline, kDemoImageSize images) when `demo_dir` is not empty,
// then the built-in kDefaultPipelineName. Does nothing when `config` names pipelines.
void AddDefaultPipelines(v1::ServerConfig& config, const std::string& demo_dir);

// Fills one pipeline's defaults and validates it; errors name `field` ("pipelines[2]").
absl::Status FinalizePipelineConfig(v1::PipelineConfig& pipeline, const std::string& field,
                                    const PipelineRegistry* registry = nullptr);

// Validates batching settings (ranges above) and fills the default (max_batch_size 0 → 1, off);
// errors name `field` ("pipelines[0].batching"). The admin SetBatching RPC uses it too.
absl::Status FinalizeBatchingConfig(v1::BatchingConfig& batching, const std::string& field);

// Converts validated config messages to the engine's options. `field` names the message in errors
// ("pipelines[0].group_offload.defaults").
absl::StatusOr<GroupOffloadOptions> ToGroupOffloadOptions(const v1::GroupOffloadConfig& config,
                                                          const std::string& field);
absl::StatusOr<PipelineGroupOffloadOptions> ToPipelineGroupOffloadOptions(
    const v1::PipelineGroupOffload& config, const std::string& field);

// A strategy message → a placement strategy; errors name the rule ("strategy.workflow.rules[2]: ...").
// `components`: the hosted components' names (workflow rules and footprint.keep_resident names are
// checked against them); `ids`: their ids ("<pipeline>/<component>", what a keep_resident id must be).
absl::StatusOr<std::unique_ptr<OffloadStrategy>> ToOffloadStrategy(
    const v1::OffloadStrategy& strategy, const std::vector<std::string>& components,
    const std::vector<std::string>& ids = {});

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_CONFIG_H_
