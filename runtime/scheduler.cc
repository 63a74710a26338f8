#include "runtime/scheduler.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace stowage {
namespace {

// Past this many remembered flows, those not waiting are forgotten (a returning one starts at the
// last served virtual time, as a newcomer does): client-chosen tenant names cannot grow memory.
constexpr size_t kMaxRememberedFlows = 4096;

std::string Bytes(int64_t bytes) {
  if (bytes >= (int64_t{1} << 20)) return absl::StrCat(bytes / (int64_t{1} << 20), " MiB");
  if (bytes >= (int64_t{1} << 10)) return absl::StrCat(bytes / (int64_t{1} << 10), " KiB");
  return absl::StrCat(bytes, " bytes");
}

}  // namespace

double Scheduler::TenantWeight(const std::string& tenant) const {
  auto it = options_.tenant_weights.find(tenant);
  return it != options_.tenant_weights.end() && it->second > 0 ? it->second : 1.0;
}

void Scheduler::LiftNewcomers(const std::vector<const ScheduleEntry*>& entries) {
  std::map<int, bool> levels_now;
  std::map<std::pair<int, std::string>, bool> tenants_now;
  for (const ScheduleEntry* e : entries) {
    levels_now[e->priority] = true;
    tenants_now[{e->priority, e->tenant}] = true;
  }
  for (const auto& [level, unused] : levels_now) {
    if (levels_waiting_.count(level) == 0) level_time_[level] = std::max(level_time_[level], last_level_time_);
  }
  for (const auto& [key, unused] : tenants_now) {
    if (tenants_waiting_.count(key) == 0) {
      // A returning tenant may be behind the others by its burst credit, never more.
      tenant_time_[key] = std::max(tenant_time_[key],
                                   last_tenant_time_[key.first] - options_.tenant_burst / TenantWeight(key.second));
    }
  }
  levels_waiting_ = std::move(levels_now);
  tenants_waiting_ = std::move(tenants_now);
  if (tenant_time_.size() > kMaxRememberedFlows) {
    for (auto it = tenant_time_.begin(); it != tenant_time_.end();) {
      it = tenants_waiting_.count(it->first) == 0 ? tenant_time_.erase(it) : std::next(it);
    }
  }
}

ScheduleChoice Scheduler::Pick(const std::vector<const ScheduleEntry*>& entries,
                               const std::function<int64_t(const std::string&)>& move_bytes, absl::Time now) {
  ScheduleChoice choice;
  if (entries.empty()) return choice;
  LiftNewcomers(entries);
  if (entries.size() == 1) return choice;

  // 1. The priority level.
  int level = entries.front()->priority;
  if (options_.priority_mode == PriorityMode::kStrict) {
    for (const ScheduleEntry* e : entries) level = std::max(level, e->priority);
  } else {
    for (const ScheduleEntry* e : entries) {
      const double t = level_time_[e->priority], best = level_time_[level];
      if (t < best || (t == best && e->priority > level)) level = e->priority;
    }
  }
  // 2. The tenant at that level: the least served; ties go to the one waiting longest (entries are
  // in arrival order, so the first seen).
  const std::string* tenant = nullptr;
  for (const ScheduleEntry* e : entries) {
    if (e->priority != level) continue;
    if (tenant == nullptr || tenant_time_[{level, e->tenant}] < tenant_time_[{level, *tenant}]) tenant = &e->tenant;
  }
  size_t oldest = entries.size();
  std::vector<size_t> candidates;  // Every request at the level, in arrival order.
  for (size_t i = 0; i < entries.size(); ++i) {
    if (entries[i]->priority != level) continue;
    candidates.push_back(i);
    if (oldest == entries.size() && entries[i]->tenant == *tenant) oldest = i;
  }
  // 3. Residency within the level (any tenant), bounded by max_reorder_delay.
  choice.index = oldest;
  const absl::Duration waited = now - entries[oldest]->enqueued;
  if (options_.max_reorder_delay <= absl::ZeroDuration() || candidates.size() == 1 ||
      waited >= options_.max_reorder_delay || !move_bytes) {
    return choice;
  }
  std::map<std::string, int64_t> bytes;
  for (size_t i : candidates) {
    const std::string& pipeline = entries[i]->pipeline;
    if (bytes.count(pipeline) == 0) bytes[pipeline] = move_bytes(pipeline);
  }
  size_t best = oldest;
  for (size_t i : candidates) {
    if (bytes[entries[i]->pipeline] < bytes[entries[best]->pipeline]) best = i;
  }
  if (best != oldest) {
    choice.index = best;
    choice.reason = absl::StrCat(
        "ran before an older request of pipeline '", entries[oldest]->pipeline, "' (", Bytes(bytes[entries[oldest]->pipeline]),
        " to move; waited ", absl::FormatDuration(absl::Trunc(waited, absl::Milliseconds(1))), " of max_reorder_delay ",
        absl::FormatDuration(options_.max_reorder_delay), "): pipeline '", entries[best]->pipeline, "' moves ",
        Bytes(bytes[entries[best]->pipeline]));
    if (entries[best]->tenant != entries[oldest]->tenant) {
      absl::StrAppend(&choice.reason, "; tenant '", entries[best]->tenant, "' ahead of tenant '", entries[oldest]->tenant,
                      "', whose turn it was");
    }
  }
  return choice;
}

bool Scheduler::Preempts(const PreemptionCase& c, std::string* reason) const {
  if (options_.preemption == Preemption::kNone || c.running == nullptr || c.candidate == nullptr) return false;
  const ScheduleEntry& running = *c.running;
  const ScheduleEntry& candidate = *c.candidate;
  if (running.deadline != absl::InfiniteFuture() &&
      !(c.remaining_seconds > 0 && c.candidate_seconds > 0 &&
        c.now + absl::Seconds(c.remaining_seconds + c.candidate_seconds) < running.deadline)) {
    return false;  // It could pass its deadline paused (or the times are not known yet).
  }
  if (candidate.priority > running.priority) {
    *reason = absl::StrCat("priority ", candidate.priority, " preempts the running request of pipeline '",
                           running.pipeline, "' (priority ", running.priority, ") between its denoising steps");
    return true;
  }
  if (options_.preemption != Preemption::kResident || candidate.priority != running.priority) return false;
  if (c.candidate_move_bytes != 0 || c.paused >= options_.max_reorder_delay) return false;
  const bool timed = c.remaining_seconds > 0 && c.candidate_seconds > 0;
  if (timed ? !(c.candidate_seconds < c.remaining_seconds) : !(candidate.cost < c.remaining_cost)) return false;
  const std::string paused = absl::StrCat(
      "; paused ", absl::FormatDuration(absl::Trunc(c.paused, absl::Milliseconds(1))),
      " so far of max_reorder_delay ", absl::FormatDuration(options_.max_reorder_delay), ")");
  if (timed) {
    *reason = absl::StrCat("pipeline '", candidate.pipeline, "' moves nothing and its run (",
                           absl::StrFormat("%.3f", c.candidate_seconds),
                           " s expected) is shorter than the running request of pipeline '", running.pipeline,
                           "' has left (", absl::StrFormat("%.3f", c.remaining_seconds), " s", paused);
  } else {
    *reason = absl::StrCat("pipeline '", candidate.pipeline, "' moves nothing and its work (", candidate.cost,
                           ") is less than the running request of pipeline '", running.pipeline, "' has left (",
                           c.remaining_cost, paused);
  }
  return true;
}

void Scheduler::Charge(const ScheduleEntry& entry) {
  const int level = entry.priority;
  last_level_time_ = level_time_[level];
  level_time_[level] += entry.cost / static_cast<double>(level + 1);
  const std::pair<int, std::string> key{level, entry.tenant};
  // The mark newcomers start from never goes back (a tenant served on its burst credit, or out of
  // turn for residency, is behind it): each returning tenant's credit counts from the same mark,
  // so credits never add up.
  last_tenant_time_[level] = std::max(last_tenant_time_[level], tenant_time_[key]);
  tenant_time_[key] += entry.cost / TenantWeight(entry.tenant);
}

}  // namespace stowage
