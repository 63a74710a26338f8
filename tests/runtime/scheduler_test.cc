// The scheduler's choices on their own: priorities (strict and weighted), fair shares between
// tenants (weights, floods, no credit saved while idle unless a bounded burst credit is set) and residency reordering bounded by
// max_reorder_delay.
#include "runtime/scheduler.h"

#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace stowage {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1700000000);

ScheduleEntry Entry(int priority, const std::string& tenant, const std::string& pipeline = "p", int age_ms = 0) {
  ScheduleEntry e;
  e.enqueued = kT0 - absl::Milliseconds(age_ms);
  e.priority = priority;
  e.tenant = tenant;
  e.pipeline = pipeline;
  return e;
}

// A queue the test drives: Pick, charge, remove the chosen entry.
class Queue {
 public:
  explicit Queue(SchedulerOptions options) : scheduler_(std::move(options)) {}
  void Add(ScheduleEntry e) { entries_.push_back(std::move(e)); }
  size_t size() const { return entries_.size(); }
  // Keeps `n` requests like `e` (same priority and tenant) waiting: the flow stays backlogged.
  void KeepWaiting(const ScheduleEntry& e, size_t n) {
    size_t have = 0;
    for (const ScheduleEntry& w : entries_) have += w.priority == e.priority && w.tenant == e.tenant;
    for (; have < n; ++have) Add(e);
  }
  ScheduleEntry Next(absl::Time now = kT0, std::string* reason = nullptr,
                     const std::map<std::string, int64_t>& resident_cost = {}) {
    std::vector<const ScheduleEntry*> view;
    for (const ScheduleEntry& e : entries_) view.push_back(&e);
    auto cost = [&](const std::string& p) -> int64_t {
      ++cost_calls_[p];
      auto it = resident_cost.find(p);
      return it == resident_cost.end() ? 0 : it->second;
    };
    const ScheduleChoice choice = scheduler_.Pick(view, cost, now);
    EXPECT_LT(choice.index, entries_.size());
    ScheduleEntry chosen = entries_[choice.index];
    entries_.erase(entries_.begin() + static_cast<long>(choice.index));
    scheduler_.Charge(chosen);
    if (reason != nullptr) *reason = choice.reason;
    return chosen;
  }
  std::map<std::string, int> cost_calls_;

 private:
  Scheduler scheduler_;
  std::vector<ScheduleEntry> entries_;
};

TEST(SchedulerTest, StrictPriorityRunsTheHighestFirstWhateverTheArrivalOrder) {
  Queue q{SchedulerOptions{}};
  q.Add(Entry(0, "", "low-1"));
  q.Add(Entry(3, "", "high"));
  q.Add(Entry(0, "", "low-2"));
  q.Add(Entry(1, "", "mid"));
  EXPECT_EQ(q.Next().pipeline, "high");
  EXPECT_EQ(q.Next().pipeline, "mid");
  EXPECT_EQ(q.Next().pipeline, "low-1");
  EXPECT_EQ(q.Next().pipeline, "low-2");
}

TEST(SchedulerTest, WeightedPrioritiesShareInProportionToPriorityPlusOne) {
  SchedulerOptions options;
  options.priority_mode = PriorityMode::kWeighted;
  Queue q(options);
  // Both levels always have work waiting: level 2 gets 3 of every 4 picks, level 0 one.
  std::map<int, int> served;
  for (int i = 0; i < 400; ++i) {
    q.KeepWaiting(Entry(0, ""), 2);
    q.KeepWaiting(Entry(2, ""), 2);
    ++served[q.Next().priority];
  }
  EXPECT_NEAR(served[2], 300, 2);
  EXPECT_NEAR(served[0], 100, 2);
}

TEST(SchedulerTest, AFloodingTenantGetsItsShareAndNoMore) {
  Queue q{SchedulerOptions{}};
  for (int i = 0; i < 20; ++i) q.Add(Entry(0, "flood"));
  q.Add(Entry(0, "quiet"));
  q.Add(Entry(0, "quiet"));
  // The quiet tenant's requests, queued behind twenty, run second and fourth.
  std::vector<std::string> order;
  for (int i = 0; i < 5; ++i) order.push_back(q.Next().tenant);
  EXPECT_EQ(order, (std::vector<std::string>{"flood", "quiet", "flood", "quiet", "flood"}));
}

TEST(SchedulerTest, TenantWeightsSetTheShares) {
  SchedulerOptions options;
  options.tenant_weights = {{"gold", 3.0}};
  Queue q(options);
  std::map<std::string, int> served;
  for (int i = 0; i < 400; ++i) {
    q.KeepWaiting(Entry(0, "gold"), 2);
    q.KeepWaiting(Entry(0, "basic"), 2);
    ++served[q.Next().tenant];
  }
  EXPECT_NEAR(served["gold"], 300, 2);
  EXPECT_NEAR(served["basic"], 100, 2);
}

TEST(SchedulerTest, WorkCountsNotRequests) {
  Queue q{SchedulerOptions{}};
  // "big" brings requests of 4 units, "small" of 1: per unit of work they alternate.
  std::map<std::string, double> work;
  for (int i = 0; i < 200; ++i) {
    ScheduleEntry big = Entry(0, "big");
    big.cost = 4;
    q.KeepWaiting(big, 2);
    q.KeepWaiting(Entry(0, "small"), 2);
    const ScheduleEntry e = q.Next();
    work[e.tenant] += e.cost;
  }
  EXPECT_NEAR(work["big"] / work["small"], 1.0, 0.1);
}

TEST(SchedulerTest, ATenantThatWasIdleSavesNoCredit) {
  Queue q{SchedulerOptions{}};
  // "a" alone for 50 requests, then "b" arrives with a backlog: they alternate from there; "b"
  // does not get 50 in a row for the time it was away.
  for (int i = 0; i < 50; ++i) {
    q.Add(Entry(0, "a"));
    EXPECT_EQ(q.Next().tenant, "a");
  }
  for (int i = 0; i < 6; ++i) {
    q.Add(Entry(0, "a"));
    q.Add(Entry(0, "b"));
  }
  std::map<std::string, int> first_six;
  for (int i = 0; i < 6; ++i) ++first_six[q.Next().tenant];
  EXPECT_EQ(first_six["a"], 3);
  EXPECT_EQ(first_six["b"], 3);
}

// With a burst credit, a tenant returning from idle runs up to that much work back to back ahead
// of a flooding one — and no more, however long it was away; then they alternate again.
TEST(SchedulerTest, AReturningTenantsBurstRunsAheadUpToItsCreditAndNoFurther) {
  SchedulerOptions options;
  options.tenant_burst = 3;  // Three requests of cost 1.
  Queue q(options);
  for (int i = 0; i < 50; ++i) {
    q.KeepWaiting(Entry(0, "flood"), 4);
    EXPECT_EQ(q.Next().tenant, "flood");
  }
  for (int i = 0; i < 6; ++i) q.Add(Entry(0, "light"));
  std::vector<std::string> order;
  for (int i = 0; i < 9; ++i) {
    q.KeepWaiting(Entry(0, "flood"), 4);
    order.push_back(q.Next().tenant);
  }
  // It starts its credit (3) behind the virtual time of the last request served, one request's work
  // behind the flood's: four in a row, then alternating.
  EXPECT_EQ(order, (std::vector<std::string>{"light", "light", "light", "light", "flood", "light", "flood",
                                             "light", "flood"}));
  // The credit is work at the tenant's weight, as its share is: at weight 2 each request advances it
  // half as far, so (3 / 2 + 1) of virtual time is five requests.
  SchedulerOptions weighted = options;
  weighted.tenant_weights = {{"light", 2.0}};
  Queue w(weighted);
  for (int i = 0; i < 50; ++i) {
    w.KeepWaiting(Entry(0, "flood"), 4);
    w.Next();
  }
  for (int i = 0; i < 12; ++i) w.Add(Entry(0, "light"));
  int run = 0;
  for (;; ++run) {
    w.KeepWaiting(Entry(0, "flood"), 4);
    if (w.Next().tenant != "light") break;
  }
  EXPECT_EQ(run, 5);
}

// Credits never add up: a tenant returning after another one was served on its credit starts from
// the same mark (the flood's), not from the one served behind it.
TEST(SchedulerTest, BurstCreditsOfTenantsReturningOneAfterAnotherDoNotAddUp) {
  SchedulerOptions options;
  options.tenant_burst = 2;
  Queue q(options);
  for (int i = 0; i < 50; ++i) {
    q.KeepWaiting(Entry(0, "flood"), 4);
    q.Next();
  }
  for (int i = 0; i < 10; ++i) q.Add(Entry(0, "one"));
  q.KeepWaiting(Entry(0, "flood"), 4);
  EXPECT_EQ(q.Next().tenant, "one");  // From 49 - 2 = 47 (the flood is at 50).
  for (int i = 0; i < 10; ++i) q.Add(Entry(0, "two"));
  int ahead = 0;
  for (;; ++ahead) {
    q.KeepWaiting(Entry(0, "flood"), 4);
    if (q.Next().tenant == "flood") break;
  }
  // "one" at 48 runs twice more, "two" from 47 three times: 5. Measured from "one"'s 47 instead,
  // "two" would start at 45 and run five.
  EXPECT_EQ(ahead, 5);
}

TEST(SchedulerTest, AResidentPipelineGoesFirstWithinTheReorderDelayAndTheDecisionSaysWhy) {
  SchedulerOptions options;
  options.max_reorder_delay = absl::Milliseconds(500);
  Queue q(options);
  q.Add(Entry(0, "", "cold", /*age_ms=*/100));
  q.Add(Entry(0, "", "hot", /*age_ms=*/50));
  q.Add(Entry(0, "", "hot", /*age_ms=*/10));
  const std::map<std::string, int64_t> cost = {{"cold", int64_t{12} << 30}, {"hot", 0}};
  std::string reason;
  EXPECT_EQ(q.Next(kT0, &reason, cost).pipeline, "hot");
  EXPECT_NE(reason.find("ran before an older request of pipeline 'cold' (12288 MiB to move; waited 100ms of "
                        "max_reorder_delay 500ms): pipeline 'hot' moves 0 bytes"),
            std::string::npos)
      << reason;
  EXPECT_EQ(q.cost_calls_["cold"], 1);  // Once per distinct pipeline and pick.
  EXPECT_EQ(q.cost_calls_["hot"], 1);
  EXPECT_EQ(q.Next(kT0, &reason, cost).pipeline, "hot");
  // Only the cold one is left.
  EXPECT_EQ(q.Next(kT0, &reason, cost).pipeline, "cold");
  EXPECT_EQ(reason, "");
}

TEST(SchedulerTest, NoRequestIsPassedOverOnceItWaitedTheReorderDelay) {
  SchedulerOptions options;
  options.max_reorder_delay = absl::Milliseconds(500);
  Queue q(options);
  q.Add(Entry(0, "", "cold", /*age_ms=*/500));
  q.Add(Entry(0, "", "hot", /*age_ms=*/10));
  std::string reason = "unset";
  EXPECT_EQ(q.Next(kT0, &reason, {{"cold", 1000}}).pipeline, "cold");
  EXPECT_EQ(reason, "");
}

TEST(SchedulerTest, WithoutAReorderDelayItIsFirstComeFirstServedAndAsksNoCosts) {
  Queue q{SchedulerOptions{}};
  q.Add(Entry(0, "", "cold"));
  q.Add(Entry(0, "", "hot"));
  EXPECT_EQ(q.Next(kT0, nullptr, {{"cold", 1000}}).pipeline, "cold");
  EXPECT_TRUE(q.cost_calls_.empty());
}

TEST(SchedulerTest, ResidencyNeverCrossesPriorityOrTenant) {
  SchedulerOptions options;
  options.max_reorder_delay = absl::Seconds(10);
  Queue q(options);
  q.Add(Entry(1, "a", "cold"));
  q.Add(Entry(0, "a", "hot"));  // Resident, but a lower priority.
  EXPECT_EQ(q.Next(kT0, nullptr, {{"cold", 1000}}).pipeline, "cold");
}

// A request whose pipeline is on the device may run before another tenant's older one whose turn it
// was (the same priority), within the reorder delay; the decision names both tenants. Once that
// tenant's request has waited the delay it runs, and it kept its place in the fair order.
TEST(SchedulerTest, ResidencyCrossesTenantsWithinTheDelay) {
  SchedulerOptions options;
  options.max_reorder_delay = absl::Milliseconds(500);
  Queue q(options);
  q.Add(Entry(0, "alice", "cold", /*age_ms=*/100));
  q.Add(Entry(0, "bob", "hot", /*age_ms=*/10));
  q.Add(Entry(0, "bob", "hot", /*age_ms=*/5));
  const std::map<std::string, int64_t> cost = {{"cold", int64_t{1} << 30}, {"hot", 0}};
  std::string reason;
  EXPECT_EQ(q.Next(kT0, &reason, cost).tenant, "bob");
  EXPECT_NE(reason.find("tenant 'bob' ahead of tenant 'alice', whose turn it was"), std::string::npos) << reason;
  // Alice has now waited past the delay: she goes, though bob's second request is still resident.
  EXPECT_EQ(q.Next(kT0 + absl::Milliseconds(450), &reason, cost).tenant, "alice");
  EXPECT_EQ(reason, "");
}

TEST(SchedulerTest, ManyTenantsEachGetTheirRequestRun) {
  Queue q{SchedulerOptions{}};
  for (int i = 0; i < 20000; ++i) {
    q.Add(Entry(0, "tenant-" + std::to_string(i)));
    q.Add(Entry(0, "steady"));
    q.Next();
    q.Next();
  }
  EXPECT_EQ(q.size(), 0u);
}

TEST(SchedulerTest, ClientChosenTenantNamesDoNotGrowItsMemory) {
  Scheduler scheduler{SchedulerOptions{}};
  for (int i = 0; i < 20000; ++i) {
    ScheduleEntry a = Entry(0, "tenant-" + std::to_string(i));
    ScheduleEntry b = Entry(0, "steady");
    scheduler.Pick({&a, &b}, nullptr, kT0);
    scheduler.Charge(a);
  }
  EXPECT_LE(scheduler.remembered_flows(), 4096u + 2);
}


// Preemption between steps: off by default; a higher priority preempts under kPriority and
// kResident; a request of the same priority only under kResident, when its pipeline moves nothing,
// its run is shorter than what the running request has left (by the expected seconds when both are
// known, else by work), and the running request was paused less than max_reorder_delay in all.
TEST(SchedulerTest, PreemptionTakesAHigherPriorityOrAShortResidentRequestWithinTheBound) {
  ScheduleEntry running = Entry(0, "a", "flux");
  running.cost = 8;
  ScheduleEntry urgent = Entry(1, "b", "flux");
  urgent.cost = 8;
  ScheduleEntry hot = Entry(0, "b", "zimage");
  hot.cost = 2;
  const auto make = [&](const ScheduleEntry& r, double remaining, absl::Duration paused, const ScheduleEntry& c,
                        int64_t move) {
    Scheduler::PreemptionCase q;
    q.running = &r;
    q.remaining_cost = remaining;
    q.paused = paused;
    q.candidate = &c;
    q.candidate_move_bytes = move;
    return q;
  };
  std::string reason;

  SchedulerOptions options;
  options.max_reorder_delay = absl::Seconds(2);
  EXPECT_FALSE(Scheduler(options).Preempts(make(running, 8, absl::ZeroDuration(), urgent, 0), &reason));  // kNone.

  options.preemption = Preemption::kPriority;
  Scheduler priority(options);
  EXPECT_TRUE(priority.Preempts(make(running, 1, absl::Seconds(100), urgent, int64_t{1} << 30), &reason));
  EXPECT_EQ(reason,
            "priority 1 preempts the running request of pipeline 'flux' (priority 0) between its denoising steps");
  EXPECT_FALSE(priority.Preempts(make(running, 8, absl::ZeroDuration(), hot, 0), &reason));    // Same priority.
  EXPECT_FALSE(priority.Preempts(make(urgent, 8, absl::ZeroDuration(), running, 0), &reason));  // Lower.

  options.preemption = Preemption::kResident;
  Scheduler resident(options);
  reason.clear();
  EXPECT_TRUE(resident.Preempts(make(running, 6, absl::Milliseconds(500), hot, 0), &reason));
  EXPECT_EQ(reason,
            "pipeline 'zimage' moves nothing and its work (2) is less than the running request of pipeline 'flux' "
            "has left (6; paused 500ms so far of max_reorder_delay 2s)");
  EXPECT_TRUE(resident.Preempts(make(running, 1, absl::ZeroDuration(), urgent, 0), &reason));  // Priority still.
  EXPECT_FALSE(resident.Preempts(make(running, 6, absl::Milliseconds(500), hot, 1), &reason));  // Moves a byte.
  EXPECT_FALSE(resident.Preempts(make(running, 2, absl::Milliseconds(500), hot, 0), &reason));  // Not shorter.
  EXPECT_FALSE(resident.Preempts(make(running, 6, absl::Seconds(2), hot, 0), &reason));  // Paused the bound.
  ScheduleEntry high_running = running;
  high_running.priority = 3;
  EXPECT_FALSE(resident.Preempts(make(high_running, 6, absl::ZeroDuration(), hot, 0), &reason));  // Lower priority.

  // With both expected times known, time decides: more work but a shorter run preempts, less work
  // but a longer run does not; one unknown and work decides again.
  ScheduleEntry big_hot = hot;
  big_hot.cost = 8;
  Scheduler::PreemptionCase timed = make(running, 4, absl::ZeroDuration(), big_hot, 0);
  timed.remaining_seconds = 0.9;
  timed.candidate_seconds = 0.8;
  reason.clear();
  EXPECT_TRUE(resident.Preempts(timed, &reason));
  EXPECT_EQ(reason,
            "pipeline 'zimage' moves nothing and its run (0.800 s expected) is shorter than the running request of "
            "pipeline 'flux' has left (0.900 s; paused 0 so far of max_reorder_delay 2s)");
  Scheduler::PreemptionCase slower = make(running, 6, absl::ZeroDuration(), hot, 0);
  slower.remaining_seconds = 0.5;
  slower.candidate_seconds = 0.6;
  EXPECT_FALSE(resident.Preempts(slower, &reason));
  slower.remaining_seconds = 0;  // Unknown: by work (2 < 6).
  EXPECT_TRUE(resident.Preempts(slower, &reason));
}

// A running request with a deadline is paused only when the expected times say it still ends
// before it; unknown times pause nothing — priority or residency alike.
TEST(SchedulerTest, PreemptionNeverPausesARequestPastItsDeadline) {
  SchedulerOptions options;
  options.max_reorder_delay = absl::Seconds(2);
  options.preemption = Preemption::kResident;
  Scheduler scheduler(options);
  ScheduleEntry running = Entry(0, "a", "flux");
  running.cost = 8;
  running.deadline = kT0 + absl::Seconds(2);
  ScheduleEntry urgent = Entry(5, "b", "flux");
  ScheduleEntry hot = Entry(0, "b", "zimage");
  hot.cost = 1;
  for (const ScheduleEntry* candidate : {&urgent, &hot}) {
    Scheduler::PreemptionCase c;
    c.running = &running;
    c.remaining_cost = 6;
    c.candidate = candidate;
    c.now = kT0;
    std::string reason;
    EXPECT_FALSE(scheduler.Preempts(c, &reason)) << "times unknown";
    c.remaining_seconds = 1.2;
    c.candidate_seconds = 0.7;
    EXPECT_TRUE(scheduler.Preempts(c, &reason)) << "ends at 1.9 s, before its deadline";
    c.candidate_seconds = 0.8;
    EXPECT_FALSE(scheduler.Preempts(c, &reason)) << "would end at its deadline";
  }
}

}  // namespace
}  // namespace stowage
