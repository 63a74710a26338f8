// Loading diffusers-format directories written to disk as real safetensors files.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <functional>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "tests/models/host_runner.h"

#include "models/core/diffusers_format.h"
#include "models/pipelines/tiny_pipeline.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

std::string Fresh(const std::string& name) {
  const std::string dir = std::string(::testing::TempDir()) + "/" + name;
  std::system(("rm -rf '" + dir + "'").c_str());
  return dir;
}

// True when `ptr` lies in a region /proc/self/maps shows mapped from a file whose path ends in `suffix`.
bool IsMappingOf(const void* ptr, const std::string& suffix) {
  std::ifstream maps("/proc/self/maps");
  std::string line;
  const auto address = reinterpret_cast<uintptr_t>(ptr);
  while (std::getline(maps, line)) {
    uintptr_t begin = 0, end = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx", &begin, &end) != 2) continue;
    if (address < begin || address >= end) continue;
    return line.size() >= suffix.size() && line.compare(line.size() - suffix.size(), suffix.size(), suffix) == 0;
  }
  return false;
}

absl::StatusOr<Image> Draw(Pipeline& pipeline) {
  GenerationParams p;
  p.prompt = "a tram";
  p.width = 64;
  p.height = 64;
  p.steps = 2;
  p.guidance_scale = 2.0f;
  p.seed = 21;
  HostRunner runner;
  RunContext context(nullptr, nullptr);
  return pipeline.Run(p, runner, context);
}

TEST(DiffusersFormatTest, SavedPipelineLoadsBackAndDrawsTheSameImage) {
  const std::string dir = Fresh("tiny_saved");
  TinyPipelineOptions options;
  options.weight_seed = 9;
  ASSERT_TRUE(SaveTinyPipeline(options, dir, /*max_shard_bytes=*/1 << 20).ok());
  struct stat st;
  EXPECT_EQ(::stat((dir + "/transformer/diffusion_pytorch_model.safetensors.index.json").c_str(), &st), 0);
  EXPECT_EQ(::stat((dir + "/vae/diffusion_pytorch_model.safetensors").c_str(), &st), 0);
  auto loaded = LoadTinyPipeline(dir, {}, /*random_weights=*/false);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  auto built = CreateTinyPipeline(options);
  ASSERT_TRUE(built.ok());
  auto a = Draw(**loaded);
  auto b = Draw(**built);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status();
  EXPECT_EQ(a->rgb, b->rgb);
  // Same dtype: the host weights are the mapped file itself, not a copy of it.
  Component* vae = (*loaded)->components()[2];
  EXPECT_TRUE(IsMappingOf(vae->host_weights().entries()[0].host.data_ptr(), "vae/diffusion_pytorch_model.safetensors"));
  EXPECT_FALSE(IsMappingOf((*built)->components()[2]->host_weights().entries()[0].host.data_ptr(), ".safetensors"));
  // Random-weights mode reads only the configs.
  TinyPipelineOptions seeded;
  seeded.weight_seed = 9;
  auto random = LoadTinyPipeline(dir, seeded, /*random_weights=*/true);
  ASSERT_TRUE(random.ok());
  auto c = Draw(**random);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->rgb, b->rgb);
  // bfloat16 from float32 files: converted on load.
  TinyPipelineOptions bf16;
  bf16.dtype = at::kBFloat16;
  auto converted = LoadTinyPipeline(dir, bf16, false);
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ((*converted)->components()[1]->dtype(), at::kBFloat16);
}

TEST(DiffusersFormatTest, BrokenDirectoriesNameTheFileAndTheTensor) {
  const std::string dir = Fresh("tiny_broken");
  ASSERT_TRUE(SaveTinyPipeline({}, dir).ok());
  const std::string weights = dir + "/vae/diffusion_pytorch_model.safetensors";
  // Truncated file.
  {
    std::ifstream in(weights, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(weights, std::ios::binary | std::ios::trunc).write(bytes.data(), bytes.size() / 2);
  }
  auto truncated = LoadTinyPipeline(dir, {}, false);
  ASSERT_FALSE(truncated.ok());
  EXPECT_NE(std::string(truncated.status().message()).find(weights), std::string::npos) << truncated.status();
  EXPECT_NE(std::string(truncated.status().message()).find("truncated"), std::string::npos);

  // Missing, unexpected and mis-shaped tensors.
  ASSERT_TRUE(SaveTinyPipeline({}, dir).ok());
  auto read = ReadComponentWeights(dir + "/vae");
  ASSERT_TRUE(read.ok());
  TinyVaeDecoder vae({}, LayerOptions{});
  ComponentWeights missing = *read;
  missing.tensors.erase("conv_out.bias");
  const absl::Status m = BindWeights(vae, missing, at::kFloat, dir + "/vae");
  EXPECT_NE(std::string(m.message()).find("lacks 1 tensor(s) the model needs: conv_out.bias"), std::string::npos) << m;
  ComponentWeights extra = *read;
  extra.tensors["decoder.extra"] = at::zeros({1});
  const absl::Status u = BindWeights(vae, extra, at::kFloat, dir + "/vae");
  EXPECT_NE(std::string(u.message()).find("does not use: decoder.extra"), std::string::npos) << u;
  ComponentWeights shaped = *read;
  shaped.tensors["conv_out.bias"] = at::zeros({5});
  shaped.file_of["conv_out.bias"] = "x.safetensors";
  const absl::Status s = BindWeights(vae, shaped, at::kFloat, dir + "/vae");
  EXPECT_NE(std::string(s.message()).find("tensor 'conv_out.bias' in 'x.safetensors' has shape [5]"), std::string::npos) << s;
  // A float weight relabelled as I32 (same shape and bytes): refused, not converted.
  ComponentWeights relabelled = *read;
  relabelled.tensors["conv_out.bias"] = relabelled.tensors["conv_out.bias"].view(at::kInt);
  relabelled.file_of["conv_out.bias"] = "x.safetensors";
  const absl::Status r = BindWeights(vae, relabelled, at::kFloat, dir + "/vae");
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.message()).find("tensor 'conv_out.bias' in 'x.safetensors' is Int; the model needs a "
                                          "floating-point tensor"),
            std::string::npos)
      << r;

  // Wrong class and missing component.
  std::ofstream(dir + "/vae/config.json") << "{\"_class_name\": \"AutoencoderKL\"}";
  auto wrong = LoadTinyPipeline(dir, {}, false);
  EXPECT_NE(std::string(wrong.status().message()).find("_class_name is 'AutoencoderKL'"), std::string::npos);
  std::ofstream(dir + "/model_index.json") << "{\"_class_name\": \"X\"}";
  EXPECT_EQ(LoadTinyPipeline(dir, {}, false).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadTinyPipeline(dir + "/nowhere", {}, false).status().code(), absl::StatusCode::kNotFound);
}

// Model files changed under a loaded pipeline (offload/safetensors.h): the pipeline reports it
// instead of the process dying of SIGBUS.
TEST(DiffusersFormatChangedOnDiskTest, TruncatedTransformerFileFailsTheRunCleanly) {
  const std::string dir = Fresh("tiny_truncated");
  TinyPipelineOptions options;
  options.weight_seed = 4;
  ASSERT_TRUE(SaveTinyPipeline(options, dir).ok());
  auto pipeline = LoadTinyPipeline(dir, options, /*random_weights=*/false);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  EXPECT_TRUE((*pipeline)->CheckSourceFiles().ok());
  ASSERT_TRUE(Draw(**pipeline).ok());

  const std::string file = dir + "/transformer/diffusion_pytorch_model.safetensors";
  ASSERT_EQ(::truncate(file.c_str(), 0), 0);  // What `cp new old` does first.
  // Caught before the run ...
  absl::Status status = (*pipeline)->CheckSourceFiles();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find("model file '" + file + "' changed on disk after it was loaded (size "),
            std::string::npos)
      << status;
  EXPECT_NE(status.message().find(" → 0); unload and load the pipeline again"), std::string::npos) << status;
  // ... and a run that reads the weights anyway (as one already running would) does not crash: it
  // reads zeros, and the check after it reports the damage.
  (void)Draw(**pipeline);
  status = (*pipeline)->CheckSourceFiles();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition) << status;
  EXPECT_NE(status.message().find(file), std::string::npos) << status;
}

TEST(DiffusersFormatChangedOnDiskTest, FilesRenamedOverKeepServingTheLoadedWeights) {
  const std::string dir = Fresh("tiny_renamed");
  TinyPipelineOptions options;
  options.weight_seed = 4;
  ASSERT_TRUE(SaveTinyPipeline(options, dir).ok());
  auto pipeline = LoadTinyPipeline(dir, options, /*random_weights=*/false);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  auto before = Draw(**pipeline);
  ASSERT_TRUE(before.ok()) << before.status();
  // A new version written beside the old one and renamed over it (SaveTinyPipeline writes each
  // file to a temporary name and renames it): the mapping keeps the old inode.
  TinyPipelineOptions other = options;
  other.weight_seed = 5;
  ASSERT_TRUE(SaveTinyPipeline(other, dir).ok());
  EXPECT_TRUE((*pipeline)->CheckSourceFiles().ok()) << (*pipeline)->CheckSourceFiles();
  auto after = Draw(**pipeline);
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(before->rgb, after->rgb);
}

TEST(DiffusersFormatChangedOnDiskTest, WeightsCopiedAtLoadIgnoreTheFiles) {
  const std::string dir = Fresh("tiny_converted");
  TinyPipelineOptions options;  // float32 on disk.
  ASSERT_TRUE(SaveTinyPipeline(options, dir).ok());
  TinyPipelineOptions bf16 = options;
  bf16.dtype = at::kBFloat16;  // Converted at load: a copy in RAM, no live mapping.
  auto pipeline = LoadTinyPipeline(dir, bf16, /*random_weights=*/false);
  ASSERT_TRUE(pipeline.ok()) << pipeline.status();
  ASSERT_EQ(::truncate((dir + "/transformer/diffusion_pytorch_model.safetensors").c_str(), 0), 0);
  EXPECT_TRUE((*pipeline)->CheckSourceFiles().ok()) << (*pipeline)->CheckSourceFiles();
  EXPECT_TRUE(Draw(**pipeline).ok());
}

}  // namespace
}  // namespace stowage
