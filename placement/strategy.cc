#include "placement/strategy.h"

#include <algorithm>
#include <set>

#include "absl/base/thread_annotations.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "base/text.h"

namespace stowage {
namespace {

// Older first; among equal times, by id, so decisions are deterministic.
bool LessRecentlyUsed(const Candidate& a, const Candidate& b) {
  if (a.last_use != b.last_use) return a.last_use < b.last_use;
  return a.id < b.id;
}

// The fewest bytes covering `deficit` (see MakeFootprintStrategy).
std::vector<std::string> CoverDeficit(std::vector<Candidate> resident, int64_t deficit) {
  if (deficit <= 0 || resident.empty()) return {};
  // One component that covers it alone: the smallest such, LRU among equals.
  const Candidate* single = nullptr;
  for (const Candidate& c : resident) {
    if (c.bytes < deficit) continue;
    if (single == nullptr || c.bytes < single->bytes ||
        (c.bytes == single->bytes && LessRecentlyUsed(c, *single))) {
      single = &c;
    }
  }
  if (single != nullptr) return {single->id};
  // Largest first until covered, then drop the smallest chosen ones that are not needed.
  std::sort(resident.begin(), resident.end(), [](const Candidate& a, const Candidate& b) {
    if (a.bytes != b.bytes) return a.bytes > b.bytes;
    return LessRecentlyUsed(a, b);
  });
  std::vector<Candidate> chosen;
  int64_t covered = 0;
  for (const Candidate& c : resident) {
    if (covered >= deficit) break;
    chosen.push_back(c);
    covered += c.bytes;
  }
  if (covered < deficit) {
    std::vector<std::string> all;
    for (const Candidate& c : chosen) all.push_back(c.id);
    return all;  // Not enough even with everything: evict all; the caller sees the shortfall.
  }
  // The chosen are sorted largest first: try dropping from the smallest end.
  std::vector<bool> keep(chosen.size(), true);
  for (size_t i = chosen.size(); i-- > 0;) {
    if (covered - chosen[i].bytes >= deficit) {
      covered -= chosen[i].bytes;
      keep[i] = false;
    }
  }
  std::vector<std::string> ids;
  for (size_t i = 0; i < chosen.size(); ++i) {
    if (keep[i]) ids.push_back(chosen[i].id);
  }
  return ids;
}


class FootprintStrategy : public OffloadStrategy {
 public:
  FootprintStrategy(int64_t reserve, std::vector<std::string> keep)
      : reserve_(reserve), keep_(keep.begin(), keep.end()) {}
  std::string name() const override { return "footprint"; }
  bool footprint_based() const override { return true; }
  std::vector<std::string> BeforeRun(const StrategyInput& in) override {
    const int64_t free = in.free_bytes == INT64_MAX ? INT64_MAX : in.free_bytes - reserve_;
    if (free >= in.needed_bytes) return {};
    if (keep_.empty()) return CoverDeficit(in.resident, in.needed_bytes - free);
    std::vector<Candidate> movable;
    for (const Candidate& c : in.resident) {
      if (!Keeps(c.id, c.name)) movable.push_back(c);
    }
    return CoverDeficit(movable, in.needed_bytes - free);
  }
  bool Keeps(const std::string& id, const std::string& name) const override {
    return keep_.count(name) > 0 || keep_.count(id) > 0;
  }

 private:
  int64_t reserve_;
  std::set<std::string> keep_;
};

class LruStrategy : public OffloadStrategy {
 public:
  std::string name() const override { return "lru"; }
  std::vector<std::string> BeforeRun(const StrategyInput& in) override {
    if (in.free_bytes >= in.needed_bytes) return {};
    std::vector<Candidate> order = in.resident;
    std::sort(order.begin(), order.end(), LessRecentlyUsed);
    std::vector<std::string> ids;
    int64_t free = in.free_bytes;
    for (const Candidate& c : order) {
      if (free >= in.needed_bytes) break;
      ids.push_back(c.id);
      free += c.bytes;
    }
    return ids;
  }
};

class TextEncodersOnlyStrategy : public OffloadStrategy {
 public:
  std::string name() const override { return "text-encoders-only"; }
  std::vector<std::string> BeforeRun(const StrategyInput& in) override {
    if (absl::StrContains(in.target.name, "text_encoder")) return {};
    std::vector<std::string> ids;
    for (const Candidate& c : in.resident) {
      if (absl::StrContains(c.name, "text_encoder")) ids.push_back(c.id);
    }
    return ids;
  }
};

class WorkflowStrategy : public OffloadStrategy {
 public:
  explicit WorkflowStrategy(std::vector<WorkflowRule> rules) : rules_(std::move(rules)) {
    for (const WorkflowRule& r : rules_) {
      if (r.kind == WorkflowRule::Kind::kKeepResident) kept_.insert(r.component);
    }
  }
  std::string name() const override { return "workflow"; }
  bool Keeps(const std::string& id, const std::string& name) const override {
    (void)id;
    return kept_.count(name) > 0;
  }
  std::vector<std::string> BeforeRun(const StrategyInput& in) override {
    return Apply(WorkflowRule::Kind::kBefore, in, /*include_target=*/false);
  }
  std::vector<std::string> AfterRun(const StrategyInput& in) override {
    return Apply(WorkflowRule::Kind::kAfter, in, /*include_target=*/true);
  }

 private:
  std::vector<std::string> Apply(WorkflowRule::Kind kind, const StrategyInput& in, bool include_target) {
    std::set<std::string> names;
    for (const WorkflowRule& r : rules_) {
      if (r.kind == kind && r.component == in.target.name) names.insert(r.offload.begin(), r.offload.end());
    }
    std::vector<std::string> ids;
    if (include_target && names.count(in.target.name) > 0 && !Keeps(in.target.id, in.target.name)) {
      ids.push_back(in.target.id);
    }
    for (const Candidate& c : in.resident) {
      if (names.count(c.name) > 0 && !Keeps(c.id, c.name)) ids.push_back(c.id);
    }
    return ids;
  }
  std::vector<WorkflowRule> rules_;
  std::set<std::string> kept_;
};

struct Registry {
  absl::Mutex mu;
  std::map<std::string, StrategyFactory> factories ABSL_GUARDED_BY(mu);
};

Registry& GetRegistry() {
  static Registry* registry = [] {
    auto* r = new Registry();
    absl::MutexLock lock(&r->mu);
    r->factories["text-encoders-only"] = [] { return std::make_unique<TextEncodersOnlyStrategy>(); };
    r->factories["lru"] = [] { return std::make_unique<LruStrategy>(); };
    return r;
  }();
  return *registry;
}

}  // namespace

std::unique_ptr<OffloadStrategy> MakeFootprintStrategy(int64_t reserve_bytes, std::vector<std::string> keep) {
  return std::make_unique<FootprintStrategy>(reserve_bytes, std::move(keep));
}

absl::StatusOr<std::unique_ptr<OffloadStrategy>> MakeWorkflowStrategy(
    std::vector<WorkflowRule> rules, const std::vector<std::string>& known) {
  const std::set<std::string> names(known.begin(), known.end());
  std::set<std::string> kept;
  for (const WorkflowRule& r : rules) {
    if (r.kind == WorkflowRule::Kind::kKeepResident) kept.insert(r.component);
  }
  auto check = [&](size_t i, const std::string& name) -> absl::Status {
    if (names.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("rules[", i, "]: unknown component '", Truncated(name),
                                                     "'; known: ", absl::StrJoin(names, ", ")));
    }
    return absl::OkStatus();
  };
  for (size_t i = 0; i < rules.size(); ++i) {
    const WorkflowRule& r = rules[i];
    if (absl::Status s = check(i, r.component); !s.ok()) return s;
    if (r.kind != WorkflowRule::Kind::kKeepResident && r.offload.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("rules[", i, "]: names no component to offload"));
    }
    for (const std::string& o : r.offload) {
      if (absl::Status s = check(i, o); !s.ok()) return s;
      if (kept.count(o) > 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rules[", i, "]: offloads '", o, "', which a keep_resident rule keeps"));
      }
      if (r.kind == WorkflowRule::Kind::kBefore && o == r.component) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rules[", i, "]: 'before ", o, "' cannot offload ", o, " itself"));
      }
    }
  }
  return std::unique_ptr<OffloadStrategy>(new WorkflowStrategy(std::move(rules)));
}

void RegisterCustomStrategy(const std::string& name, StrategyFactory factory) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  r.factories[name] = std::move(factory);
}

absl::StatusOr<std::unique_ptr<OffloadStrategy>> MakeCustomStrategy(const std::string& name) {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  auto it = r.factories.find(name);
  if (it == r.factories.end()) {
    std::vector<std::string> names;
    for (const auto& [n, f] : r.factories) names.push_back(n);
    return absl::NotFoundError(absl::StrCat("no custom strategy '", Truncated(name), "'; registered: ",
                                            absl::StrJoin(names, ", ")));
  }
  return it->second();
}

std::vector<std::string> CustomStrategyNames() {
  Registry& r = GetRegistry();
  absl::MutexLock lock(&r.mu);
  std::vector<std::string> names;
  for (const auto& [n, f] : r.factories) names.push_back(n);
  return names;
}

}  // namespace stowage
