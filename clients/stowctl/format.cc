#include "clients/stowctl/format.h"

#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/time_util.h"

namespace stowage {
namespace {

double Seconds(const google::protobuf::Duration& d) {
  return static_cast<double>(google::protobuf::util::TimeUtil::DurationToNanoseconds(d)) / 1e9;
}

void Row(std::string& out, const std::string& key, const std::string& value) {
  absl::StrAppendFormat(&out, "%-20s %s\n", key, value);
}

}  // namespace

std::string HumanBytes(int64_t bytes) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  if (unit == 0) return absl::StrCat(bytes, " B");
  return absl::StrFormat("%.2f %s", value, kUnits[unit]);
}

std::string FormatGenerateResponse(const v1::GenerateResponse& response, const std::string& out_path) {
  const v1::RequestStats& stats = response.stats();
  std::string out;
  Row(out, "pipeline", response.pipeline());
  if (!response.request_id().empty()) Row(out, "request id", response.request_id());
  Row(out, "seed", absl::StrCat(response.seed()));
  Row(out, "image", absl::StrCat(response.width(), "x", response.height(), " PNG, ",
                                 HumanBytes(static_cast<int64_t>(response.image().size())),
                                 out_path.empty() ? "" : absl::StrCat(" -> ", out_path)));
  Row(out, "device", stats.device());
  Row(out, "queue wait", absl::StrFormat("%.3f s", Seconds(stats.queue_wait())));
  if (stats.batch_size() > 1) {
    Row(out, "batch", absl::StrFormat("%d requests (held open %.3f s); shared figures are the batch's",
                                      stats.batch_size(), Seconds(stats.batch_wait())));
  }
  Row(out, "run time", absl::StrFormat("%.3f s", Seconds(stats.run_time())));
  for (const v1::StageTiming& stage : stats.stages()) {
    Row(out, absl::StrCat("  ", stage.stage()),
        absl::StrFormat("%.3f s%s", Seconds(stage.duration()), stage.shared() ? " (shared)" : ""));
  }
  Row(out, "peak device memory", HumanBytes(stats.peak_device_memory_bytes()));
  Row(out, "peak reserved", HumanBytes(stats.peak_device_reserved_bytes()));
  Row(out, "peak CPU RSS", HumanBytes(stats.peak_cpu_rss_bytes()));
  Row(out, "host to device", HumanBytes(stats.host_to_device_bytes()));
  Row(out, "device to host", HumanBytes(stats.device_to_host_bytes()));
  return out;
}

std::string FormatProgress(const v1::Progress& progress) {
  std::string step = progress.total_steps() > 0
                         ? absl::StrCat("  step ", progress.step(), "/", progress.total_steps())
                         : "";
  return absl::StrFormat("%-14s%s  elapsed %.3f s", progress.stage(), step, Seconds(progress.elapsed()));
}

std::string FormatPipelines(const v1::ListPipelinesResponse& response) {
  std::string out;
  for (const v1::Pipeline& p : response.pipelines()) {
    absl::StrAppend(&out, p.name(), p.is_default() ? " (default)" : "", " on ", p.device(), ": ",
                    p.description(), "\n");
    absl::StrAppendFormat(&out, "  defaults %dx%d, %d steps, guidance %.1f; sizes %d..%d step %d, "
                          "at most %d steps, prompt at most %d bytes\n",
                          p.default_width(), p.default_height(), p.default_inference_steps(),
                          p.default_guidance_scale(), p.min_size(), p.max_size(), p.size_multiple(),
                          p.max_inference_steps(), p.max_prompt_bytes());
    if (p.max_batch_size() > 1) {
      absl::StrAppendFormat(&out, "  batching: up to %d requests, waiting up to %d ms\n", p.max_batch_size(),
                            p.max_queue_delay_ms());
    }
    int64_t total = 0;
    for (const v1::PipelineComponent& c : p.components()) {
      absl::StrAppendFormat(&out, "  %-14s %-18s %-9s %12s %14d params\n", c.name(), c.kind(),
                            c.dtype(), HumanBytes(c.weight_bytes()), c.parameter_count());
      total += c.weight_bytes();
    }
    absl::StrAppendFormat(&out, "  %-14s %-18s %-9s %12s\n", "total", "", "", HumanBytes(total));
  }
  return out;
}

std::string FormatPlacement(const v1::GetPlacementResponse& r) {
  std::string out = absl::StrCat(
      "device ", r.device(), ": ", HumanBytes(r.allocated_bytes()), " allocated of ",
      r.budget_bytes() > 0 ? HumanBytes(r.budget_bytes()) : std::string("unlimited"), "; strategy ",
      r.strategy(), "; OOM recoveries ", r.oom_recoveries(),
      r.cache_margin_bytes() > 0 ? absl::StrCat("; cache margin ", HumanBytes(r.cache_margin_bytes())) : std::string(),
      r.allocator_retries() > 0 || r.allocator_ooms() > 0
          ? absl::StrCat("; allocator ran short ", r.allocator_retries(), " retries, ", r.allocator_ooms(), " OOMs")
          : std::string(),
      "\n");
  if (r.pipeline_prefetches() > 0) {
    absl::StrAppend(&out, "pipeline prefetches: ", r.pipeline_prefetches(), " (", HumanBytes(r.pipeline_prefetch_bytes()),
                    "), ", r.pipeline_prefetches_used(), " used, ", r.pipeline_prefetches_unused(), " moved off unused\n");
  }
  for (const v1::ComponentPlacement& c : r.components()) {
    absl::StrAppendFormat(&out, "  %-24s %-18s %12s on device / %12s weights", c.id(),
                          v1::ComponentPlacement::State_Name(c.state()), HumanBytes(c.device_bytes()),
                          HumanBytes(c.weight_bytes()));
    if (c.run_headroom_bytes() > 0) absl::StrAppend(&out, "; a run allocates ", HumanBytes(c.run_headroom_bytes()), " more");
    absl::StrAppend(&out, "\n");
    if (!c.has_group_offload()) continue;
    const v1::GroupOffloadStatus& g = c.group_offload();
    absl::StrAppendFormat(&out, "    groups %d streamed / %d resident, %s per forward, working set %s", g.streamed_groups(),
                          g.resident_groups(), HumanBytes(g.bytes_per_forward()), HumanBytes(g.working_set_bytes()));
    if (!g.compress().empty() && g.compress() != "none") {
      absl::StrAppend(&out, ", ", g.compress(), " (", HumanBytes(g.compressed_host_bytes()), " on the host)");
    }
    if (g.one_pass_fp8_weights() > 0) {
      absl::StrAppend(&out, ", ", g.one_pass_fp8_weights(), " FP8 weights made with their int4 copy in one pass");
    }
    if (g.pinned_in_place_bytes() > 0) absl::StrAppend(&out, ", pinned in place ", HumanBytes(g.pinned_in_place_bytes()));
    if (!g.pin_in_place_error().empty()) absl::StrAppend(&out, ", not pinned: ", g.pin_in_place_error());
    absl::StrAppend(&out, "; ", g.forwards(), " forwards");
    if (g.cache_hits() > 0 || g.cache_bytes() > 0) {
      absl::StrAppend(&out, "; spare-room cache ", g.cached_groups(), " groups (", HumanBytes(g.cache_bytes()), "), ",
                      g.cache_hits(), " onloads served (", HumanBytes(g.cache_hit_bytes()), " not copied)");
    }
    absl::StrAppend(&out, "\n");
  }
  for (const std::string& w : r.warnings()) absl::StrAppend(&out, "  warning: ", w, "\n");
  return out;
}

}  // namespace stowage
