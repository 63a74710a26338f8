// Scheduler: which waiting request a device's worker runs next.
//
// FIFO per device makes a mixed stream of requests move weights on almost every request; the
// scheduler chooses knowing priorities, tenants and what is on the device:
//
//   1. Priority (GenerateRequest.priority, 0..kMaxPriority, higher first). kStrict: the highest
//      priority waiting always goes first. kWeighted: every priority level waiting gets a share of
//      the device in proportion to (priority + 1), so low priorities slow down under load but never
//      stop.
//   2. Tenant, within the chosen priority: fair queueing by work. Each tenant's served work
//      (request cost / tenant weight) is its virtual time; the waiting tenant with the least goes
//      next, so a tenant flooding the queue gets its share and no more. A tenant that had nothing
//      waiting starts at the virtual time of the last request served less its burst credit
//      (tenant_burst / weight, bounded however long it was idle), so a light tenant's burst runs
//      back to back instead of interleaved with a flood.
//   3. Residency, within the chosen priority: the tenant's oldest request runs unless a request of
//      the same priority (of any tenant) would move fewer bytes onto the device (its pipeline's
//      weights are there) and the tenant's oldest has waited less than max_reorder_delay; then the
//      one moving the fewest bytes goes (the oldest of those). The tenant passed over keeps its
//      place in the fair order (the one served is charged), and no request is passed over for
//      residency once it has waited max_reorder_delay: residency costs any request at most that.
//   4. Preemption (off by default): between two denoising steps of the running request, the
//      request Pick would choose next runs first when it has a higher priority, or (kResident) the
//      same priority, nothing to move and a shorter run than the running request has left (by the
//      device's recent run times of both pipelines; by work while either is unknown), while the
//      running request has been paused less than max_reorder_delay in all; never past the running
//      request's deadline (by the expected times). The paused request goes on from its step
//      afterwards; one preempting request is never itself preempted.
//
// The device worker asks it under its queue lock (DeviceWorker::Options::scheduler); this class
// holds no lock of its own. Thread-safety: not thread-safe; one owner serialises calls.
#ifndef STOWAGE_RUNTIME_SCHEDULER_H_
#define STOWAGE_RUNTIME_SCHEDULER_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "absl/time/time.h"

namespace stowage {

inline constexpr int kMaxPriority = 9;

enum class PriorityMode { kStrict, kWeighted };

// Which waiting request may run between the denoising steps of the running one (SchedulerConfig.preemption).
enum class Preemption { kNone, kPriority, kResident };

struct SchedulerOptions {
  // How long a request may be passed over by younger ones whose pipelines need fewer bytes moved.
  // Zero: first come, first served within a tenant and priority.
  absl::Duration max_reorder_delay = absl::ZeroDuration();
  PriorityMode priority_mode = PriorityMode::kStrict;
  // Tenants' shares; a tenant not listed (and the default tenant "") has weight 1.
  std::map<std::string, double> tenant_weights;
  // Work a tenant returning from idle may run ahead of the others (SchedulerConfig.tenant_burst_work).
  double tenant_burst = 0;
  Preemption preemption = Preemption::kNone;
};

// What the scheduler knows of one waiting request.
struct ScheduleEntry {
  absl::Time enqueued;
  int priority = 0;      // 0..kMaxPriority.
  std::string tenant;    // "" is the default tenant.
  std::string pipeline;  // What it runs: its move cost decides reordering.
  double cost = 1;       // Its work (e.g. steps x megapixels), charged to its tenant when it runs.
  // When its caller gives up (a gRPC deadline); preemption never pauses it past this.
  absl::Time deadline = absl::InfiniteFuture();
};

struct ScheduleChoice {
  size_t index = 0;    // Into the entries given to Pick.
  // Why a request other than the oldest of its tenant and priority was chosen for residency, for
  // the decision log; "" otherwise.
  std::string reason;
};

class Scheduler {
 public:
  explicit Scheduler(SchedulerOptions options) : options_(std::move(options)) {}

  const SchedulerOptions& options() const { return options_; }

  // The request to run next among `entries` (non-empty; in arrival order). `move_bytes(pipeline)`
  // is the number of bytes running that pipeline now would move onto the device (0 when its
  // weights are there); called only when reordering is on, at most once per distinct pipeline.
  ScheduleChoice Pick(const std::vector<const ScheduleEntry*>& entries,
                      const std::function<int64_t(const std::string&)>& move_bytes, absl::Time now);

  // Whether `candidate` (the request Pick would run next) runs now, between two denoising steps of
  // `running` (a batch's first member). Sets `reason` (for the decision log) when it does.
  struct PreemptionCase {
    const ScheduleEntry* running = nullptr;
    double remaining_cost = 0;       // The running request's work left (a batch's in all).
    absl::Duration paused;           // How long it has been paused so far.
    const ScheduleEntry* candidate = nullptr;
    int64_t candidate_move_bytes = 0;  // What running the candidate's pipeline now would move.
    // Expected seconds of the running request's rest and of the candidate's run, from the device's
    // recent runs of their pipelines (DeviceWorker); <= 0 when unknown: then their work decides
    // which is shorter.
    double remaining_seconds = 0;
    double candidate_seconds = 0;
    // A running request with a deadline is preempted only when both expected times are known and
    // it still ends before its deadline after the candidate's run: now + both < deadline.
    absl::Time now;
  };
  bool Preempts(const PreemptionCase& c, std::string* reason) const;

  // Charges a request that ran (each member of a batch) to its priority level and tenant.
  void Charge(const ScheduleEntry& entry);

  // How many (priority, tenant) flows it remembers (bounded; for tests).
  size_t remembered_flows() const { return tenant_time_.size(); }

 private:
  double TenantWeight(const std::string& tenant) const;
  // Lifts flows that were not waiting at the previous Pick to the last served virtual time.
  void LiftNewcomers(const std::vector<const ScheduleEntry*>& entries);

  SchedulerOptions options_;
  // Work served per priority level (weighted mode) and per (priority, tenant), normalised by weight.
  std::map<int, double> level_time_;
  std::map<std::pair<int, std::string>, double> tenant_time_;
  // The flows waiting at the previous Pick, and the virtual times of the last charge.
  std::map<int, bool> levels_waiting_;
  std::map<std::pair<int, std::string>, bool> tenants_waiting_;
  double last_level_time_ = 0;
  std::map<int, double> last_tenant_time_;  // Per priority level.
};

}  // namespace stowage

#endif  // STOWAGE_RUNTIME_SCHEDULER_H_
