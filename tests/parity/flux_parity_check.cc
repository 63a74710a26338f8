// flux_parity_check FIXTURE_DIR: compares the C++ Flux.1 components and pipeline with the reference
// outputs tests/parity/make_flux_fixtures.py wrote from diffusers, transformers, tokenizers and
// sentencepiece. One line per check; exits non-zero when any exceeds its tolerance (relative L2
// error <= 1e-5 in float32, --bf16_tolerance in bfloat16; identical token ids; images within one
// 8-bit level).
#include <cstdio>
#include <functional>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/marshalling.h"
#include "base/status_macros.h"
#include "models/nets/clip_text_encoder.h"
#include "models/tokenizers/clip_tokenizer.h"
#include "models/core/diffusers_format.h"
#include "models/core/lora.h"
#include "models/pipelines/flux_pipeline.h"
#include "models/nets/flux_transformer.h"
#include "models/nets/t5_encoder.h"
#include "models/tokenizers/t5_tokenizer.h"
#include "tests/parity/edit_parity.h"
#include "tests/parity/parity_common.h"

// As in zimage_parity_check: 1e-2 where both sides run the same LibTorch (the GPU host); Debian's
// LibTorch 1.13 rounds bfloat16 differently, so CI passes a bound measured against that rounding
// noise (flux_parity_test.sh), and each bfloat16 output must also be no further from the float32
// reference than the reference's own bfloat16 output is (x1.25).
ABSL_FLAG(double, bf16_tolerance, 1e-2, "Relative error allowed between our and the reference's bfloat16 output");
ABSL_FLAG(std::vector<std::string>, skip, {}, "Checks not to run (names as printed in main's list)");

namespace stowage {
namespace {

using parity::Build;
using parity::ReadAll;
using parity::RelativeError;
using parity::Report;

const std::vector<std::string> kPrompts = {"a red lantern", "A Photo of TWO cats,  sitting on a mat!"};

// Reports `got` against the reference's output in `dtype`, and in reduced precision also its
// distance from the float32 reference against the reference's own.
void ReportOutput(const std::string& what, const std::string& dtype_name, const at::Tensor& got,
                  const std::map<std::string, at::Tensor>& io, double tolerance) {
  Report(what + " " + dtype_name, RelativeError(got, io.at("output_" + dtype_name)), tolerance);
  if (dtype_name != "float32") {
    const double reference_noise = RelativeError(io.at("output_" + dtype_name), io.at("output_float32"));
    std::printf("  (the reference's own %s output is %.3g from its float32 output)\n", dtype_name.c_str(),
                reference_noise);
    Report(what + " " + dtype_name + " vs float32", RelativeError(got, io.at("output_float32")),
           1.25 * reference_noise);
  }
}

std::vector<std::tuple<std::string, at::ScalarType, double>> Precisions() {
  return {{"float32", at::kFloat, 1e-5}, {"bfloat16", at::kBFloat16, absl::GetFlag(FLAGS_bf16_tolerance)}};
}

absl::Status CheckTransformer(const std::string& root, const std::string& variant) {
  const std::string dir = root + "/transformer_" + variant;
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(dir + "/config.json"));
  ASSIGN_OR_RETURN(FluxTransformerConfig config, FluxTransformerConfigFromJson(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/transformer_" + variant + "_io.safetensors"));
  for (const auto& [name, dtype, tolerance] : Precisions()) {
    ASSIGN_OR_RETURN(auto model, Build<FluxTransformer>(config, dir, dtype));
    const at::Tensor out =
        model->Forward(io.at("hidden").to(dtype), io.at("text").to(dtype), io.at("pooled").to(dtype),
                       io.at("timestep").to(dtype), io.at("img_ids"), io.at("txt_ids"),
                       config.guidance_embeds ? io.at("guidance") : at::Tensor());
    ReportOutput("transformer [" + variant + "]", name, out, io, tolerance);
  }
  return absl::OkStatus();
}

// The LoRA fixture (make_lora_fixtures.py --arch flux): a PEFT adapter on the [dev] transformer
// fixture (every attention projection of both streams, the feed-forwards, the single blocks' MLP and
// output projections) in the diffusers layout, applied unmerged at scales 1 and 0.5, and off.
absl::Status CheckLora(const std::string& root) {
  const std::string dir = root + "/transformer_dev";
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(dir + "/config.json"));
  ASSIGN_OR_RETURN(FluxTransformerConfig config, FluxTransformerConfigFromJson(json, dir + "/config.json"));
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/transformer_dev_io.safetensors"));
  ASSIGN_OR_RETURN(auto expected, ReadAll(root + "/lora_io.safetensors"));
  ASSIGN_OR_RETURN(auto adapter_config, ReadJsonFile(root + "/lora/adapter_config.json"));
  const float alpha = static_cast<float>(adapter_config.fields().at("lora_alpha").number_value());
  ASSIGN_OR_RETURN(LoraFile file, ReadLoraFile(root + "/lora/adapter.safetensors", "transformer", alpha));
  ASSIGN_OR_RETURN(auto model, Build<FluxTransformer>(config, dir, at::kFloat));
  ASSIGN_OR_RETURN(const int attached, parity::AttachLoraLayers(*model, file, "transformer", "default"));
  std::printf("  (%d layers adapted, rank %lld, alpha %g)\n", attached, static_cast<long long>(file.rank), alpha);
  for (const auto& [name, scale] : std::vector<std::pair<std::string, float>>{{"scale1", 1.0f}, {"scale05", 0.5f},
                                                                            {"off", 0.0f}}) {
    const LoraScales scales = {{"default", scale}};
    const ScopedLoras active(&scales);
    const at::Tensor out = model->Forward(io.at("hidden"), io.at("text"), io.at("pooled"), io.at("timestep"),
                                          io.at("img_ids"), io.at("txt_ids"), io.at("guidance"));
    Report("lora " + name + " float32", RelativeError(out, expected.at("output_" + name)), 1e-5);
  }
  return absl::OkStatus();
}

absl::Status CheckDev(const std::string& root) { return CheckTransformer(root, "dev"); }
absl::Status CheckSchnell(const std::string& root) { return CheckTransformer(root, "schnell"); }

absl::Status CheckClip(const std::string& root) {
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(root + "/clip/config.json"));
  ASSIGN_OR_RETURN(ClipTextConfig config, ClipTextConfigFromJson(json, root + "/clip/config.json"));
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/clip_io.safetensors"));
  ASSIGN_OR_RETURN(auto clip, Build<ClipTextEncoder>(config, root + "/clip", at::kFloat,
                                                     {"text_model.embeddings.position_ids"}));
  const ClipTextEncoder::Output out = clip->Forward(io.at("ids").unsqueeze(0));
  Report("clip last_hidden_state float32", RelativeError(out.last_hidden_state[0], io.at("last_hidden_state")), 1e-5);
  Report("clip pooled float32", RelativeError(out.pooled[0], io.at("pooled")), 1e-5);
  return absl::OkStatus();
}

absl::Status CheckT5(const std::string& root) {
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(root + "/t5/config.json"));
  ASSIGN_OR_RETURN(T5Config config, T5ConfigFromJson(json, root + "/t5/config.json"));
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/t5_io.safetensors"));
  for (const auto& [name, dtype, tolerance] : Precisions()) {
    ASSIGN_OR_RETURN(auto t5, Build<T5Encoder>(config, root + "/t5", dtype, {"encoder.embed_tokens."}));
    ReportOutput("t5 last_hidden_state", name, t5->Forward(io.at("ids").unsqueeze(0))[0], io, tolerance);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> Ids(const google::protobuf::Struct& json, const std::string& tokenizer,
                                         const std::string& prompt) {
  const auto& by_prompt = json.fields().at(tokenizer).struct_value().fields();
  if (by_prompt.count(prompt) == 0) return absl::NotFoundError("no ids for '" + prompt + "'");
  std::vector<int64_t> ids;
  for (const auto& v : by_prompt.at(prompt).list_value().values()) ids.push_back(static_cast<int64_t>(v.number_value()));
  return ids;
}

// The ids of both of the pipeline's prompts from `tokenizer` ("clip" or "t5") against the reference's.
absl::Status CheckIds(const std::string& root, const std::string& tokenizer,
                      const std::function<absl::StatusOr<std::vector<int64_t>>(const std::string&)>& encode) {
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(root + "/pipeline_token_ids.json"));
  int mismatches = 0;
  for (const std::string& prompt : kPrompts) {
    ASSIGN_OR_RETURN(std::vector<int64_t> want, Ids(json, tokenizer, prompt));
    ASSIGN_OR_RETURN(std::vector<int64_t> got, encode(prompt));
    if (got != want) {
      ++mismatches;
      std::printf("  %s ids differ on '%s'\n", tokenizer.c_str(), prompt.c_str());
    }
  }
  Report(tokenizer + " tokenizer ids (pipeline prompts)", mismatches, 0);
  return absl::OkStatus();
}

absl::Status CheckClipTokenizer(const std::string& root) {
  ASSIGN_OR_RETURN(auto clip, ClipTokenizer::Load(root + "/pipeline/tokenizer"));
  return CheckIds(root, "clip", [&](const std::string& prompt) { return clip->Encode(prompt, 77); });
}

absl::Status CheckT5Tokenizer(const std::string& root) {
  ASSIGN_OR_RETURN(auto t5, T5Tokenizer::Load(root + "/pipeline/tokenizer_2"));
  return CheckIds(root, "t5", [&](const std::string& prompt) { return t5->Encode(prompt, 32); });
}

absl::Status CheckPipeline(const std::string& root) {
  FluxPipelineOptions options;
  options.dtype = at::kFloat;
  options.max_sequence_length = 32;  // As the fixture's pipeline call.
  ASSIGN_OR_RETURN(auto pipeline, LoadFluxPipeline(root + "/pipeline", options, /*random_weights=*/false));
  ASSIGN_OR_RETURN(auto io, ReadAll(root + "/pipeline_io.safetensors"));
  parity::HostRunner runner;
  for (size_t k = 0; k < kPrompts.size(); ++k) {
    GenerationParams p;
    p.prompt = kPrompts[k];
    p.width = 48;
    p.height = 64;
    p.steps = 3;
    p.guidance_scale = 3.5f;
    p.seed = 11;
    RunContext context(nullptr, nullptr);
    ASSIGN_OR_RETURN(Image image, pipeline->Run(p, runner, context));
    const at::Tensor got = parity::ImageAsTensor(image);
    const at::Tensor want = io.at("image_" + std::to_string(k));
    Report("pipeline image " + std::to_string(k) + " (max abs)", (got - want).abs().max().item<double>(),
           1.0 / 255 + 1e-4);
  }
  return absl::OkStatus();
}

// Image to image and inpainting (make_edit_fixtures.py) through the whole tiny pipeline.
absl::Status CheckEdit(const std::string& root) {
  FluxPipelineOptions options;
  options.dtype = at::kFloat;
  options.max_sequence_length = 32;  // As the fixture's pipeline calls.
  ASSIGN_OR_RETURN(auto pipeline, LoadFluxPipeline(root + "/pipeline", options, /*random_weights=*/false));
  RETURN_IF_ERROR(parity::CheckEncoder(root));
  return parity::CheckEdits(root, *pipeline);
}

}  // namespace
}  // namespace stowage

int main(int argc, char** argv) {
  const std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2 || !(absl::GetFlag(FLAGS_bf16_tolerance) > 0)) {
    std::fprintf(stderr, "usage: flux_parity_check FIXTURE_DIR [--bf16_tolerance=X > 0]\n");
    return 2;
  }
  c10::InferenceMode guard;
  std::vector<std::pair<std::string, absl::Status (*)(const std::string&)>> checks = {
      {"transformer [dev]", stowage::CheckDev},   {"transformer [schnell]", stowage::CheckSchnell},
      {"clip", stowage::CheckClip},               {"t5", stowage::CheckT5},
      {"clip tokenizer", stowage::CheckClipTokenizer}, {"t5 tokenizer", stowage::CheckT5Tokenizer},
      {"pipeline", stowage::CheckPipeline},       {"edit", stowage::CheckEdit},
      {"lora", stowage::CheckLora}};
  for (const std::string& name : absl::GetFlag(FLAGS_skip)) {
    const auto it = std::find_if(checks.begin(), checks.end(), [&](const auto& c) { return c.first == name; });
    if (it == checks.end()) {
      std::fprintf(stderr, "--skip: no check named '%s'\n", name.c_str());
      return 2;
    }
    std::printf("%-34s skipped\n", name.c_str());
    checks.erase(it);
  }
  return stowage::parity::RunChecks(args[1], checks);
}
