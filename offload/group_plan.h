// Group planning: which tensors of a module tree form which offload group, how each group is laid
// out in device memory, and which groups a device budget keeps resident.
//
// Pure functions over the module structure and the tensors' sizes: no device, no host copies, no
// side effects on the modules, so every rule is unit-testable (tests/offload/group_plan_test.cc).
// The engine (offload/group_offload.h) applies the plan; the host stores (offload/host_store.h)
// fill a group's device layout from their host copies.
//
// Groups
//   block_level: every `num_blocks_per_group` consecutive children of each block list (the
//     ModuleLists nearest the root — its ModuleList children, or else those of the first level
//     down that has any, e.g. T5's encoder.block — or the modules named in `block_modules`) form a group,
//     used by the forwards of those blocks; every other tensor forms one always-on group
//     "(outside blocks)", on the device for the whole forward of the root.
//   leaf_level: every module owning tensors forms a group of its own tensors; a leaf's group is
//     streamed, a non-leaf's (parameter-only, e.g. a root-owned position table) is always-on for
//     its owner's forward.
//   Groups without tensors are dropped; a tensor belongs to exactly one group.
//
// Layout: a group's tensors are packed in module order (block_level: a module's subtree pre-order;
// the always-on group: input order), each at an offset aligned to kGroupAlign, except that in a block
// group the tensors a module declares adjacent (Module::AddAdjacentGroup: Q/K/V weights, their FP8
// scales) are packed one after another where that module comes, so that one GEMM reads them as one
// matrix as in a resident onload; the group's bytes are the packed size. This is the layout a device buffer (a ring slot or a
// resident group's own buffer) holds, in the tensors' compute dtype, whatever the host keeps.
//
// Budget (budget_bytes > 0): streamed groups go through a ring of `slots` buffers of slot_bytes
// each (the largest group left streaming). Among candidate slot sizes (0, or any group's size), the
// planner keeps resident the most bytes such that always-on + resident + slots * slot_bytes <=
// budget: groups larger than the slot must be resident, the others fill the remaining budget
// greedily, largest first; among equal sizes, spread along the forward (a low-discrepancy order
// of the group index), so that streaming the others overlaps resident compute.
//
// Store scratch: a host store may need a device scratch area besides the slot to copy a group (the
// compressed store lands 8-bit weights there before widening them into the slot). Each tensor says
// how much it needs (PlanTensor::scratch_bytes, and carried_scratch_bytes that count only in a group
// whose tensors need some of their own); a group needs the sum, and the store
// options.scratch_buffers areas as large as the largest group that is not resident (two let one
// group's widening overlap the next group's copy), plus a fixed part (options.fixed_scratch_bytes)
// when any needs some. It is part of the working set and of the budget arithmetic.
//
// Thread-safety: the functions are reentrant; a plan is a value.
//
//   std::vector<PlanTensor> tensors;  // One per tensor slot that may be offloaded, with its bytes.
//   ASSIGN_OR_RETURN(GroupPlan plan, PlanGroups("unet", root, tensors, options));
//   for (const PlannedGroup& g : plan.groups) { ... g.tensors[i].index, .offset ... }
#ifndef STOWAGE_OFFLOAD_GROUP_PLAN_H_
#define STOWAGE_OFFLOAD_GROUP_PLAN_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "offload/module.h"

namespace stowage {

enum class OffloadType { kBlockLevel, kLeafLevel };

// Alignment of every tensor within a group's layout.
inline constexpr int64_t kGroupAlign = 256;

// A tensor the planner may place: its slot in the module tree and its size on the device.
struct PlanTensor {
  const TensorSlot* slot = nullptr;
  int64_t bytes = 0;
  int64_t scratch_bytes = 0;  // In the store's device scratch when the group is copied.
  // Also in the scratch, but only in a group whose tensors need some of their own (scratch_bytes > 0):
  // the compressed store carries such a group's uncompressed tensors through its area beside the
  // compressed ones, and copies a group with nothing compressed straight into its slot.
  int64_t carried_scratch_bytes = 0;
};

struct PlannedTensor {
  int index = 0;       // Into the planner's input list.
  int64_t offset = 0;  // Within the group's layout; a multiple of kGroupAlign.
  int64_t bytes = 0;
};

struct PlannedGroup {
  std::string name;                    // "blocks.0-1", "(outside blocks)", "blocks.3.fc1", "(root)".
  std::vector<PlannedTensor> tensors;  // In layout order.
  std::vector<Module*> members;        // Modules whose forwards use the group.
  int64_t bytes = 0;                   // Packed size, each tensor aligned to kGroupAlign.
  int64_t own_scratch_bytes = 0;       // Its tensors' PlanTensor::scratch_bytes, aligned.
  int64_t carried_scratch_bytes = 0;   // Their carried_scratch_bytes, aligned.
  bool always_on = false;              // On the device for its owners' whole forward; never in the ring.
  bool resident = false;               // Kept on the device by the budget.
  bool streamed() const { return !always_on && !resident; }
  // Store scratch to copy it: its tensors' own, plus what they carry when that is > 0.
  int64_t scratch_bytes() const { return own_scratch_bytes > 0 ? own_scratch_bytes + carried_scratch_bytes : 0; }
};

struct GroupPlanOptions {
  OffloadType type = OffloadType::kBlockLevel;
  int num_blocks_per_group = 1;             // block_level, >= 1.
  std::vector<std::string> block_modules;   // block_level; empty: the ModuleLists nearest the root.
  int64_t budget_bytes = 0;                 // 0: stream every ring group.
  int64_t slots = 1;                        // Ring slots when any group streams (>= 1).
  int64_t fixed_scratch_bytes = 0;          // Store scratch needed once when any group needs some.
  int64_t scratch_buffers = 1;              // Areas of the largest group's scratch (>= 1).
};

struct GroupPlan {
  std::vector<PlannedGroup> groups;
  int streamed_groups = 0;
  int resident_groups = 0;
  int64_t slots = 0;       // 0 when nothing streams.
  int64_t slot_bytes = 0;  // The largest streamed group; 0 when nothing streams.
  int64_t always_on_bytes = 0;
  int64_t resident_bytes = 0;
  int64_t streamed_bytes = 0;
  int64_t scratch_bytes = 0;      // The store's device scratch (0 when no copied group needs any).
  int64_t working_set_bytes = 0;  // slots * slot_bytes + always_on_bytes + resident_bytes + scratch_bytes.
};

// Forms the groups of `root` (see the header comment); tensors whose slot is not in `tensors` are
// left out. `component` names the model in errors: INVALID_ARGUMENT for a block_modules entry that
// is not a proper submodule, or block_level without any block list. Residency is not chosen.
absl::StatusOr<std::vector<PlannedGroup>> FormGroups(const std::string& component, Module& root,
                                                     const std::vector<PlanTensor>& tensors,
                                                     const GroupPlanOptions& options);

// Chooses the resident groups for options.budget_bytes and sizes the ring. INVALID_ARGUMENT when the
// budget is smaller than the smallest working set (always-on + slots of the smallest group).
absl::StatusOr<GroupPlan> ChooseResidency(const std::string& component, std::vector<PlannedGroup> groups,
                                          const GroupPlanOptions& options);

// FormGroups, then ChooseResidency.
absl::StatusOr<GroupPlan> PlanGroups(const std::string& component, Module& root,
                                     const std::vector<PlanTensor>& tensors, const GroupPlanOptions& options);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_GROUP_PLAN_H_
