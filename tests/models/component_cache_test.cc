// ComponentCache: components are shared between pipelines by content — the same folder, another
// folder holding the same bytes (a copied text encoder), or the same config and seed when the
// weights are drawn — and never when one byte or one seed differs.
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "models/pipelines/component.h"
#include "models/pipelines/tiny_pipeline.h"

namespace stowage {
namespace {

namespace fs = std::filesystem;

std::string Dir(const std::string& name) {
  const std::string dir = std::string(::testing::TempDir()) + "/component_cache_" + name;
  fs::remove_all(dir);
  return dir;
}

std::map<std::string, Component*> ByName(Pipeline& pipeline) {
  std::map<std::string, Component*> out;
  for (Component* c : pipeline.components()) out[c->name()] = c;
  return out;
}

std::unique_ptr<Pipeline> Load(const std::string& dir, ComponentCache& cache, bool random = false,
                               std::map<std::string, uint64_t> seeds = {}) {
  TinyPipelineOptions options;
  options.component_seeds = std::move(seeds);
  absl::StatusOr<std::unique_ptr<Pipeline>> p = LoadTinyPipeline(dir, options, random, &cache);
  EXPECT_TRUE(p.ok()) << p.status();
  return p.ok() ? std::move(*p) : nullptr;
}

// The last byte of the first safetensors file under `folder` (weight data, not the header).
void FlipLastByte(const std::string& folder) {
  for (const auto& entry : fs::directory_iterator(folder)) {
    if (entry.path().extension() != ".safetensors") continue;
    std::fstream f(entry.path(), std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    char c = 0;
    f.get(c);
    f.seekp(-1, std::ios::end);
    f.put(static_cast<char>(c ^ 0x01));
    return;
  }
  FAIL() << "no safetensors file in " << folder;
}

TEST(ComponentCacheTest, CopiedFoldersShareByContent) {
  const std::string a = Dir("a"), b = Dir("b");
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), a).ok());
  fs::copy(a, b, fs::copy_options::recursive);
  ComponentCache cache;
  auto pa = Load(a, cache);
  auto pb = Load(b, cache);
  ASSERT_NE(pa, nullptr);
  ASSERT_NE(pb, nullptr);
  auto ca = ByName(*pa), cb = ByName(*pb);
  ASSERT_EQ(ca.size(), 3u);
  for (const auto& [name, component] : ca) EXPECT_EQ(component, cb[name]) << name;
  EXPECT_EQ(cache.shared_by_content(), 3);
}

TEST(ComponentCacheTest, ADifferentByteOrSeedIsNotShared) {
  const std::string a = Dir("base"), tuned = Dir("tuned"), flipped = Dir("flipped");
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), a).ok());
  // A fine-tune: the same text encoder and VAE files, a transformer drawn from another seed (same
  // shapes, so names, sizes and headers match; only the bytes differ).
  TinyPipelineOptions tuned_options;
  tuned_options.component_seeds["transformer"] = 7;
  ASSERT_TRUE(SaveTinyPipeline(tuned_options, tuned).ok());
  // One byte of the VAE's weights changed.
  fs::copy(a, flipped, fs::copy_options::recursive);
  FlipLastByte(flipped + "/vae");

  ComponentCache cache;
  auto pa = Load(a, cache);
  auto pt = Load(tuned, cache);
  auto pf = Load(flipped, cache);
  ASSERT_TRUE(pa && pt && pf);
  auto ca = ByName(*pa), ct = ByName(*pt), cf = ByName(*pf);
  EXPECT_EQ(ca["text_encoder"], ct["text_encoder"]);
  EXPECT_EQ(ca["vae"], ct["vae"]);
  EXPECT_NE(ca["transformer"], ct["transformer"]);
  EXPECT_EQ(ca["text_encoder"], cf["text_encoder"]);
  EXPECT_EQ(ca["transformer"], cf["transformer"]);
  EXPECT_NE(ca["vae"], cf["vae"]);
}

TEST(ComponentCacheTest, RandomWeightsShareByConfigAndSeed) {
  const std::string a = Dir("random_a"), b = Dir("random_b");
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), a).ok());
  fs::copy(a, b, fs::copy_options::recursive);
  // Only the configs count when weights are drawn: b's weight files may hold anything.
  FlipLastByte(b + "/text_encoder");
  ComponentCache cache;
  auto pa = Load(a, cache, /*random=*/true);
  auto pb = Load(b, cache, /*random=*/true, {{"transformer", 5}});
  ASSERT_TRUE(pa && pb);
  auto ca = ByName(*pa), cb = ByName(*pb);
  EXPECT_EQ(ca["text_encoder"], cb["text_encoder"]);
  EXPECT_EQ(ca["vae"], cb["vae"]);
  EXPECT_NE(ca["transformer"], cb["transformer"]);
  // A drawn transformer is not the one read from the folder.
  auto pr = Load(a, cache);
  ASSERT_NE(pr, nullptr);
  EXPECT_NE(ByName(*pr)["transformer"], ca["transformer"]);
}

TEST(ComponentCacheTest, ComponentsLiveAsLongAsAPipelineUsesThem) {
  const std::string a = Dir("lifetime"), b = Dir("lifetime_copy");
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), a).ok());
  fs::copy(a, b, fs::copy_options::recursive);
  ComponentCache cache;
  auto pa = Load(a, cache);
  ASSERT_NE(pa, nullptr);
  {
    auto pb = Load(b, cache);
    ASSERT_NE(pb, nullptr);
  }
  pa.reset();
  // Nothing holds them now: a new load reads the files again (a fresh object; no content match).
  auto again = Load(b, cache);
  ASSERT_NE(again, nullptr);
  EXPECT_EQ(cache.shared_by_content(), 3);
}

// A folder rewritten in place after its component loaded no longer holds that component's bytes:
// a copy of the new bytes elsewhere must not be handed the old component.
TEST(ComponentCacheTest, AFolderChangedSinceItsLoadMatchesNothing) {
  const std::string x = Dir("changed_x"), y = Dir("changed_y");
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), x).ok());
  ComponentCache cache;
  auto px = Load(x, cache);
  ASSERT_NE(px, nullptr);
  FlipLastByte(x + "/vae");  // Same size and header; other bytes; the component holds the old ones.
  fs::copy(x, y, fs::copy_options::recursive);
  auto py = Load(y, cache);
  ASSERT_NE(py, nullptr);
  EXPECT_NE(ByName(*px)["vae"], ByName(*py)["vae"]) << "handed the component of bytes the folder no longer holds";
  EXPECT_EQ(ByName(*px)["transformer"], ByName(*py)["transformer"]);  // Unchanged files still match.
}

// A config nested past any sane depth is compared as raw bytes: no recursion on hostile input.
TEST(ComponentCacheTest, ADeeplyNestedConfigIsDescribedWithoutRecursing) {
  const std::string dir = Dir("deep");
  fs::create_directories(dir);
  {
    std::ofstream out(dir + "/config.json");
    out << std::string(200000, '[') << std::string(200000, ']');
  }
  absl::StatusOr<ComponentSource> source =
      DescribeComponentSource("transformer", dir, at::kFloat, /*random_weights=*/true, 1);
  ASSERT_TRUE(source.ok()) << source.status();
  EXPECT_NE(source->key.find("random:1"), std::string::npos);
}

TEST(ComponentCacheTest, DescribeNamesAMissingConfig) {
  absl::StatusOr<ComponentSource> source =
      DescribeComponentSource("transformer", Dir("missing"), at::kFloat, /*random_weights=*/false, 0);
  ASSERT_FALSE(source.ok());
  EXPECT_NE(std::string(source.status().message()).find("config.json"), std::string::npos) << source.status();
}

}  // namespace
}  // namespace stowage
