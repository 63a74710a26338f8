// Offload strategies: before a component runs (and after it ran), which resident components to
// move off the device. A strategy sees plain views, decides, and moves nothing itself; the
// PlacementManager carries decisions out and records them.
//
// Group-offloaded components are never candidates: they place themselves.
#ifndef STOWAGE_PLACEMENT_STRATEGY_H_
#define STOWAGE_PLACEMENT_STRATEGY_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace stowage {

// What a strategy knows of one component.
struct Candidate {
  std::string id;    // "<pipeline>/<component>"
  std::string name;  // "text_encoder"
  int64_t bytes = 0;
  absl::Time last_use;
};

struct StrategyInput {
  Candidate target;                 // The component about to run (or that just ran).
  int64_t needed_bytes = 0;         // Device bytes the target must add to run.
  int64_t free_bytes = 0;           // Device budget minus allocated bytes (INT64_MAX: no budget).
  std::vector<Candidate> resident;  // Movable residents, the target excluded.
};

class OffloadStrategy {
 public:
  virtual ~OffloadStrategy() = default;
  virtual std::string name() const = 0;
  // Ids of residents to move off before `input.target` runs.
  virtual std::vector<std::string> BeforeRun(const StrategyInput& input) = 0;
  // Ids of residents (the target included) to move off after it ran.
  virtual std::vector<std::string> AfterRun(const StrategyInput& input) {
    (void)input;
    return {};
  }
  // True for strategies that reason from whole-model footprints (they misjudge group-offloaded
  // components, which hold one group at a time): the manager warns when such a strategy manages one.
  virtual bool footprint_based() const { return false; }
  // True for a component the strategy keeps resident (footprint's keep_resident: by name or id;
  // workflow's keep_resident rules: by name): an out-of-memory recovery moves it only after moving
  // everything else did not suffice.
  virtual bool Keeps(const std::string& id, const std::string& name) const {
    (void)id, (void)name;
    return false;
  }
};

// Footprint: when free - reserve < needed, evict the fewest bytes that suffice: the smallest single
// resident that covers the deficit (least recently used among equals); otherwise largest first until
// covered, then drop any chosen one that is not needed. O(n log n); never subset enumeration.
// `keep`: component names or ids ("<pipeline>/<component>") never chosen (FootprintStrategy.keep_resident).
std::unique_ptr<OffloadStrategy> MakeFootprintStrategy(int64_t reserve_bytes, std::vector<std::string> keep = {});

// Declarative rules over component names.
struct WorkflowRule {
  enum class Kind { kAfter, kBefore, kKeepResident };
  Kind kind = Kind::kAfter;
  std::string component;             // after/before: the trigger; keep_resident: the kept one.
  std::vector<std::string> offload;  // after/before: components to move off.
};
// Fails with INVALID_ARGUMENT naming the rule when a component name is unknown (`known`), a rule
// offloads a kept component, or a before-rule offloads its own trigger.
absl::StatusOr<std::unique_ptr<OffloadStrategy>> MakeWorkflowStrategy(
    std::vector<WorkflowRule> rules, const std::vector<std::string>& known);

// Named strategies written in C++: "text-encoders-only" (before any other component runs, move
// every resident text encoder off — the upstream demo's strategy) and "lru" (when short of memory,
// evict least recently used first until the deficit is covered).
using StrategyFactory = std::function<std::unique_ptr<OffloadStrategy>()>;
void RegisterCustomStrategy(const std::string& name, StrategyFactory factory);
absl::StatusOr<std::unique_ptr<OffloadStrategy>> MakeCustomStrategy(const std::string& name);
std::vector<std::string> CustomStrategyNames();

}  // namespace stowage

#endif  // STOWAGE_PLACEMENT_STRATEGY_H_
