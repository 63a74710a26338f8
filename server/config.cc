#include "server/config.h"

#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/io/tokenizer.h"
#include "google/protobuf/text_format.h"
#include "google/protobuf/util/json_util.h"
#include "base/status_macros.h"

namespace stowage {
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

}  // namespace

absl::StatusOr<v1::ServerConfig> LoadServerConfig(const std::string& path) {
  std::ifstream file(path);
  if (!file) return absl::NotFoundError(absl::StrCat("cannot read config file '", path, "'"));
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

absl::Status FinalizePipelineConfig(v1::PipelineConfig& p, const std::string& field) {
  if (!ValidName(p.name())) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".name: '", p.name(), "' must match [a-z0-9_-]{1,64}"));
  }
  if (p.source_case() == v1::PipelineConfig::SOURCE_NOT_SET) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": no source; set builtin: \"tiny\" or model_dir"));
  }
  if (p.source_case() == v1::PipelineConfig::kModelDir) {
    if (p.model_dir().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(field, ".model_dir: empty path"));
    }
  } else if (p.builtin() != "tiny" && p.builtin() != "zimage-tiny") {
    return absl::InvalidArgumentError(absl::StrCat(field, ".builtin: unknown built-in '", p.builtin(),
                                                   "'; available: tiny, zimage-tiny"));
  }
  if (p.dtype().empty()) p.set_dtype("float32");
  if (p.dtype() != "float32" && p.dtype() != "bfloat16") {
    return absl::InvalidArgumentError(absl::StrCat(field, ".dtype: '", p.dtype(),
                                                   "' is not supported; use float32 or bfloat16"));
  }
  if (p.group_offload().enabled()) {
    auto options = ToPipelineGroupOffloadOptions(p.group_offload(), absl::StrCat(field, ".group_offload"));
    if (!options.ok()) return options.status();
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::ServerConfig> FinalizeServerConfig(v1::ServerConfig config) {
  if (config.grpc_address().empty()) config.set_grpc_address(kDefaultGrpcAddress);
  if (config.metrics_address().empty()) config.set_metrics_address(kDefaultMetricsAddress);
  if (config.queue_depth() == 0) config.set_queue_depth(kDefaultQueueDepth);
  if (config.queue_depth() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("queue_depth: ", config.queue_depth(), " is negative; must be >= 1"));
  }
  if (config.cpu_threads() < 0) {
    return absl::InvalidArgumentError("cpu_threads: must be >= 0 (0 keeps LibTorch's default)");
  }
  const v1::DeviceConfig& device = config.device();
  if (device.index() < 0) return absl::InvalidArgumentError("device.index: must be >= 0");
  if (device.memory_budget_bytes() < 0) {
    return absl::InvalidArgumentError("device.memory_budget_bytes: must be >= 0 (0 = whole device)");
  }
  if (device.simulated_bandwidth_bytes_per_second() < 0) {
    return absl::InvalidArgumentError("device.simulated_bandwidth_bytes_per_second: must be >= 0");
  }
  if (config.pipelines().empty()) {
    // The built-in default: Z-Image's architecture at a tiny size, random weights.
    v1::PipelineConfig* builtin = config.add_pipelines();
    builtin->set_name(kDefaultPipelineName);
    builtin->set_builtin(kDefaultPipelineName);
  }
  std::set<std::string> names;
  int defaults = 0;
  for (int i = 0; i < config.pipelines_size(); ++i) {
    v1::PipelineConfig* p = config.mutable_pipelines(i);
    const std::string field = absl::StrCat("pipelines[", i, "]");
    RETURN_IF_ERROR(FinalizePipelineConfig(*p, field));
    if (!names.insert(p->name()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(field, ".name: '", p->name(), "' is used by another pipeline"));
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
  if (c.num_blocks_per_group() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".num_blocks_per_group: must be >= 1"));
  }
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
  if (c.prefetch_depth() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ".prefetch_depth: must be >= 1, or 0 for the engine's choice"));
  }
  o.prefetch_depth = c.prefetch_depth();  // 0: the engine's per-level default.
  o.disk_dir = c.disk_dir();
  if (c.budget_bytes() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".budget_bytes: must be >= 0"));
  }
  o.budget_bytes = c.budget_bytes();
  if (c.staging_buffer_bytes() < 0 || c.staging_buffers() < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ".staging_*: must be >= 0"));
  }
  if (c.staging_buffer_bytes() > 0) o.staging_buffer_bytes = c.staging_buffer_bytes();
  if (c.staging_buffers() > 0) o.staging_buffers = c.staging_buffers();
  o.pin_in_place = !c.never_pin_in_place();
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
    auto converted = ToGroupOffloadOptions(override_config, absl::StrCat(field, ".overrides[", name, "]"));
    if (!converted.ok()) return converted.status();
    o.overrides[name] = *converted;
  }
  return o;
}

absl::StatusOr<std::unique_ptr<OffloadStrategy>> ToOffloadStrategy(
    const v1::OffloadStrategy& strategy, const std::vector<std::string>& components) {
  switch (strategy.strategy_case()) {
    case v1::OffloadStrategy::kFootprint:
      if (strategy.footprint().reserve_bytes() < 0) {
        return absl::InvalidArgumentError("strategy.footprint.reserve_bytes: must be >= 0");
      }
      return MakeFootprintStrategy(strategy.footprint().reserve_bytes());
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
