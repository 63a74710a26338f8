// Corrupt and inconsistent model directories, loaded through a real server's admin API: every
// numeric field of every component's config.json through zero, negative, huge and fractional
// values; truncated, mislabelled and missing weight files; a model_index naming an unknown class.
// Every load is refused with INVALID_ARGUMENT naming the file or the component's folder (and, for
// the sizes the architecture uses, the field) — or, for a field the architecture does not read, succeeds and
// serves. After every case the server still answers a health check.
#include <dirent.h>
#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "google/protobuf/struct.pb.h"
#include "google/protobuf/util/json_util.h"
#include "tests/e2e/e2e_harness.h"

namespace stowage {
namespace {

// POSIX rather than std::filesystem: torch's pip LibTorch (the GPU host's) exports its own
// std::filesystem symbols, built for another libstdc++, which calls from here would bind to.
bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

void RemoveTree(const std::string& path) {
  ::nftw(path.c_str(), [](const char* p, const struct stat*, int, FTW*) { return ::remove(p); }, 16,
         FTW_DEPTH | FTW_PHYS);
}

void CopyTree(const std::string& from, const std::string& to) {
  ::mkdir(to.c_str(), 0755);
  DIR* dir = ::opendir(from.c_str());
  ASSERT_NE(dir, nullptr) << from;
  while (dirent* entry = ::readdir(dir)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat st;
    ASSERT_EQ(::stat((from + "/" + name).c_str(), &st), 0);
    if (S_ISDIR(st.st_mode)) {
      CopyTree(from + "/" + name, to + "/" + name);
    } else {
      std::ifstream in(from + "/" + name, std::ios::binary);
      std::ofstream out(to + "/" + name, std::ios::binary | std::ios::trunc);
      out << in.rdbuf();
    }
  }
  ::closedir(dir);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
}

// Replaces the first `from` (which must be there) with `to` in the file at `path`.
void ReplaceInFile(const std::string& path, const std::string& from, const std::string& to) {
  std::string text = ReadAll(path);
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << path << " lacks " << from;
  text.replace(at, from.size(), to);
  WriteAll(path, text);
}

// Fields each architecture reads as sizes: a zero, negative or huge value must be refused naming
// the field.
const std::map<std::string, std::set<std::string>>& RequiredFields() {
  static const auto* fields = new std::map<std::string, std::set<std::string>>{
      {"transformer", {"dim", "n_heads", "n_layers", "in_channels", "cap_feat_dim", "all_patch_size", "axes_dims",
                       "axes_lens", "norm_eps", "rope_theta", "t_scale"}},
      {"vae", {"latent_channels", "out_channels", "block_out_channels", "norm_num_groups", "scaling_factor"}},
      {"text_encoder", {"vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps"}},
  };
  return *fields;
}

class ModelDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = std::make_unique<E2eServer>();
    ASSERT_TRUE(server_->ok());
    source_ = "tests/fixtures/zimage_tiny/pipeline";
    ASSERT_TRUE(Exists(source_ + "/model_index.json")) << "fixture missing";
    work_ = std::string(::testing::TempDir()) + "/model_dir_e2e";
    RemoveTree(work_);
    ::mkdir(work_.c_str(), 0755);
  }
  void TearDown() override {
    if (server_ != nullptr && server_->ok()) EXPECT_TRUE(HealthServing(server_->channel()));
  }

  // A fresh copy of the fixture pipeline.
  std::string FreshCopy() {
    const std::string dir = work_ + "/m" + std::to_string(++copies_);
    CopyTree(source_, dir);
    return dir;
  }

  grpc::Status Load(const std::string& dir, const std::string& name, v1::LoadPipelineResponse* loaded) {
    v1::LoadPipelineRequest load;
    load.mutable_pipeline()->set_name(name);
    load.mutable_pipeline()->set_model_dir(dir);
    return server_->admin().LoadPipeline(E2eServer::Authed().get(), load, loaded);
  }

  void Unload(const std::string& name) {
    v1::UnloadPipelineRequest unload;
    unload.set_name(name);
    v1::UnloadPipelineResponse unloaded;
    const grpc::Status s = server_->admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded);
    EXPECT_TRUE(s.ok() || s.error_code() == grpc::NOT_FOUND) << s.error_message();
  }

  std::unique_ptr<E2eServer> server_;
  std::string source_, work_;
  int copies_ = 0;
};

TEST_F(ModelDirTest, EveryNumericConfigFieldThroughZeroNegativeHugeAndFractional) {
  int refused = 0, served = 0;
  for (const std::string component : {"transformer", "vae", "text_encoder"}) {
    const std::string original = ReadAll(source_ + "/" + component + "/config.json");
    google::protobuf::Struct config;
    ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(original, &config).ok());
    for (const auto& [field, value] : config.fields()) {
      const bool is_list = value.has_list_value() && value.list_value().values_size() > 0 &&
                           value.list_value().values(0).has_number_value();
      if (!value.has_number_value() && !is_list) continue;
      for (const double bad : {0.0, -1.0, 1e13, 1.5}) {
        SCOPED_TRACE(component + "." + field + " = " + std::to_string(bad));
        google::protobuf::Struct mutated = config;
        google::protobuf::Value& v = (*mutated.mutable_fields())[field];
        if (is_list) {
          v.mutable_list_value()->mutable_values(0)->set_number_value(bad);
        } else {
          v.set_number_value(bad);
        }
        std::string json;
        ASSERT_TRUE(google::protobuf::util::MessageToJsonString(mutated, &json).ok());
        const std::string dir = FreshCopy();
        WriteAll(dir + "/" + component + "/config.json", json);
        v1::LoadPipelineResponse loaded;
        const std::string name = "m" + std::to_string(copies_);
        const grpc::Status s = Load(dir, name, &loaded);
        const bool required = RequiredFields().at(component).count(field) > 0;
        if (s.ok()) {
          // A field this architecture does not read (or a value it accepts): it must serve.
          EXPECT_FALSE(required && (bad == 0.0 || bad == -1.0 || bad == 1e13))
              << "a required size was accepted";
          const grpc::Status generated = server_->Generate(E2eServer::SmallRequest(name));
          EXPECT_TRUE(generated.ok() || generated.error_code() == grpc::INVALID_ARGUMENT) << generated.error_message();
          ++served;
        } else {
          EXPECT_EQ(s.error_code(), grpc::INVALID_ARGUMENT) << s.error_message();
          // Named: the config file, or the component's folder when its weights disagree with it.
          EXPECT_NE(s.error_message().find("/" + component), std::string::npos) << s.error_message();
          if (required && bad != 1.5) {
            EXPECT_NE(s.error_message().find(field), std::string::npos) << s.error_message();
          }
          EXPECT_LT(s.error_message().size(), 1000u);
          ++refused;
        }
        Unload(name);
        ASSERT_TRUE(HealthServing(server_->channel()));
        RemoveTree(dir);
      }
    }
  }
  EXPECT_GT(refused, 40);
  EXPECT_GT(served, 0);
}

TEST_F(ModelDirTest, BrokenWeightFilesAreRefusedNamingTheFile) {
  struct Case {
    std::string name;
    std::function<void(const std::string& dir)> corrupt;
    std::string needle;
  };
  const std::string weights = "/transformer/diffusion_pytorch_model.safetensors";
  const std::vector<Case> cases = {
      {"truncated", [&](const std::string& dir) { ::truncate((dir + weights).c_str(), 100); }, "diffusion_pytorch_model"},
      {"empty", [&](const std::string& dir) { ::truncate((dir + weights).c_str(), 0); }, "diffusion_pytorch_model"},
      {"garbage header",
       [&](const std::string& dir) {
         std::string bytes = ReadAll(dir + weights);
         for (size_t i = 8; i < 200 && i < bytes.size(); ++i) bytes[i] = '[';
         WriteAll(dir + weights, bytes);
       },
       "diffusion_pytorch_model"},
      {"dtype label disagrees with the span",
       [&](const std::string& dir) { ReplaceInFile(dir + weights, "\"F32\"", "\"F64\""); }, "diffusion_pytorch_model"},
      {"missing", [&](const std::string& dir) { ::unlink((dir + weights).c_str()); }, "transformer"},
      {"unknown class",
       [&](const std::string& dir) {
         ReplaceInFile(dir + "/model_index.json", "ZImagePipeline", std::string(10000, 'Q'));
       },
       "(10000 bytes)"},
      {"model_index is a directory",
       [&](const std::string& dir) {
         ::unlink((dir + "/model_index.json").c_str());
         ::mkdir((dir + "/model_index.json").c_str(), 0755);
       },
       "model_index.json"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = FreshCopy();
    c.corrupt(dir);
    v1::LoadPipelineResponse loaded;
    const std::string name = "b" + std::to_string(copies_);
    const grpc::Status s = Load(dir, name, &loaded);
    EXPECT_FALSE(s.ok());
    EXPECT_TRUE(s.error_code() == grpc::INVALID_ARGUMENT || s.error_code() == grpc::NOT_FOUND)
        << s.error_code() << " " << s.error_message();
    EXPECT_NE(s.error_message().find(c.needle), std::string::npos) << s.error_message();
    EXPECT_LT(s.error_message().size(), 1000u);
    Unload(name);
    ASSERT_TRUE(HealthServing(server_->channel()));
  }
  // And the untouched fixture still loads and serves.
  v1::LoadPipelineResponse loaded;
  ASSERT_TRUE(Load(FreshCopy(), "good", &loaded).ok());
  EXPECT_TRUE(server_->Generate(E2eServer::SmallRequest("good")).ok());
}

// A diffusers-format Flux.1 folder (the committed reference fixture, written by diffusers'
// FluxPipeline.save_pretrained: text_encoder_2 / tokenizer_2, CLIP vocab.json + merges.txt, T5
// spiece.model) loads through the admin API and serves; the same seed gives the same image, another
// prompt another; a negative prompt is refused; broken Flux folders are refused naming the folder.
TEST_F(ModelDirTest, FluxDirectoryLoadsServesAndBrokenOnesAreRefused) {
  source_ = "tests/fixtures/flux_tiny/pipeline";
  ASSERT_TRUE(Exists(source_ + "/model_index.json")) << "fixture missing";
  v1::LoadPipelineResponse loaded;
  const grpc::Status load = Load(FreshCopy(), "flux", &loaded);
  ASSERT_TRUE(load.ok()) << load.error_message();
  EXPECT_NE(loaded.pipeline().description().find("Flux.1 [dev]"), std::string::npos)
      << loaded.pipeline().description();
  v1::GenerateRequest request = E2eServer::SmallRequest("flux", 11);
  request.set_width(80);
  request.set_num_inference_steps(3);
  v1::GenerateResponse a, b, c;
  const grpc::Status first = server_->Generate(request, &a);
  ASSERT_TRUE(first.ok()) << first.error_message();
  EXPECT_EQ(a.width(), 80);
  EXPECT_EQ(a.height(), 64);
  EXPECT_EQ(a.image().substr(1, 3), "PNG");
  ASSERT_TRUE(server_->Generate(request, &b).ok());
  EXPECT_EQ(a.image(), b.image());
  request.set_prompt("a red lantern");
  ASSERT_TRUE(server_->Generate(request, &c).ok());
  EXPECT_NE(a.image(), c.image());
  request.set_negative_prompt("blurry");
  const grpc::Status negative = server_->Generate(request);
  EXPECT_EQ(negative.error_code(), grpc::INVALID_ARGUMENT);
  EXPECT_NE(negative.error_message().find("negative_prompt"), std::string::npos) << negative.error_message();
  Unload("flux");

  struct Case {
    std::string name;
    std::function<void(const std::string& dir)> corrupt;
    std::string needle;
  };
  const std::vector<Case> cases = {
      {"T5 weights missing", [](const std::string& dir) { ::unlink((dir + "/text_encoder_2/model.safetensors").c_str()); },
       "text_encoder_2"},
      {"T5 vocabulary smaller than its tokenizer's ids",
       [](const std::string& dir) {
         ReplaceInFile(dir + "/text_encoder_2/config.json", "\"vocab_size\": 48", "\"vocab_size\": 4");
       },
       "tokenizer_2"},
      {"spiece.model garbage", [](const std::string& dir) { WriteAll(dir + "/tokenizer_2/spiece.model", "not a model"); },
       "tokenizer_2"},
      {"CLIP merges missing", [](const std::string& dir) { ::unlink((dir + "/tokenizer/merges.txt").c_str()); },
       "tokenizer"},
      {"transformer text width disagrees with T5",
       [](const std::string& dir) {
         ReplaceInFile(dir + "/transformer/config.json", "\"joint_attention_dim\": 32", "\"joint_attention_dim\": 48");
       },
       "joint_attention_dim"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string dir = FreshCopy();
    c.corrupt(dir);
    const std::string name = "f" + std::to_string(copies_);
    const grpc::Status s = Load(dir, name, &loaded);
    EXPECT_TRUE(s.error_code() == grpc::INVALID_ARGUMENT || s.error_code() == grpc::NOT_FOUND)  // NOT_FOUND: a missing file.
        << s.error_code() << " " << s.error_message();
    EXPECT_NE(s.error_message().find(c.needle), std::string::npos) << s.error_message();
    EXPECT_LT(s.error_message().size(), 1000u);
    Unload(name);
    ASSERT_TRUE(HealthServing(server_->channel()));
  }
}

}  // namespace
}  // namespace stowage
