#include "offload/group_plan.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

// How deep below the root the default block lists are looked for.
constexpr int kMaxBlockListDepth = 8;

int64_t AlignUp(int64_t n) { return (n + kGroupAlign - 1) / kGroupAlign * kGroupAlign; }

void Append(PlannedGroup& g, int index, const PlanTensor& t) {
  g.tensors.push_back(PlannedTensor{index, g.bytes, t.bytes});
  g.bytes += AlignUp(t.bytes);
  g.own_scratch_bytes += AlignUp(t.scratch_bytes);
  g.carried_scratch_bytes += AlignUp(t.carried_scratch_bytes);
}

// The store's scratch when the groups with `streams(g)` true are not resident: `buffers` areas of
// the largest of theirs, plus the fixed part when any needs scratch.
template <typename Pred>
int64_t ScratchFor(const std::vector<PlannedGroup*>& candidates, const GroupPlanOptions& options, Pred streams) {
  int64_t largest = 0;
  for (const PlannedGroup* g : candidates) {
    if (streams(*g)) largest = std::max(largest, g->scratch_bytes());
  }
  return largest > 0 ? std::max<int64_t>(1, options.scratch_buffers) * largest + options.fixed_scratch_bytes : 0;
}

// In a group with tensors that need scratch of their own (a compressed store's compressed weights),
// those first and the other tensors after them, each part in its order (so tensors declared adjacent
// stay side by side: such a declaration names weights, or their scales, never both): the store then
// carries the others as one contiguous run (one copy into the slot, not one per tensor). A group
// holding a tensor of `mixed` (a declaration naming both kinds; none does today) keeps module order.
void CompressedFirst(PlannedGroup& g, const std::vector<PlanTensor>& tensors, const std::set<int>& mixed) {
  const auto own = [&](const PlannedTensor& t) { return tensors[static_cast<size_t>(t.index)].scratch_bytes > 0; };
  if (std::none_of(g.tensors.begin(), g.tensors.end(), own) || std::all_of(g.tensors.begin(), g.tensors.end(), own) ||
      std::any_of(g.tensors.begin(), g.tensors.end(), [&](const PlannedTensor& t) { return mixed.count(t.index) > 0; })) {
    return;
  }
  std::stable_partition(g.tensors.begin(), g.tensors.end(), own);
  int64_t offset = 0;
  for (PlannedTensor& t : g.tensors) {
    t.offset = offset;
    offset += AlignUp(t.bytes);
  }
}

// The tensors (indices into `tensors`) of adjacency declarations under `root` that name both tensors
// with scratch of their own and tensors without.
std::set<int> InMixedDeclarations(Module& root, const std::vector<PlanTensor>& tensors) {
  std::map<const TensorSlot*, int> index_of;
  for (size_t i = 0; i < tensors.size(); ++i) index_of[tensors[i].slot] = static_cast<int>(i);
  std::set<int> mixed;
  root.ForEachModule([&](Module& owner) {
    for (const auto& adjacent : owner.adjacent_groups()) {
      std::vector<int> members;
      bool with = false, without = false;
      for (const auto& [m, slot] : adjacent) {
        if (slot < 0 || static_cast<size_t>(slot) >= m->slots().size()) continue;
        const auto it = index_of.find(&m->slots()[static_cast<size_t>(slot)]);
        if (it == index_of.end()) continue;
        members.push_back(it->second);
        (tensors[static_cast<size_t>(it->second)].scratch_bytes > 0 ? with : without) = true;
      }
      if (with && without) mixed.insert(members.begin(), members.end());
    }
  });
  return mixed;
}

}  // namespace

absl::StatusOr<std::vector<PlannedGroup>> FormGroups(const std::string& component, Module& root,
                                                     const std::vector<PlanTensor>& tensors,
                                                     const GroupPlanOptions& options) {
  std::map<const TensorSlot*, int> unplaced;  // Tensors not in a group yet, by slot.
  for (size_t i = 0; i < tensors.size(); ++i) unplaced[tensors[i].slot] = static_cast<int>(i);
  auto add_tensors = [&](PlannedGroup& g, Module& m, bool subtree) {
    auto take = [&](Module& owner) {
      if (subtree) {
        // Tensors the owner declares adjacent (Q/K/V weights, their FP8 scales) one after another,
        // where the owner is visited (before its children), so that a group's slot holds them side by
        // side as a resident onload does and one GEMM reads them as one matrix. Only when every one is
        // still unplaced and lies in the owner's subtree (a layout hint: never across groups).
        std::set<const Module*> below;
        if (!owner.adjacent_groups().empty()) owner.ForEachModule([&](Module& d) { below.insert(&d); });
        for (const auto& adjacent : owner.adjacent_groups()) {
          const bool all_here = std::all_of(adjacent.begin(), adjacent.end(), [&](const auto& member) {
            return below.count(member.first) > 0 && member.second >= 0 &&
                   static_cast<size_t>(member.second) < member.first->slots().size() &&
                   unplaced.count(&member.first->slots()[static_cast<size_t>(member.second)]) > 0;
          });
          if (!all_here) continue;
          for (const auto& [member, index] : adjacent) {
            auto it = unplaced.find(&member->slots()[static_cast<size_t>(index)]);
            Append(g, it->second, tensors[static_cast<size_t>(it->second)]);
            unplaced.erase(it);
          }
        }
      }
      for (const TensorSlot& slot : owner.slots()) {
        auto it = unplaced.find(&slot);
        if (it == unplaced.end()) continue;
        Append(g, it->second, tensors[static_cast<size_t>(it->second)]);
        unplaced.erase(it);
      }
    };
    if (subtree) {
      m.ForEachModule(take);
    } else {
      take(m);
    }
  };

  std::vector<PlannedGroup> groups;
  if (options.type == OffloadType::kBlockLevel) {
    std::vector<Module*> lists;
    if (options.block_modules.empty()) {
      // The block lists nearest the root: its ModuleList children, or else those of the first
      // level down that has any (T5's encoder.block, CLIP's text_model.encoder.layers).
      std::vector<Module*> level = {&root};
      for (int depth = 0; depth < kMaxBlockListDepth && lists.empty() && !level.empty(); ++depth) {
        std::vector<Module*> next;
        for (Module* m : level) {
          for (auto& [name, child] : m->children()) {
            (child->kind() == "ModuleList" ? lists : next).push_back(child);
          }
        }
        level = std::move(next);
      }
    } else {
      for (const std::string& path : options.block_modules) {
        Module* found = nullptr;
        root.ForEachModule([&](Module& m) {
          if (m.path() == path) found = &m;
        });
        if (found == nullptr || found == &root) {
          return absl::InvalidArgumentError(absl::StrCat(
              "component '", component, "': block_modules entry '", path, "' is not a submodule"));
        }
        lists.push_back(found);
      }
    }
    if (lists.empty()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "component '", component, "': block_level found no block list (no ModuleList within ",
          kMaxBlockListDepth, " levels of the root); name one with block_modules, or use leaf_level"));
    }
    const auto per_group = static_cast<size_t>(std::max(1, options.num_blocks_per_group));
    for (Module* list : lists) {
      const auto& blocks = list->children();
      for (size_t i = 0; i < blocks.size(); i += per_group) {
        PlannedGroup g;
        const size_t end = std::min(blocks.size(), i + per_group);
        g.name = absl::StrCat(list->path(), ".", i, "-", end - 1);
        for (size_t b = i; b < end; ++b) {
          add_tensors(g, *blocks[b].second, /*subtree=*/true);
          g.members.push_back(blocks[b].second);
        }
        if (g.bytes > 0) groups.push_back(std::move(g));
      }
    }
    // Everything outside the blocks, in input order: on the device for the whole forward of the root.
    PlannedGroup rest;
    rest.name = "(outside blocks)";
    rest.always_on = true;
    rest.members.push_back(&root);
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (unplaced.count(tensors[i].slot) == 0) continue;
      Append(rest, static_cast<int>(i), tensors[i]);
    }
    if (rest.bytes > 0) groups.push_back(std::move(rest));
  } else {
    root.ForEachModule([&](Module& m) {
      PlannedGroup g;
      g.name = m.path().empty() ? "(root)" : m.path();
      g.always_on = !m.is_leaf();
      g.members.push_back(&m);
      add_tensors(g, m, /*subtree=*/false);
      if (g.bytes > 0) groups.push_back(std::move(g));
    });
  }
  const std::set<int> mixed = InMixedDeclarations(root, tensors);
  for (PlannedGroup& g : groups) CompressedFirst(g, tensors, mixed);
  return groups;
}

absl::StatusOr<GroupPlan> ChooseResidency(const std::string& component, std::vector<PlannedGroup> groups,
                                          const GroupPlanOptions& options) {
  GroupPlan plan;
  plan.groups = std::move(groups);
  const int64_t n = options.slots;
  int64_t always_on = 0;
  std::vector<PlannedGroup*> ring;
  std::vector<PlannedGroup*> all;
  // Largest first. Among equal sizes, a low-discrepancy order of the group index, so that the
  // groups the budget keeps resident are spread along the forward: streaming the others then
  // overlaps the resident groups' compute instead of queueing behind one long resident stretch.
  std::map<const PlannedGroup*, double> spread;
  for (size_t i = 0; i < plan.groups.size(); ++i) {
    PlannedGroup& g = plan.groups[i];
    g.resident = false;
    if (g.always_on) {
      always_on += g.bytes;
    } else {
      ring.push_back(&g);
    }
    all.push_back(&g);
    const double x = static_cast<double>(i) * 0.6180339887498949;
    spread[&g] = x - static_cast<int64_t>(x);
  }
  std::sort(ring.begin(), ring.end(), [&](const PlannedGroup* a, const PlannedGroup* b) {
    if (a->bytes != b->bytes) return a->bytes > b->bytes;
    return spread[a] < spread[b];
  });
  if (options.budget_bytes > 0) {
    // Candidate slot sizes: 0 (everything resident) or any group's size. Groups larger than the
    // slot must be resident; the rest fill the remaining budget greedily, largest first. The
    // store's scratch is reserved for every group that may still stream (an upper bound: greedy
    // filling can only make it smaller).
    std::set<int64_t> sizes = {0};
    for (const PlannedGroup* g : ring) sizes.insert(g->bytes);
    int64_t best_resident = -1;
    int64_t best_slot = 0;
    std::vector<PlannedGroup*> best;
    for (int64_t s : sizes) {
      const int64_t scratch = ScratchFor(all, options,
                                         [&](const PlannedGroup& g) { return g.always_on || g.bytes <= s; });
      int64_t free = options.budget_bytes - always_on - (s > 0 ? n * s : 0) - scratch;
      std::vector<PlannedGroup*> chosen;
      int64_t resident = 0;
      for (PlannedGroup* g : ring) {
        if (g->bytes > s) {
          free -= g->bytes;
          resident += g->bytes;
          chosen.push_back(g);
        }
      }
      if (free < 0) continue;
      for (PlannedGroup* g : ring) {
        if (g->bytes <= s && g->bytes <= free) {
          free -= g->bytes;
          resident += g->bytes;
          chosen.push_back(g);
        }
      }
      // Slot size is the largest group left streaming (may be below s).
      int64_t slot = 0;
      for (const PlannedGroup* g : ring) {
        if (std::find(chosen.begin(), chosen.end(), g) == chosen.end()) slot = std::max(slot, g->bytes);
      }
      if (resident > best_resident) {
        best_resident = resident;
        best_slot = slot;
        best = chosen;
      }
    }
    if (best_resident < 0) {
      // The smallest working set streams every group: slots as large as the largest group.
      const int64_t largest = ring.empty() ? 0 : *sizes.rbegin();
      const int64_t scratch = ScratchFor(all, options, [](const PlannedGroup&) { return true; });
      return absl::InvalidArgumentError(absl::StrCat(
          "component '", component, "': budget_bytes ", options.budget_bytes,
          " is smaller than its smallest working set, ", always_on + n * largest + scratch, " bytes: ", always_on,
          " always-on bytes + ", n, " slot(s) of ", largest, " bytes (its largest group)",
          scratch > 0 ? absl::StrCat(" + ", scratch, " bytes of the host store's device scratch") : ""));
    }
    for (PlannedGroup* g : best) g->resident = true;
    plan.slot_bytes = best_slot;
  } else {
    plan.slot_bytes = ring.empty() ? 0 : ring.front()->bytes;
  }
  for (const PlannedGroup* g : ring) {
    if (g->resident) {
      ++plan.resident_groups;
      plan.resident_bytes += g->bytes;
    } else {
      ++plan.streamed_groups;
      plan.streamed_bytes += g->bytes;
    }
  }
  plan.slots = plan.streamed_groups > 0 ? n : 0;
  if (plan.streamed_groups == 0) plan.slot_bytes = 0;
  plan.always_on_bytes = always_on;
  plan.scratch_bytes = ScratchFor(all, options, [](const PlannedGroup& g) { return !g.resident; });
  plan.working_set_bytes = plan.slots * plan.slot_bytes + always_on + plan.resident_bytes + plan.scratch_bytes;
  return plan;
}

absl::StatusOr<GroupPlan> PlanGroups(const std::string& component, Module& root,
                                     const std::vector<PlanTensor>& tensors, const GroupPlanOptions& options) {
  ASSIGN_OR_RETURN(std::vector<PlannedGroup> groups, FormGroups(component, root, tensors, options));
  return ChooseResidency(component, std::move(groups), options);
}

}  // namespace stowage
