// Every architecture config's validator, driven through the same parse functions the loaders use:
// each size field through 0, negative, huge (2^40) and non-divisible values must give
// INVALID_ARGUMENT naming the file and the field (never a SIGFPE, an exception or a huge
// allocation), and messages must not echo the file's content.
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "models/nets/autoencoder_kl.h"
#include "models/core/diffusers_format.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/nets/qwen3_text_encoder.h"
#include "models/pipelines/tiny_models.h"
#include "models/pipelines/tiny_pipeline.h"
#include "models/pipelines/zimage_pipeline.h"
#include "models/nets/zimage_transformer.h"

namespace stowage {
namespace {

// Valid configs (the tiny Z-Image fixture's, tests/fixtures/zimage_tiny, and the tiny pipeline's).
constexpr char kTransformer[] = R"({"_class_name": "ZImageTransformer2DModel", "all_f_patch_size": [1],
  "all_patch_size": [2], "axes_dims": [8, 12, 12], "axes_lens": [512, 64, 64], "cap_feat_dim": 48, "dim": 64,
  "in_channels": 4, "n_heads": 2, "n_kv_heads": 2, "n_layers": 2, "n_refiner_layers": 1, "norm_eps": 1e-05,
  "qk_norm": true, "rope_theta": 256.0, "siglip_feat_dim": null, "t_scale": 1000.0})";
constexpr char kVae[] = R"({"_class_name": "AutoencoderKL", "block_out_channels": [8, 16, 16, 16],
  "latent_channels": 4, "layers_per_block": 1, "mid_block_add_attention": true, "norm_num_groups": 4,
  "out_channels": 3, "scaling_factor": 0.3611, "shift_factor": 0.1159, "use_post_quant_conv": false})";
constexpr char kQwen3[] = R"({"head_dim": 12, "hidden_size": 48, "intermediate_size": 96,
  "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "vocab_size": 406})";
constexpr char kTinyTextEncoder[] = R"({"_class_name": "TinyTextEncoder", "vocab_size": 259, "max_tokens": 128,
  "dim": 64, "heads": 4, "layers": 2})";
constexpr char kTinyDiT[] = R"({"_class_name": "TinyDiT", "in_channels": 4, "patch_size": 2, "dim": 96, "heads": 4,
  "layers": 4, "text_dim": 64, "mlp_ratio": 4, "timestep_dim": 256})";
constexpr char kTinyVae[] = R"({"_class_name": "TinyVaeDecoder", "latent_channels": 4, "groups": 8,
  "scaling_factor": 1.0, "shift_factor": 0.0, "block_out_channels": [64, 48, 32, 32]})";
constexpr char kScheduler[] = R"({"num_train_timesteps": 1000, "shift": 3.0})";

google::protobuf::Struct Json(const std::string& text) {
  auto parsed = ParseJsonObject(text, kConfigJsonLimits, "test");
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return parsed.ok() ? *parsed : google::protobuf::Struct();
}

// `base` with the fields of `overrides` replaced.
google::protobuf::Struct Merged(const std::string& base, const std::string& overrides) {
  google::protobuf::Struct out = Json(base);
  const google::protobuf::Struct changes = Json(overrides);
  for (const auto& [k, v] : changes.fields()) (*out.mutable_fields())[k] = v;
  return out;
}

struct Architecture {
  const char* name;
  const char* base;
  const char* file;
  std::function<absl::Status(const google::protobuf::Struct&, const std::string&)> parse;
};

const std::vector<Architecture>& Architectures() {
  static const auto* all = new std::vector<Architecture>{
      {"zimage_transformer", kTransformer, "/models/z/transformer/config.json",
       [](const auto& j, const auto& f) { return ZImageTransformerConfigFromJson(j, f).status(); }},
      {"autoencoder_kl", kVae, "/models/z/vae/config.json",
       [](const auto& j, const auto& f) { return AutoencoderKLConfigFromJson(j, f).status(); }},
      {"qwen3", kQwen3, "/models/z/text_encoder/config.json",
       [](const auto& j, const auto& f) { return Qwen3ConfigFromJson(j, f).status(); }},
      {"tiny_text_encoder", kTinyTextEncoder, "/models/t/text_encoder/config.json",
       [](const auto& j, const auto& f) { return TinyTextEncoderConfigFromJson(j, {}, f).status(); }},
      {"tiny_dit", kTinyDiT, "/models/t/transformer/config.json",
       [](const auto& j, const auto& f) { return TinyDiTConfigFromJson(j, {}, f).status(); }},
      {"tiny_vae", kTinyVae, "/models/t/vae/config.json",
       [](const auto& j, const auto& f) { return TinyVaeDecoderConfigFromJson(j, {}, f).status(); }},
      {"scheduler", kScheduler, "/models/t/scheduler/scheduler_config.json",
       [](const auto& j, const auto& f) { return FlowMatchSchedulerConfigFromJson(j, {}, f).status(); }},
  };
  return *all;
}

const Architecture& Find(const std::string& name) {
  for (const Architecture& a : Architectures()) {
    if (name == a.name) return a;
  }
  ADD_FAILURE() << "no architecture " << name;
  return Architectures()[0];
}

TEST(ConfigValidationTest, TheValidBaseConfigsParse) {
  for (const Architecture& a : Architectures()) {
    EXPECT_TRUE(a.parse(Json(a.base), a.file).ok()) << a.name << ": " << a.parse(Json(a.base), a.file);
  }
}

struct BadCase {
  const char* architecture;
  const char* overrides;  // JSON object merged into the valid config.
  const char* field;      // The message must start with "<file>: <field>".
};

void PrintTo(const BadCase& c, std::ostream* os) { *os << c.architecture << " " << c.overrides; }

class BadConfigTest : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfigTest, IsInvalidArgumentNamingFileAndField) {
  const BadCase& c = GetParam();
  const Architecture& a = Find(c.architecture);
  const auto start = std::chrono::steady_clock::now();
  const absl::Status status = a.parse(Merged(a.base, c.overrides), a.file);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(1));
  ASSERT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  const std::string message(status.message());
  // "<file>: <field> ...": the check that fired is the one the case is about.
  EXPECT_EQ(message.rfind(std::string(a.file) + ": " + c.field, 0), 0u) << message;
  EXPECT_LT(message.size(), 300u) << message;
}

// A size field through 0, negative, 2^40, a fraction, a number beyond int64 and a string.
#define SIZE_CASES(arch, field)                                      \
  BadCase{arch, "{\"" field "\": 0}", field},                         \
      BadCase{arch, "{\"" field "\": -1}", field},                    \
      BadCase{arch, "{\"" field "\": 1099511627776}", field},         \
      BadCase{arch, "{\"" field "\": 2.5}", field},                   \
      BadCase{arch, "{\"" field "\": 1e300}", field},                 \
      BadCase{arch, "{\"" field "\": \"8\"}", field}

INSTANTIATE_TEST_SUITE_P(
    ZImageTransformer, BadConfigTest,
    ::testing::Values(
        SIZE_CASES("zimage_transformer", "in_channels"), SIZE_CASES("zimage_transformer", "dim"),
        SIZE_CASES("zimage_transformer", "n_heads"), SIZE_CASES("zimage_transformer", "n_layers"),
        SIZE_CASES("zimage_transformer", "cap_feat_dim"),
        BadCase{"zimage_transformer", R"({"n_refiner_layers": -1})", "n_refiner_layers"},
        BadCase{"zimage_transformer", R"({"n_refiner_layers": 1099511627776})", "n_refiner_layers"},
        BadCase{"zimage_transformer", R"({"n_heads": 3})", "n_heads is 3; must be >= 1 and divide dim (64)"},           // 64 % 3.
        BadCase{"zimage_transformer", R"({"n_kv_heads": 1})", "n_kv_heads"},
        BadCase{"zimage_transformer", R"({"n_kv_heads": 0})", "n_kv_heads"},
        BadCase{"zimage_transformer", R"({"all_patch_size": [0]})", "all_patch_size"},
        BadCase{"zimage_transformer", R"({"all_patch_size": [-2]})", "all_patch_size"},
        BadCase{"zimage_transformer", R"({"all_patch_size": [1099511627776]})", "all_patch_size"},
        BadCase{"zimage_transformer", R"({"all_patch_size": []})", "all_patch_size"},
        BadCase{"zimage_transformer", R"({"all_patch_size": 2})", "all_patch_size"},
        BadCase{"zimage_transformer", R"({"all_f_patch_size": [0]})", "all_f_patch_size"},
        BadCase{"zimage_transformer", R"({"all_f_patch_size": [2]})", "all_f_patch_size"},
        BadCase{"zimage_transformer", R"({"axes_dims": [0, 16, 16]})", "axes_dims[0]"},
        BadCase{"zimage_transformer", R"({"axes_dims": [-8, 20, 20]})", "axes_dims[0]"},
        BadCase{"zimage_transformer", R"({"axes_dims": [9, 11, 12]})", "axes_dims[0] is 9; must be even"},  // Odd.
        BadCase{"zimage_transformer", R"({"axes_dims": [8, 12, 14]})", "sum of axes_dims is 34"},     // Sum 34 != 32.
        BadCase{"zimage_transformer", R"({"axes_dims": [16, 16]})", "axes_dims"},
        BadCase{"zimage_transformer", R"({"axes_dims": [1099511627776, 12, 12]})", "axes_dims[0]"},
        BadCase{"zimage_transformer", R"({"axes_lens": [0, 64, 64]})", "axes_lens[0]"},
        BadCase{"zimage_transformer", R"({"axes_lens": [512, 64, 1099511627776]})", "axes_lens[2]"},
        BadCase{"zimage_transformer", R"({"axes_lens": [512, 64]})", "axes_lens"},
        BadCase{"zimage_transformer", R"({"norm_eps": 0})", "norm_eps"},
        BadCase{"zimage_transformer", R"({"norm_eps": -1e-5})", "norm_eps"},
        BadCase{"zimage_transformer", R"({"rope_theta": 0})", "rope_theta"},
        BadCase{"zimage_transformer", R"({"rope_theta": -256})", "rope_theta"},
        BadCase{"zimage_transformer", R"({"rope_theta": 1e300})", "rope_theta"},
        BadCase{"zimage_transformer", R"({"t_scale": 0})", "t_scale"},
        BadCase{"zimage_transformer", R"({"qk_norm": "yes"})", "qk_norm"},
        // Every field valid on its own, the whole far beyond any real model: the parameter bound.
        BadCase{"zimage_transformer", R"({"dim": 524288, "n_heads": 16384, "n_kv_heads": 16384, "n_layers": 1024})", "the config describes"},
        BadCase{"zimage_transformer", R"({"axes_lens": [1048576, 1048576, 1048576], "dim": 393216,
                                          "n_heads": 4, "n_kv_heads": 4, "axes_dims": [32768, 32768, 32768]})", "the config describes"}));

INSTANTIATE_TEST_SUITE_P(
    AutoencoderKL, BadConfigTest,
    ::testing::Values(
        SIZE_CASES("autoencoder_kl", "latent_channels"), SIZE_CASES("autoencoder_kl", "out_channels"),
        SIZE_CASES("autoencoder_kl", "norm_num_groups"),
        BadCase{"autoencoder_kl", R"({"layers_per_block": -1})", "layers_per_block"},
        BadCase{"autoencoder_kl", R"({"layers_per_block": 1099511627776})", "layers_per_block"},
        BadCase{"autoencoder_kl", R"({"norm_num_groups": 3})", "block_out_channels[0] is 8; must be a multiple of norm_num_groups (3)"},  // 8 % 3.
        BadCase{"autoencoder_kl", R"({"block_out_channels": []})", "block_out_channels"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [8, 16, 0, 16]})", "block_out_channels[2]"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [8, 16, -16, 16]})", "block_out_channels[2]"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [8, 16, 16, 18]})", "block_out_channels[3] is 18; must be a multiple"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [8, 1099511627776]})", "block_out_channels[1]"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [8, 8, 8, 8, 8, 8, 8, 8, 8]})", "block_out_channels"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [8, 16.5]})", "block_out_channels"},
        BadCase{"autoencoder_kl", R"({"scaling_factor": 0})", "scaling_factor"},
        BadCase{"autoencoder_kl", R"({"scaling_factor": -0.3})", "scaling_factor"},
        BadCase{"autoencoder_kl", R"({"shift_factor": 1e300})", "shift_factor"},
        BadCase{"autoencoder_kl", R"({"block_out_channels": [1048576, 1048576], "norm_num_groups": 1})",
                "the config describes"}));

INSTANTIATE_TEST_SUITE_P(
    Qwen3, BadConfigTest,
    ::testing::Values(
        SIZE_CASES("qwen3", "vocab_size"), SIZE_CASES("qwen3", "hidden_size"),
        SIZE_CASES("qwen3", "num_hidden_layers"), SIZE_CASES("qwen3", "num_attention_heads"),
        SIZE_CASES("qwen3", "num_key_value_heads"), SIZE_CASES("qwen3", "head_dim"),
        SIZE_CASES("qwen3", "intermediate_size"),
        BadCase{"qwen3", R"({"num_hidden_layers": 1})", "num_hidden_layers"},
        BadCase{"qwen3", R"({"num_key_value_heads": 3})", "num_key_value_heads is 3; must be >= 1 and divide"},  // 4 % 3.
        BadCase{"qwen3", R"({"head_dim": 13})", "head_dim is 13; must be even"},                       // Odd.
        BadCase{"qwen3", R"({"rms_norm_eps": 0})", "rms_norm_eps"},
        BadCase{"qwen3", R"({"rope_theta": -1})", "rope_theta"},
        BadCase{"qwen3", R"({"vocab_size": 1048576, "hidden_size": 1048576})", "the config describes"}));

INSTANTIATE_TEST_SUITE_P(
    TinyModels, BadConfigTest,
    ::testing::Values(
        SIZE_CASES("tiny_text_encoder", "vocab_size"), SIZE_CASES("tiny_text_encoder", "max_tokens"),
        SIZE_CASES("tiny_text_encoder", "dim"), SIZE_CASES("tiny_text_encoder", "heads"),
        BadCase{"tiny_text_encoder", R"({"vocab_size": 258})", "vocab_size"},
        BadCase{"tiny_text_encoder", R"({"max_tokens": 2})", "max_tokens"},
        BadCase{"tiny_text_encoder", R"({"heads": 3})", "heads is 3; must be >= 1 and divide dim (64)"},
        BadCase{"tiny_text_encoder", R"({"layers": -1})", "layers"},
        BadCase{"tiny_text_encoder", R"({"layers": 1099511627776})", "layers"},
        SIZE_CASES("tiny_dit", "in_channels"), SIZE_CASES("tiny_dit", "patch_size"), SIZE_CASES("tiny_dit", "dim"),
        SIZE_CASES("tiny_dit", "heads"), SIZE_CASES("tiny_dit", "text_dim"), SIZE_CASES("tiny_dit", "mlp_ratio"),
        SIZE_CASES("tiny_dit", "timestep_dim"),
        BadCase{"tiny_dit", R"({"heads": 5})", "heads is 5; must be >= 1 and divide dim (96)"},  // 96 % 5.
        BadCase{"tiny_dit", R"({"timestep_dim": 255})", "timestep_dim is 255; must be even"},
        BadCase{"tiny_dit", R"({"layers": -1})", "layers"},
        BadCase{"tiny_dit", R"({"dim": 1048576, "heads": 1, "layers": 1024})", "the config describes"},
        SIZE_CASES("tiny_vae", "latent_channels"), SIZE_CASES("tiny_vae", "groups"),
        BadCase{"tiny_vae", R"({"groups": 5})", "block_out_channels[0] is 64; must be a multiple of groups (5)"},
        BadCase{"tiny_vae", R"({"block_out_channels": [64]})", "block_out_channels"},
        BadCase{"tiny_vae", R"({"block_out_channels": [64, 0]})", "block_out_channels[1]"},
        BadCase{"tiny_vae", R"({"block_out_channels": [64, 1099511627776]})", "block_out_channels[1]"},
        BadCase{"tiny_vae", R"({"scaling_factor": 0})", "scaling_factor"},
        SIZE_CASES("scheduler", "num_train_timesteps"),
        BadCase{"scheduler", R"({"shift": 0})", "shift"},
        BadCase{"scheduler", R"({"shift": -3})", "shift"}));

// --- Messages do not echo the file ---------------------------------------------------------------

std::string WriteFile(const std::string& dir, const std::string& name, const std::string& text) {
  ::mkdir(dir.c_str(), 0755);
  const std::string path = dir + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(ConfigValidationTest, MessagesDoNotQuoteFileContent) {
  const std::string dir = std::string(::testing::TempDir()) + "/secret";
  constexpr char kSecret[] = "sk-live-SECRET-0123456789";
  // A field of the wrong type holding a secret-looking string.
  const std::string wrong_type = WriteFile(dir, "a.json", std::string(R"({"dim": ")") + kSecret + R"("})");
  auto json = ReadJsonFile(wrong_type);
  ASSERT_TRUE(json.ok()) << json.status();
  absl::Status s = ZImageTransformerConfigFromJson(*json, wrong_type).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()).find("SECRET"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("dim"), std::string::npos) << s;
  // Malformed JSON around a secret: protobuf's parser quotes the input; our message must not.
  const std::string malformed =
      WriteFile(dir, "b.json", std::string(R"({"token": ")") + kSecret + R"(", "dim": 64,, })");
  s = ReadJsonFile(malformed).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(std::string(s.message()).find("SECRET"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find(malformed), std::string::npos) << s;
  // A wrong _class_name is named, but cut short.
  const std::string long_class = std::string(10000, 'C') + kSecret;
  auto tiny = Merged(kTinyDiT, R"({"_class_name": ")" + long_class + R"("})");
  const std::string tdir = std::string(::testing::TempDir()) + "/long_class";
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), tdir).ok());
  ASSERT_TRUE(WriteJsonFile(tdir + "/transformer/config.json", tiny).ok());
  s = LoadTinyPipeline(tdir, TinyPipelineOptions(), /*random_weights=*/true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_EQ(std::string(s.message()).find("SECRET"), std::string::npos);
  EXPECT_LT(s.message().size(), 400u) << s;
}

TEST(ConfigValidationTest, DeeplyNestedConfigIsRefusedFast) {
  const std::string dir = std::string(::testing::TempDir()) + "/deep";
  const std::string path = WriteFile(dir, "config.json", "{\"a\": " + std::string(100000, '[') + "}");
  const auto start = std::chrono::steady_clock::now();
  const absl::Status s = ReadJsonFile(path).status();
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(500));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("nests deeper than 32"), std::string::npos) << s;
  // 32 levels is fine (the parser then reports whatever else is wrong).
  const std::string ok = WriteFile(dir, "ok.json", "{\"a\": " + std::string(31, '[') + std::string(31, ']') + "}");
  EXPECT_TRUE(ReadJsonFile(ok).ok()) << ReadJsonFile(ok).status();
}

TEST(ConfigValidationTest, OversizeJsonIsRefusedBeforeReading) {
  const std::string dir = std::string(::testing::TempDir()) + "/big";
  const std::string path = WriteFile(dir, "config.json", "{\"a\": \"" + std::string(2000, 'x') + "\"}");
  const absl::Status s = ReadJsonFile(path, JsonLimits{32, 1000}).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("exceeds the limit of 1000 bytes"), std::string::npos) << s;
}

TEST(ConfigValidationTest, ShardIndexNamesOnlyFilesOfTheFolder) {
  const std::string dir = std::string(::testing::TempDir()) + "/shards";
  for (const char* shard : {"../../etc/passwd.safetensors", "/abs.safetensors", "x.bin", "", "sub/x.safetensors"}) {
    WriteFile(dir, "diffusion_pytorch_model.safetensors.index.json",
              std::string(R"({"weight_map": {"w": ")") + shard + R"("}})");
    const absl::Status s = ReadComponentWeights(dir).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << shard << ": " << s;
    EXPECT_NE(std::string(s.message()).find("weight_map entry of tensor 'w'"), std::string::npos) << s;
  }
}

// --- Loaders and built-in constructors validate before building ----------------------------------

TEST(ConfigValidationTest, TinyPipelineLoaderRefusesZeroHeadsAndMismatchedComponents) {
  const std::string dir = std::string(::testing::TempDir()) + "/tiny_bad";
  ASSERT_TRUE(SaveTinyPipeline(TinyPipelineOptions(), dir).ok());
  ASSERT_TRUE(WriteJsonFile(dir + "/transformer/config.json", Merged(kTinyDiT, R"({"heads": 0})")).ok());
  absl::Status s = LoadTinyPipeline(dir, TinyPipelineOptions(), /*random_weights=*/true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(dir + "/transformer/config.json: heads is 0"), std::string::npos) << s;
  ASSERT_TRUE(WriteJsonFile(dir + "/transformer/config.json", Merged(kTinyDiT, R"({"in_channels": 8})")).ok());
  s = LoadTinyPipeline(dir, TinyPipelineOptions(), /*random_weights=*/true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("in_channels is 8; must equal the vae's latent_channels (4)"),
            std::string::npos) << s;
  ASSERT_TRUE(WriteJsonFile(dir + "/transformer/config.json", Json(kTinyDiT)).ok());
  ASSERT_TRUE(WriteJsonFile(dir + "/scheduler/scheduler_config.json",
                            Json(R"({"num_train_timesteps": 0, "shift": 3.0})")).ok());
  s = LoadTinyPipeline(dir, TinyPipelineOptions(), /*random_weights=*/true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("num_train_timesteps is 0"), std::string::npos) << s;
}

TEST(ConfigValidationTest, BuiltInConstructorsValidateTheirConfigs) {
  TinyPipelineOptions options;
  options.transformer.heads = 0;
  absl::Status s = CreateTinyPipeline(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("heads is 0"), std::string::npos) << s;
  options = TinyPipelineOptions();
  options.vae.groups = 7;
  s = CreateTinyPipeline(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  options = TinyPipelineOptions();
  options.transformer.text_dim = 32;
  s = CreateTinyPipeline(options).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("text_dim is 32; must equal the text encoder's dim (64)"),
            std::string::npos) << s;
  ZImagePipelineOptions zimage;
  zimage.scheduler_shift = 0.0;
  s = CreateTinyZImagePipeline(zimage).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

// A Z-Image directory with only configs and a tokenizer (random-weights mode reads nothing else).
std::string WriteZImageDir(const std::string& name) {
  const std::string dir = std::string(::testing::TempDir()) + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  WriteFile(dir, "model_index.json",
            R"({"_class_name": "ZImagePipeline", "transformer": ["diffusers", "ZImageTransformer2DModel"],
                "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "Qwen3Model"]})");
  WriteFile(dir + "/transformer", "config.json", kTransformer);
  WriteFile(dir + "/vae", "config.json", kVae);
  WriteFile(dir + "/text_encoder", "config.json", kQwen3);
  WriteFile(dir + "/tokenizer", "tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 405}}})");
  return dir;
}

TEST(ConfigValidationTest, ZImageLoaderValidatesEachConfigAndTheirAgreement) {
  ZImagePipelineOptions options;
  options.dtype = at::kFloat;
  const std::string dir = WriteZImageDir("zimage_ok");
  auto ok = LoadZImagePipeline(dir, options, /*random_weights=*/true);
  ASSERT_TRUE(ok.ok()) << ok.status();

  // n_heads 0 used to kill the process with SIGFPE (dim / n_heads).
  const std::string zero = WriteZImageDir("zimage_zero_heads");
  WriteFile(zero + "/transformer", "config.json", R"({"dim": 64, "n_heads": 0, "n_kv_heads": 0})");
  absl::Status s = LoadZImagePipeline(zero, options, true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find(zero + "/transformer/config.json: n_heads is 0"), std::string::npos) << s;

  const std::string cap = WriteZImageDir("zimage_cap");
  ASSERT_TRUE(WriteJsonFile(cap + "/text_encoder/config.json", Merged(kQwen3, R"({"hidden_size": 64})")).ok());
  s = LoadZImagePipeline(cap, options, true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("cap_feat_dim is 48; must equal the text encoder's hidden_size (64)"),
            std::string::npos) << s;

  const std::string latent = WriteZImageDir("zimage_latent");
  ASSERT_TRUE(WriteJsonFile(latent + "/vae/config.json", Merged(kVae, R"({"latent_channels": 16})")).ok());
  s = LoadZImagePipeline(latent, options, true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("in_channels is 4; must equal the vae's latent_channels (16)"),
            std::string::npos) << s;

  const std::string vocab = WriteZImageDir("zimage_vocab");
  WriteFile(vocab + "/tokenizer", "tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 406}}})");
  s = LoadZImagePipeline(vocab, options, true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("outside the text encoder's vocab_size (406)"), std::string::npos) << s;

  const std::string sched = WriteZImageDir("zimage_sched");
  WriteFile(sched + "/scheduler", "scheduler_config.json", R"({"shift": -1})");
  s = LoadZImagePipeline(sched, options, true).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(std::string(s.message()).find("scheduler_config.json: shift is -1"), std::string::npos) << s;
}

}  // namespace
}  // namespace stowage
