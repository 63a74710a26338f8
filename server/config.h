// Server configuration: loading (protobuf text format or JSON, parsed by protobuf itself),
// defaults, and validation that names the offending field.
#ifndef STOWAGE_SERVER_CONFIG_H_
#define STOWAGE_SERVER_CONFIG_H_

#include <string>

#include "absl/status/statusor.h"
#include "placement/placement_manager.h"
#include "stowage/v1/config.pb.h"

namespace stowage {

inline constexpr char kDefaultGrpcAddress[] = "127.0.0.1:50051";
inline constexpr char kDefaultMetricsAddress[] = "127.0.0.1:9464";
inline constexpr int kDefaultQueueDepth = 16;
// The pipeline served when the config names none: the built-in tiny Z-Image (random weights).
inline constexpr char kDefaultPipelineName[] = "zimage-tiny";

// Reads `path`: JSON if it ends in ".json", protobuf text format otherwise. Errors name the file and
// the line/column or field.
absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path);

// Fills unset fields with their documented defaults (including the built-in pipeline when none is
// configured), then validates. Errors are INVALID_ARGUMENT with the field path, e.g.
// "pipelines[1].name: 'Tiny!' must match [a-z0-9_-]{1,64}".
absl::StatusOr<v1::ServerConfig> FinalizeServerConfig(v1::ServerConfig config);

// Fills one pipeline's defaults and validates it; errors name `field` ("pipelines[2]").
absl::Status FinalizePipelineConfig(v1::PipelineConfig& pipeline, const std::string& field);

// Converts validated config messages to the engine's options. `field` names the message in errors
// ("pipelines[0].group_offload.defaults").
absl::StatusOr<GroupOffloadOptions> ToGroupOffloadOptions(const v1::GroupOffloadConfig& config,
                                                          const std::string& field);
absl::StatusOr<PipelineGroupOffloadOptions> ToPipelineGroupOffloadOptions(
    const v1::PipelineGroupOffload& config, const std::string& field);

// A strategy message → a placement strategy. Workflow rules are validated against `components`
// (every hosted component name); errors name the rule ("strategy.workflow.rules[2]: ...").
absl::StatusOr<std::unique_ptr<OffloadStrategy>> ToOffloadStrategy(
    const v1::OffloadStrategy& strategy, const std::vector<std::string>& components);

}  // namespace stowage

#endif  // STOWAGE_SERVER_CONFIG_H_
