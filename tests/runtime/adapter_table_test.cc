// The adapter table on its own: what a pipeline has loaded, what a request may name, what a batch
// uses at run time, and making a file ready for a pipeline (its placement component, the layers it
// adapts, and every way a file can not fit the pipeline).
#include "runtime/adapter_table.h"

#include <memory>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "models/pipelines/tiny_pipeline.h"

namespace stowage {
namespace {

// A rank-2 file adapting the tiny transformer's Linear layers named in `paths` (of their shapes,
// or one column wider with `wrong_shape`).
LoraFile File(Pipeline& pipeline, const std::vector<std::string>& paths, bool wrong_shape = false) {
  LoraFile file;
  file.rank = 2;
  for (Component* c : pipeline.components()) {
    if (c->name() != "transformer") continue;
    c->module().ForEachModule([&](Module& m) {
      auto* l = dynamic_cast<Linear*>(&m);
      if (l == nullptr || std::find(paths.begin(), paths.end(), m.path()) == paths.end()) return;
      LoraWeights w;
      w.down = at::ones({2, l->in_features() + (wrong_shape ? 1 : 0)});
      w.up = at::ones({l->out_features(), 2});
      file.layers["transformer"][m.path()] = w;
    });
  }
  return file;
}

std::vector<std::string> TwoLinears(Pipeline& pipeline) {
  std::vector<std::string> out;
  for (Component* c : pipeline.components()) {
    if (c->name() != "transformer") continue;
    c->module().ForEachModule([&](Module& m) {
      if (dynamic_cast<Linear*>(&m) != nullptr && out.size() < 2) out.push_back(m.path());
    });
  }
  return out;
}

TEST(AdapterTableTest, PrepareMakesOneComponentAndNamesEveryMismatch) {
  auto pipeline = *CreateTinyPipeline({});
  const std::vector<std::string> paths = TwoLinears(*pipeline);
  ASSERT_EQ(paths.size(), 2u);
  absl::StatusOr<PreparedAdapter> prepared = PrepareAdapter(*pipeline, "style", "/x.safetensors", File(*pipeline, paths));
  ASSERT_TRUE(prepared.ok()) << prepared.status();
  EXPECT_EQ(prepared->component->name(), "lora:style");
  EXPECT_EQ(prepared->component->kind(), kLoraAdapterKind);
  EXPECT_EQ(prepared->layers.size(), 2u);
  EXPECT_EQ(prepared->info.layers(), 2);
  EXPECT_EQ(prepared->info.bytes(), prepared->component->weight_bytes());
  EXPECT_GT(prepared->info.bytes(), 0);
  // The layers' weights read the component's slots (placement moves those).
  for (const auto& [layer, weights] : prepared->layers) {
    EXPECT_NE(weights.down_slot, nullptr);
    EXPECT_TRUE(weights.A().defined());
  }

  auto refused = [&](const std::string& name, const LoraFile& file, const std::string& needle) {
    const absl::Status s = PrepareAdapter(*pipeline, name, "", file).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(s.message().find(needle), std::string::npos) << s;
  };
  refused("bad name!", File(*pipeline, paths), "adapter name");
  refused("", File(*pipeline, paths), "adapter name");
  refused("x", File(*pipeline, paths, /*wrong_shape=*/true), "the pipeline's is [");
  LoraFile elsewhere = File(*pipeline, paths);
  elsewhere.layers["unet"] = elsewhere.layers["transformer"];
  refused("x", elsewhere, "adapts component 'unet', which pipeline");
  LoraFile missing = File(*pipeline, paths);
  missing.layers["transformer"]["no.such.layer"] = missing.layers["transformer"].begin()->second;
  refused("x", missing, "'transformer.no.such.layer' is no Linear layer");
}

TEST(AdapterTableTest, WhatAPipelineHasAndWhatARequestUses) {
  AdapterTable table;
  v1::Adapter style;
  style.set_name("style");
  auto component = std::shared_ptr<Component>();
  ASSERT_TRUE(table.Add("p", style, component).ok());
  EXPECT_EQ(table.Add("p", style, component).code(), absl::StatusCode::kAlreadyExists);
  v1::Adapter ink;
  ink.set_name("ink");
  ASSERT_TRUE(table.Add("p", ink, component).ok());
  ASSERT_TRUE(table.Add("q", style, component).ok());  // Names are per pipeline.
  EXPECT_TRUE(table.Contains("p", "ink"));
  EXPECT_FALSE(table.Contains("q", "ink"));
  EXPECT_EQ(table.All().size(), 3u);
  EXPECT_EQ(table.Of("p").size(), 2u);

  const absl::Status unknown = table.CheckNamed("p", "gold", "loras[1]");
  EXPECT_EQ(unknown.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(unknown.message(), "loras[1].name: pipeline 'p' has no adapter gold (loaded: ink, style)");
  EXPECT_NE(table.CheckNamed("r", "gold", "loras[0]").message().find("(loaded: none)"), std::string::npos);
  EXPECT_TRUE(table.CheckNamed("p", "ink", "loras[0]").ok());

  google::protobuf::RepeatedPtrField<v1::LoraRef> loras;
  v1::LoraRef* a = loras.Add();
  a->set_name("style");
  a->set_scale(0.5f);
  v1::LoraRef* off = loras.Add();
  off->set_name("ink");
  off->set_scale(0.0f);  // Scale 0: not used, not held.
  absl::StatusOr<std::vector<AdapterTable::Use>> uses = table.Uses("p", loras);
  ASSERT_TRUE(uses.ok());
  ASSERT_EQ(uses->size(), 1u);
  EXPECT_EQ(uses->front().name, "style");

  ASSERT_TRUE(table.Remove("p", "style").ok());
  EXPECT_EQ(table.Remove("p", "style").status().code(), absl::StatusCode::kNotFound);
  const absl::Status gone = table.Uses("p", loras).status();
  EXPECT_EQ(gone.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(gone.message(), "adapter 'style' was unloaded from pipeline 'p' before the request ran");
  EXPECT_EQ(table.RemovePipeline("p"), std::vector<std::string>{"ink"});
  EXPECT_TRUE(table.Of("p").empty());
  EXPECT_EQ(table.All().size(), 1u);
}

}  // namespace
}  // namespace stowage
