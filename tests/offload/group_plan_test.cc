// Group planning on small module trees: which groups form, their layout, and the budget's choice.
// No device and no weights: the planner sees the tree and the tensors' sizes only.
#include "offload/group_plan.h"

#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

#include "offload/module.h"

namespace stowage {
namespace {

// root "Net": pos (256 B, root-owned), embed.weight (1000 B), blocks: ModuleList of Block{fc.weight,
// fc.bias}, head.weight (512 B). Tensors are undefined: only their sizes (given to the planner) count.
struct Tree {
  explicit Tree(const std::vector<int64_t>& block_bytes) {
    root.AddParameter("pos", at::Tensor());
    Module* embed = root.AddChild("embed", std::make_unique<Module>("Linear"));
    embed->AddParameter("weight", at::Tensor());
    Module* blocks = root.AddChild("blocks", std::make_unique<Module>("ModuleList"));
    for (size_t i = 0; i < block_bytes.size(); ++i) {
      Module* block = blocks->AddChild(std::to_string(i), std::make_unique<Module>("Block"));
      Module* fc = block->AddChild("fc", std::make_unique<Module>("Linear"));
      fc->AddParameter("weight", at::Tensor());
      fc->AddParameter("bias", at::Tensor());
    }
    Module* head = root.AddChild("head", std::make_unique<Module>("Linear"));
    head->AddParameter("weight", at::Tensor());
    std::map<std::string, int64_t> bytes = {{"pos", 256}, {"embed.weight", 1000}, {"head.weight", 512}};
    for (size_t i = 0; i < block_bytes.size(); ++i) {
      bytes["blocks." + std::to_string(i) + ".fc.weight"] = block_bytes[i] - 256;
      bytes["blocks." + std::to_string(i) + ".fc.bias"] = 100;  // Aligned up to 256.
    }
    root.ForEachSlot([&](Module& m, TensorSlot& slot) {
      tensors.push_back(PlanTensor{&slot, bytes.at(m.SlotPath(slot))});
      names.push_back(m.SlotPath(slot));
    });
  }
  static constexpr int64_t kOutside = 256 + 1024 + 512;  // Aligned sizes outside the blocks.

  Module root{"Net"};
  std::vector<PlanTensor> tensors;
  std::vector<std::string> names;  // Of tensors[i].
};

// A group's layout: (tensor path, offset) in layout order; `names` are the tensors' paths.
using Layout = std::vector<std::pair<std::string, int64_t>>;
Layout GroupLayout(const PlannedGroup& g, const std::vector<std::string>& names) {
  Layout out;
  for (const PlannedTensor& t : g.tensors) out.emplace_back(names[static_cast<size_t>(t.index)], t.offset);
  return out;
}

// Planner inputs for every tensor under `root`, as a compressed store sees them: a Linear's weight
// (4096 bytes) needs scratch of its own, every other tensor (300 bytes) is carried. Their paths go to
// `names`.
std::vector<PlanTensor> LinearWeightsCompressed(Module& root, std::vector<std::string>& names) {
  std::vector<PlanTensor> tensors;
  root.ForEachSlot([&](Module& m, TensorSlot& slot) {
    const bool weight = slot.name == "weight" && m.kind() == "Linear";
    tensors.push_back(PlanTensor{&slot, weight ? 4096 : 300, weight ? 1024 : 0, weight ? 0 : 300});
    names.push_back(m.SlotPath(slot));
  });
  return tensors;
}

GroupPlanOptions Options(OffloadType type, int per_group = 1, int64_t budget = 0, int64_t slots = 2) {
  GroupPlanOptions o;
  o.type = type;
  o.num_blocks_per_group = per_group;
  o.budget_bytes = budget;
  o.slots = slots;
  return o;
}

std::vector<std::string> Names(const GroupPlan& plan) {
  std::vector<std::string> names;
  for (const PlannedGroup& g : plan.groups) names.push_back(g.name);
  return names;
}

TEST(GroupPlanTest, BlockLevelGroupsConsecutiveBlocksAndPutsTheRestInOneAlwaysOnGroup) {
  Tree t({1024, 2048, 1024});
  auto plan = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kBlockLevel, 2));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Names(*plan), (std::vector<std::string>{"blocks.0-1", "blocks.2-2", "(outside blocks)"}));
  const PlannedGroup& first = plan->groups[0];
  EXPECT_EQ(first.bytes, 1024 + 2048);
  ASSERT_EQ(first.members.size(), 2u);
  EXPECT_EQ(first.members[0]->path(), "blocks.0");
  EXPECT_FALSE(first.always_on);
  // Packed in tree order, each tensor aligned: weight 768 B, bias at 768, next block's weight at 1024.
  ASSERT_EQ(first.tensors.size(), 4u);
  EXPECT_EQ(t.names[static_cast<size_t>(first.tensors[1].index)], "blocks.0.fc.bias");
  EXPECT_EQ(first.tensors[1].offset, 768);
  EXPECT_EQ(first.tensors[1].bytes, 100);
  EXPECT_EQ(first.tensors[2].offset, 1024);
  const PlannedGroup& rest = plan->groups[2];
  EXPECT_TRUE(rest.always_on);
  EXPECT_EQ(rest.bytes, Tree::kOutside);
  ASSERT_EQ(rest.members.size(), 1u);
  EXPECT_EQ(rest.members[0], &t.root);
  // Every tensor in exactly one group.
  std::vector<int> seen(t.tensors.size(), 0);
  for (const PlannedGroup& g : plan->groups) {
    for (const PlannedTensor& pt : g.tensors) {
      ++seen[static_cast<size_t>(pt.index)];
      EXPECT_EQ(pt.offset % kGroupAlign, 0);
    }
  }
  EXPECT_EQ(seen, std::vector<int>(t.tensors.size(), 1));
  // No budget: everything in the ring streams; one slot size for the largest group.
  EXPECT_EQ(plan->streamed_groups, 2);
  EXPECT_EQ(plan->resident_groups, 0);
  EXPECT_EQ(plan->slots, 2);
  EXPECT_EQ(plan->slot_bytes, 3072);
  EXPECT_EQ(plan->always_on_bytes, Tree::kOutside);
  EXPECT_EQ(plan->working_set_bytes, 2 * 3072 + Tree::kOutside);
}

TEST(GroupPlanTest, LeafLevelStreamsLeavesAndKeepsParametersOfNonLeavesAlwaysOn) {
  Tree t({1024, 1024});
  auto plan = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kLeafLevel));
  ASSERT_TRUE(plan.ok()) << plan.status();
  // Modules without tensors of their own (blocks, Block) form no group.
  EXPECT_EQ(Names(*plan),
            (std::vector<std::string>{"(root)", "embed", "blocks.0.fc", "blocks.1.fc", "head"}));
  EXPECT_TRUE(plan->groups[0].always_on);
  EXPECT_EQ(plan->groups[0].bytes, 256);
  for (size_t i = 1; i < plan->groups.size(); ++i) EXPECT_FALSE(plan->groups[i].always_on);
  EXPECT_EQ(plan->slot_bytes, 1024);
  EXPECT_EQ(plan->streamed_bytes, 1024 + 2 * 1024 + 512);
}

TEST(GroupPlanTest, ExplicitBlockModulesAndTheirErrors) {
  Tree t({1024, 1024});
  GroupPlanOptions options = Options(OffloadType::kBlockLevel);
  options.block_modules = {"blocks.0"};  // Its children (fc) are the blocks.
  auto plan = PlanGroups("net", t.root, t.tensors, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Names(*plan), (std::vector<std::string>{"blocks.0.0-0", "(outside blocks)"}));
  EXPECT_EQ(plan->groups[1].bytes, Tree::kOutside + 1024);

  options.block_modules = {"nope"};
  auto missing = PlanGroups("net", t.root, t.tensors, options);
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(missing.status().message()).find("'nope'"), std::string::npos);

  Module flat("Flat");
  flat.AddParameter("w", at::Tensor());
  auto no_lists = PlanGroups("flat", flat, {PlanTensor{&flat.slots()[0], 256}}, Options(OffloadType::kBlockLevel));
  EXPECT_EQ(no_lists.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(no_lists.status().message()).find("component 'flat'"), std::string::npos);
}

// With no block_modules, the block lists are the ModuleLists nearest the root: a model whose
// blocks sit one level down (T5's encoder.block) gets them, and a ModuleList nested inside a
// shallower one's level is not taken instead of it.
TEST(GroupPlanTest, DefaultBlockListsAreTheModuleListsNearestTheRoot) {
  Module root("T5Like");
  Module* shared = root.AddChild("shared", std::make_unique<Module>("Embedding"));
  shared->AddParameter("weight", at::Tensor());
  Module* encoder = root.AddChild("encoder", std::make_unique<Module>("Stack"));
  Module* blocks = encoder->AddChild("block", std::make_unique<Module>("ModuleList"));
  for (int i = 0; i < 2; ++i) {
    Module* block = blocks->AddChild(std::to_string(i), std::make_unique<Module>("Block"));
    Module* inner = block->AddChild("layer", std::make_unique<Module>("ModuleList"));  // Deeper: not a block list.
    Module* fc = inner->AddChild("0", std::make_unique<Module>("Linear"));
    fc->AddParameter("weight", at::Tensor());
  }
  Module* norm = encoder->AddChild("final_layer_norm", std::make_unique<Module>("RMSNorm"));
  norm->AddParameter("weight", at::Tensor());
  std::vector<PlanTensor> tensors;
  root.ForEachSlot([&](Module&, TensorSlot& slot) { tensors.push_back(PlanTensor{&slot, 1024}); });
  auto plan = PlanGroups("t5", root, tensors, Options(OffloadType::kBlockLevel));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(Names(*plan), (std::vector<std::string>{"encoder.block.0-0", "encoder.block.1-1", "(outside blocks)"}));

  // A ModuleList child of the root wins over deeper ones (as before).
  Tree t({1024, 1024});
  auto shallow = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kBlockLevel));
  ASSERT_TRUE(shallow.ok()) << shallow.status();
  EXPECT_EQ(Names(*shallow), (std::vector<std::string>{"blocks.0-0", "blocks.1-1", "(outside blocks)"}));
}

TEST(GroupPlanTest, BudgetKeepsLargerGroupsResidentAndSizesTheSlotForTheRest) {
  // Blocks of 4, 8, 4 and 2 KiB; 2 slots. With outside + 2 x 4 KiB + 8 KiB, the best choice is a
  // 4 KiB slot with the 8 KiB block resident (a 2 KiB slot would need 16 KiB resident; no slot, all).
  Tree t({4096, 8192, 4096, 2048});
  const int64_t budget = Tree::kOutside + 2 * 4096 + 8192;
  auto plan = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kBlockLevel, 1, budget));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_TRUE(plan->groups[1].resident);
  EXPECT_FALSE(plan->groups[1].streamed());
  for (size_t i : {0, 2, 3}) EXPECT_TRUE(plan->groups[i].streamed()) << i;
  EXPECT_EQ(plan->resident_groups, 1);
  EXPECT_EQ(plan->resident_bytes, 8192);
  EXPECT_EQ(plan->streamed_groups, 3);
  EXPECT_EQ(plan->streamed_bytes, 4096 + 4096 + 2048);
  EXPECT_EQ(plan->slot_bytes, 4096);
  EXPECT_EQ(plan->working_set_bytes, budget);

  // Everything fits: no slots at all.
  auto all = PlanGroups("net", t.root, t.tensors,
                        Options(OffloadType::kBlockLevel, 1, Tree::kOutside + 4096 + 8192 + 4096 + 2048));
  ASSERT_TRUE(all.ok()) << all.status();
  EXPECT_EQ(all->streamed_groups, 0);
  EXPECT_EQ(all->slots, 0);
  EXPECT_EQ(all->slot_bytes, 0);

  // Below the smallest working set (outside + 2 slots of the largest group: everything streams);
  // the error names that minimum, and the minimum itself plans.
  const int64_t minimum = Tree::kOutside + 2 * 8192;
  auto tight = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kBlockLevel, 1, minimum - 1));
  EXPECT_EQ(tight.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(tight.status().message()).find("budget_bytes"), std::string::npos);
  EXPECT_NE(std::string(tight.status().message()).find(absl::StrCat("smallest working set, ", minimum, " bytes")),
            std::string::npos)
      << tight.status();
  auto least = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kBlockLevel, 1, minimum));
  ASSERT_TRUE(least.ok()) << least.status();
  EXPECT_LE(least->working_set_bytes, minimum);
}

TEST(GroupPlanTest, EqualGroupsKeptResidentAreSpreadAlongTheForward) {
  Tree t({1024, 1024, 1024, 1024, 1024, 1024});
  const int64_t budget = Tree::kOutside + 2 * 1024 + 2 * 1024;  // 2 slots and 2 resident blocks.
  auto plan = PlanGroups("net", t.root, t.tensors, Options(OffloadType::kBlockLevel, 1, budget));
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::vector<std::string> resident;
  for (const PlannedGroup& g : plan->groups) {
    if (g.resident) resident.push_back(g.name);
  }
  // Not the first two: the first and the last (golden-ratio order of the group index).
  EXPECT_EQ(resident, (std::vector<std::string>{"blocks.0-0", "blocks.5-5"}));
}

// A store's scratch: a group needs its tensors' own scratch plus what they carry, and nothing when
// none of its tensors needs scratch of its own (the compressed store copies such a group straight into
// its slot); the store keeps two areas of the largest and its fixed part.
TEST(GroupPlanTest, CarriedScratchCountsOnlyInGroupsWithScratchOfTheirOwn) {
  Tree t({1024, 1024, 1024});
  for (size_t i = 0; i < t.tensors.size(); ++i) {
    const std::string& name = t.names[i];
    // Block 0's weight needs 300 B of scratch (aligned to 512); every other tensor carries its bytes.
    t.tensors[i].scratch_bytes = name == "blocks.0.fc.weight" ? 300 : 0;
    t.tensors[i].carried_scratch_bytes = name == "blocks.0.fc.weight" ? 0 : t.tensors[i].bytes;
  }
  GroupPlanOptions options = Options(OffloadType::kBlockLevel);
  options.scratch_buffers = 2;
  options.fixed_scratch_bytes = 1000;
  auto plan = PlanGroups("net", t.root, t.tensors, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(Names(*plan), (std::vector<std::string>{"blocks.0-0", "blocks.1-1", "blocks.2-2", "(outside blocks)"}));
  EXPECT_EQ(plan->groups[0].own_scratch_bytes, 512);
  EXPECT_EQ(plan->groups[0].carried_scratch_bytes, 256);  // The bias, aligned.
  EXPECT_EQ(plan->groups[0].scratch_bytes(), 512 + 256);
  for (size_t g = 1; g < plan->groups.size(); ++g) {
    EXPECT_EQ(plan->groups[g].own_scratch_bytes, 0) << g;
    EXPECT_GT(plan->groups[g].carried_scratch_bytes, 0) << g;
    EXPECT_EQ(plan->groups[g].scratch_bytes(), 0) << g;
  }
  EXPECT_EQ(plan->scratch_bytes, 2 * (512 + 256) + 1000);
}

// In a block group, tensors a module declares adjacent (Q/K/V weights, then their scales: interleaved
// in module order) are packed one after another where the module comes, as a resident onload lays
// them, so one GEMM can read them as one matrix; a declaration naming another block's tensor is
// ignored (a layout hint never moves a tensor across groups).
TEST(GroupPlanTest, TensorsDeclaredAdjacentArePackedSideBySideInTheirBlocksGroup) {
  Module root{"Net"};
  Module* blocks = root.AddChild("blocks", std::make_unique<Module>("ModuleList"));
  std::vector<std::vector<Module*>> linears;  // Per block: q, k, v.
  std::vector<Module*> attns;
  for (int b = 0; b < 2; ++b) {
    Module* block = blocks->AddChild(std::to_string(b), std::make_unique<Module>("Block"));
    Module* attn = block->AddChild("attn", std::make_unique<Module>("Attention"));
    attns.push_back(attn);
    linears.emplace_back();
    for (const char* name : {"q", "k", "v"}) {
      Module* l = attn->AddChild(name, std::make_unique<Module>("Linear"));
      l->AddParameter("weight", at::Tensor());
      l->AddBuffer("weight_scale", at::Tensor());
      linears.back().push_back(l);
    }
    Module* out = block->AddChild("out", std::make_unique<Module>("Linear"));
    out->AddParameter("weight", at::Tensor());
  }
  for (int b = 0; b < 2; ++b) {
    std::vector<std::pair<Module*, int>> weights, scales;
    for (Module* l : linears[static_cast<size_t>(b)]) {
      weights.emplace_back(l, 0);
      scales.emplace_back(l, 1);
    }
    if (b == 0) {
      // Block 0 declares only its weights, and one of them is block 1's v: ignored.
      weights.back() = {linears[1][2], 0};
      attns[0]->AddAdjacentGroup(weights);
      continue;
    }
    attns[1]->AddAdjacentGroup(weights);
    attns[1]->AddAdjacentGroup(scales);
  }
  std::vector<PlanTensor> tensors;
  std::vector<std::string> names;
  root.ForEachSlot([&](Module& m, TensorSlot& slot) {
    const bool scale = slot.name == "weight_scale";
    tensors.push_back(PlanTensor{&slot, scale ? 512 : 4096});
    names.push_back(m.SlotPath(slot));
  });
  auto plan = PlanGroups("net", root, tensors, Options(OffloadType::kBlockLevel));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(Names(*plan), (std::vector<std::string>{"blocks.0-0", "blocks.1-1"}));
  auto layout = [&](const PlannedGroup& g) { return GroupLayout(g, names); };
  EXPECT_EQ(layout(plan->groups[1]), (Layout{{"blocks.1.attn.q.weight", 0},
                                             {"blocks.1.attn.k.weight", 4096},
                                             {"blocks.1.attn.v.weight", 8192},
                                             {"blocks.1.attn.q.weight_scale", 12288},
                                             {"blocks.1.attn.k.weight_scale", 12800},
                                             {"blocks.1.attn.v.weight_scale", 13312},
                                             {"blocks.1.out.weight", 13824}}));
  // Block 0, whose declaration reached into block 1: module order.
  EXPECT_EQ(layout(plan->groups[0]), (Layout{{"blocks.0.attn.q.weight", 0},
                                             {"blocks.0.attn.q.weight_scale", 4096},
                                             {"blocks.0.attn.k.weight", 4608},
                                             {"blocks.0.attn.k.weight_scale", 8704},
                                             {"blocks.0.attn.v.weight", 9216},
                                             {"blocks.0.attn.v.weight_scale", 13312},
                                             {"blocks.0.out.weight", 13824}}));
}

// In a group with tensors that need scratch of their own (a compressed store's compressed weights),
// those come first and the others after them, each part in the order it had (tensors declared
// adjacent stay side by side), so the store carries the others as one run; groups with none, or
// only such tensors, keep module order.
TEST(GroupPlanTest, CompressedTensorsFirstThenTheOthersAsOneRun) {
  Module root{"Net"};
  Module* blocks = root.AddChild("blocks", std::make_unique<Module>("ModuleList"));
  Module* block = blocks->AddChild("0", std::make_unique<Module>("Block"));
  std::vector<std::pair<Module*, int>> scales;
  for (const char* name : {"q", "k", "v"}) {
    Module* l = block->AddChild(name, std::make_unique<Module>("Linear"));
    l->AddParameter("weight", at::Tensor());
    l->AddBuffer("weight_scale", at::Tensor());
    l->AddParameter("bias", at::Tensor());
    scales.emplace_back(l, 1);
  }
  block->AddAdjacentGroup(scales);  // Placed first where the block is visited, before its layers.
  Module* norm = block->AddChild("norm", std::make_unique<Module>("RMSNorm"));
  norm->AddParameter("weight", at::Tensor());
  // The weights compress (scratch of their own); scales, biases and the norm are carried.
  std::vector<std::string> names;
  std::vector<PlanTensor> tensors = LinearWeightsCompressed(root, names);
  auto layout = [&](const PlannedGroup& g) { return GroupLayout(g, names); };
  auto plan = PlanGroups("net", root, tensors, Options(OffloadType::kBlockLevel));
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->groups.size(), 1u);
  EXPECT_EQ(layout(plan->groups[0]), (Layout{{"blocks.0.q.weight", 0},
                                             {"blocks.0.k.weight", 4096},
                                             {"blocks.0.v.weight", 8192},
                                             {"blocks.0.q.weight_scale", 12288},
                                             {"blocks.0.k.weight_scale", 12800},
                                             {"blocks.0.v.weight_scale", 13312},
                                             {"blocks.0.q.bias", 13824},
                                             {"blocks.0.k.bias", 14336},
                                             {"blocks.0.v.bias", 14848},
                                             {"blocks.0.norm.weight", 15360}}));
  EXPECT_EQ(plan->groups[0].bytes, 12288 + 7 * 512);
  // Nothing with scratch of its own (an uncompressed store): module order, adjacency kept.
  for (PlanTensor& t : tensors) t.scratch_bytes = t.carried_scratch_bytes = 0;
  plan = PlanGroups("net", root, tensors, Options(OffloadType::kBlockLevel));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(layout(plan->groups[0]), (Layout{{"blocks.0.q.weight_scale", 0},
                                             {"blocks.0.k.weight_scale", 512},
                                             {"blocks.0.v.weight_scale", 1024},
                                             {"blocks.0.q.weight", 1536},
                                             {"blocks.0.q.bias", 5632},
                                             {"blocks.0.k.weight", 6144},
                                             {"blocks.0.k.bias", 10240},
                                             {"blocks.0.v.weight", 10752},
                                             {"blocks.0.v.bias", 14848},
                                             {"blocks.0.norm.weight", 15360}}));
}

// A declaration that mixes tensors with scratch of their own and others (none does in the models)
// keeps the group in module order rather than splitting it.
TEST(GroupPlanTest, AMixedAdjacencyDeclarationKeepsModuleOrder) {
  Module root{"Net"};
  Module* blocks = root.AddChild("blocks", std::make_unique<Module>("ModuleList"));
  Module* block = blocks->AddChild("0", std::make_unique<Module>("Block"));
  Module* a = block->AddChild("a", std::make_unique<Module>("Linear"));
  a->AddParameter("weight", at::Tensor());
  a->AddParameter("bias", at::Tensor());
  Module* b = block->AddChild("b", std::make_unique<Module>("Linear"));
  b->AddParameter("weight", at::Tensor());
  block->AddAdjacentGroup({{a, 0}, {a, 1}});  // a's weight (compressed) beside its bias (carried).
  std::vector<std::string> names;
  const std::vector<PlanTensor> tensors = LinearWeightsCompressed(root, names);
  auto plan = PlanGroups("net", root, tensors, Options(OffloadType::kBlockLevel));
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(GroupLayout(plan->groups[0], names),
            (Layout{{"blocks.0.a.weight", 0}, {"blocks.0.a.bias", 4096}, {"blocks.0.b.weight", 4608}}));
}

}  // namespace
}  // namespace stowage
