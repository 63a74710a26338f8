#include "models/pipelines/zimage_pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <functional>
#include <optional>

#include "absl/strings/str_cat.h"
#include "models/tokenizers/bpe_tokenizer.h"
#include "models/pipelines/component_factory.h"
#include "models/core/config_checks.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/pipelines/denoise.h"
#include "models/core/diffusers_format.h"
#include "models/core/weight_init.h"
#include "base/status_macros.h"

namespace stowage {
namespace {

class ZImagePipeline : public Pipeline {
 public:
  ZImagePipeline(const ZImagePipelineOptions& options, std::unique_ptr<BpeTokenizer> tokenizer,
                 std::shared_ptr<Component> text_encoder, std::shared_ptr<Component> vae_encoder,
                 std::shared_ptr<Component> transformer, std::shared_ptr<Component> vae)
      : options_(options),
        tokenizer_(std::move(tokenizer)),
        text_encoder_(std::move(text_encoder)),
        vae_encoder_(std::move(vae_encoder)),
        transformer_(std::move(transformer)),
        vae_(std::move(vae)) {
    limits_.default_width = static_cast<int>(options.default_size);
    limits_.default_height = static_cast<int>(options.default_size);
    limits_.min_size = 64;
    limits_.max_size = 2048;
    // Latents are upscale() times smaller than the image and cut into patch_size patches.
    limits_.size_multiple =
        static_cast<int>(static_cast<AutoencoderKLDecoder&>(vae_->module()).upscale() *
                         static_cast<ZImageTransformer&>(transformer_->module()).config().patch_size);
    limits_.default_steps = 8;
    limits_.max_steps = 100;
    limits_.default_guidance_scale = 0.0f;  // Turbo: no guidance.
    limits_.max_prompt_bytes = 4096;        // Tokens beyond max_sequence_length are cut, as diffusers does.
    limits_.accepts_images = true;
    limits_.mixes_adapters = true;
  }

  static bool Guided(const GenerationParams& params) { return params.guidance_scale > 0.0f; }

  const std::string& name() const override { return options_.name; }
  std::string description() const override {
    return "Z-Image (S3-DiT transformer, Qwen3 text encoder, Flux VAE), diffusers-compatible weights";
  }
  const PipelineLimits& limits() const override { return limits_; }
  std::vector<Component*> components() override {
    return {text_encoder_.get(), vae_encoder_.get(), transformer_.get(), vae_.get()};
  }

  bool batched() const override { return true; }

  absl::StatusOr<Image> Run(const GenerationParams& params, ComponentRunner& runner,
                            RunContext& context) override {
    // Alone is a batch of one: the same code path as a batched request, so the two agree.
    return std::move(RunBatch({BatchMember{&params, &context}}, runner).front());
  }

  std::vector<absl::StatusOr<Image>> RunBatch(const std::vector<BatchMember>& members,
                                              ComponentRunner& runner) override {
    c10::InferenceMode inference_mode;
    // The denoising loop runs where the transformer is; the encoder and decoder may sit elsewhere.
    const c10::Device device = runner.DeviceOf(*transformer_, options_.device);
    const c10::Device encoder_device = runner.DeviceOf(*text_encoder_, options_.device);
    BatchRun run(members);
    if (members.empty() || !run.Compatible(limits_.mixes_adapters)) return run.TakeResults();
    const std::vector<size_t>& active = run.active();  // Shrinks as members leave (run.Filter).
    // The members' adapters as the caller installed them, one row each (null: the same for all).
    const LoraRows* member_rows = ActiveLoraRows();

    // Tokenize: positive (and, when guided, negative) ids per member.
    run.BeginStage("tokenize", 0);
    std::vector<at::Tensor> positive_ids(members.size()), negative_ids(members.size());
    auto template_ids = [&](const std::string& text) -> absl::StatusOr<at::Tensor> {
      ASSIGN_OR_RETURN(std::vector<int64_t> ids,
                       tokenizer_->Encode(absl::StrCat("<|im_start|>user\n", text, "<|im_end|>\n<|im_start|>assistant\n")));
      if (static_cast<int64_t>(ids.size()) > options_.max_sequence_length) ids.resize(options_.max_sequence_length);
      return at::tensor(ids).to(encoder_device);
    };
    run.Filter([&](size_t i) -> absl::Status {
      const GenerationParams& params = *members[i].params;
      ASSIGN_OR_RETURN(positive_ids[i], template_ids(params.prompt));
      if (Guided(params)) {
        ASSIGN_OR_RETURN(negative_ids[i], template_ids(params.negative_prompt));
      }
      return absl::OkStatus();
    });

    // Encode every member's prompts while the text encoder is placed once.
    run.BeginStage("encode_prompt", 0);
    std::vector<at::Tensor> positive(members.size()), negative(members.size());
    auto& encoder = static_cast<Qwen3TextEncoder&>(text_encoder_->module());
    if (!active.empty()) {
      runner.Prefetch(*transformer_);  // Its first groups copy while the prompts encode.
      const absl::Status encoded = runner.Run(*text_encoder_, [&] {
        for (size_t i : active) {
          const ScopedLoraRow row(i);  // Its own adapters (no-op when all share them).
          positive[i] = encoder.Forward(positive_ids[i]);
          if (Guided(*members[i].params)) negative[i] = encoder.Forward(negative_ids[i]);
        }
      });
      run.Filter([&](size_t) { return encoded; });
      for (size_t i : active) {
        positive[i] = positive[i].to(device);
        if (negative[i].defined()) negative[i] = negative[i].to(device);
      }
    }
    run.Filter([&](size_t i) { return members[i].context->CheckInterrupt(); });

    auto& vae = static_cast<AutoencoderKLDecoder&>(vae_->module());
    auto& dit = static_cast<ZImageTransformer&>(transformer_->module());
    const GenerationParams& shape = *members.front().params;
    DenoiseFamily family;
    family.transformer = transformer_.get();
    family.vae = vae_.get();
    family.vae_encoder = vae_encoder_.get();
    family.default_device = options_.device;
    family.device = device;
    family.latent_dtype = at::kFloat;  // Latents stay float32 between steps, as diffusers' Z-Image keeps them.
    family.latent_height = shape.height / vae.upscale();
    family.latent_width = shape.width / vae.upscale();
    family.sigmas = ShiftedSigmas(shape.steps, options_.scheduler_shift);
    // Latents are [C, 1, h, w] (one frame).
    family.draw_noise = [&](at::Generator& generator) {
      return at::randn({dit.config().in_channels, 1, family.latent_height, family.latent_width}, generator,
                       at::TensorOptions().dtype(at::kFloat))
          .to(device);
    };
    family.image_to_layout = [](const at::Tensor& x) { return x.transpose(0, 1); };
    family.mask_to_layout = [](const at::Tensor& mask) { return mask; };  // [1, 1, h, w] broadcasts.
    // One transformer forward over every running member's positive (and, guided, negative) sequence.
    family.forward = [&](int step, const std::vector<size_t>& running, const std::vector<at::Tensor>& latents,
                         std::vector<at::Tensor>* velocities) -> absl::Status {
      const float t_train = family.sigmas[step] * 1000.0f;
      const double t_model = (1000.0f - t_train) / 1000.0f;
      std::vector<at::Tensor> xs, captions;
      LoraRows rows;  // The adapters of each batch row (a guided member's two rows share its own).
      for (size_t i : running) {
        const at::Tensor x = latents[i].to(options_.dtype);
        xs.push_back(x);
        captions.push_back(positive[i]);
        if (member_rows != nullptr) rows.push_back((*member_rows)[i]);
        if (Guided(*members[i].params)) {
          xs.push_back(x);
          captions.push_back(negative[i]);
          if (member_rows != nullptr) rows.push_back((*member_rows)[i]);
        }
      }
      std::vector<at::Tensor> out;
      std::optional<ScopedLoraRows> lora_rows;
      if (member_rows != nullptr) lora_rows.emplace(&rows);
      RETURN_IF_ERROR(runner.Run(*transformer_, [&] { out = dit.ForwardBatch(xs, t_model, captions); }));
      size_t k = 0;
      for (size_t r = 0; r < running.size(); ++r) {
        const GenerationParams& params = *members[running[r]].params;
        const at::Tensor pos = out[k++].to(at::kFloat);
        at::Tensor velocity = pos;
        if (Guided(params)) {
          const at::Tensor neg = out[k++].to(at::kFloat);
          velocity = pos + params.guidance_scale * (pos - neg);
        }
        (*velocities)[r] = -velocity;  // The model predicts the negated velocity.
      }
      return absl::OkStatus();
    };
    const c10::Device vae_device = runner.DeviceOf(*vae_, options_.device);
    family.decode = [&](const at::Tensor& x) {
      return vae.Decode(x.squeeze(1).unsqueeze(0).to(vae_device).to(vae_->dtype()));
    };
    Denoise(members, runner, run, family);
    return run.TakeResults();
  }

 private:
  ZImagePipelineOptions options_;
  PipelineLimits limits_;
  std::unique_ptr<BpeTokenizer> tokenizer_;
  std::shared_ptr<Component> text_encoder_;
  std::shared_ptr<Component> vae_encoder_;
  std::shared_ptr<Component> transformer_;
  std::shared_ptr<Component> vae_;
};

// What the components assume of each other: the transformer reads the text encoder's features and
// denoises the VAE's latents. `where` (the transformer's config) is named in errors.
absl::Status ValidateComponents(const ZImageTransformerConfig& tc, const AutoencoderKLConfig& vc, const Qwen3Config& qc,
                                const std::string& where) {
  ConfigCheck check(where);
  check.Equals("cap_feat_dim", tc.cap_feat_dim, "the text encoder's hidden_size", qc.hidden_size)
      .Equals("in_channels", tc.in_channels, "the vae's latent_channels", vc.latent_channels);
  return check.status();
}

// The default image size must be one that requests may ask for: a multiple of the VAE's upscale
// factor times the transformer's patch size.
absl::Status CheckDefaultSize(int64_t size, const ZImageTransformerConfig& tc, const AutoencoderKLConfig& vc) {
  if (vc.block_out_channels.empty() || vc.block_out_channels.size() > 16) return absl::OkStatus();  // Validate() says why.
  const int64_t multiple = (int64_t{1} << (vc.block_out_channels.size() - 1)) * tc.patch_size;
  if (multiple > 0 && size % multiple != 0) {
    return absl::InvalidArgumentError(absl::StrCat("default_size ", size, " is not a multiple of ", multiple,
                                                   " (the VAE's upscale factor times the transformer's patch size)"));
  }
  return absl::OkStatus();
}

absl::Status ValidateOptions(const ZImagePipelineOptions& options) {
  ConfigCheck check("Z-Image pipeline options");
  check.Above("scheduler shift", options.scheduler_shift, 0.0, 1e4)
      .Range("max_sequence_length", options.max_sequence_length, 1, 1 << 16)
      .Range("default_size", options.default_size, 64, 2048);
  return check.status();
}

}  // namespace

absl::StatusOr<std::unique_ptr<Pipeline>> LoadZImagePipeline(const std::string& dir,
                                                            const ZImagePipelineOptions& base,
                                                            bool random_weights, ComponentCache* cache) {
  ZImagePipelineOptions options = base;
  ASSIGN_OR_RETURN(auto index, ReadModelIndex(dir));
  if (index.count("transformer") == 0 || index.at("transformer") != "ZImageTransformer2DModel") {
    return absl::InvalidArgumentError(absl::StrCat("'", dir, "/model_index.json': transformer is not a ZImageTransformer2DModel"));
  }
  const std::string tpath = absl::StrCat(dir, "/transformer/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct tj, ReadJsonFile(tpath));
  ASSIGN_OR_RETURN(ZImageTransformerConfig tc, ZImageTransformerConfigFromJson(tj, tpath));
  const std::string vpath = absl::StrCat(dir, "/vae/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct vj, ReadJsonFile(vpath));
  ASSIGN_OR_RETURN(AutoencoderKLConfig vc, AutoencoderKLConfigFromJson(vj, vpath));
  const std::string qpath = absl::StrCat(dir, "/text_encoder/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct qj, ReadJsonFile(qpath));
  ASSIGN_OR_RETURN(Qwen3Config qc, Qwen3ConfigFromJson(qj, qpath));
  RETURN_IF_ERROR(ValidateComponents(tc, vc, qc, tpath));
  if (options.default_size == 0) options.default_size = 1024;  // Z-Image's.
  const std::string spath = absl::StrCat(dir, "/scheduler/scheduler_config.json");
  auto scheduler = ReadJsonFile(spath);
  if (scheduler.ok()) {
    FlowMatchSchedulerConfig defaults;
    defaults.shift = options.scheduler_shift;
    ASSIGN_OR_RETURN(FlowMatchSchedulerConfig sc, FlowMatchSchedulerConfigFromJson(*scheduler, defaults, spath));
    options.scheduler_shift = sc.shift;
    ASSIGN_OR_RETURN(const bool dynamic, ConfigBool(*scheduler, "use_dynamic_shifting", false, spath));
    if (dynamic) {
      return absl::UnimplementedError(absl::StrCat(spath, ": use_dynamic_shifting is not supported"));
    }
  } else if (!absl::IsNotFound(scheduler.status())) {
    return scheduler.status();  // Present but malformed: not silently the defaults.
  }
  RETURN_IF_ERROR(ValidateOptions(options));
  RETURN_IF_ERROR(CheckDefaultSize(options.default_size, tc, vc));
  const std::string tokenizer_path = absl::StrCat(dir, "/tokenizer/tokenizer.json");
  ASSIGN_OR_RETURN(std::unique_ptr<BpeTokenizer> tokenizer, BpeTokenizer::Load(tokenizer_path));
  if (tokenizer->max_id() >= qc.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(tokenizer_path, ": token id ", tokenizer->max_id(),
                                                   " is outside the text encoder's vocab_size (", qc.vocab_size, ") in ",
                                                   qpath));
  }
  auto fp8 = [&](const std::string& name) { return options.fp8_components.count(name) > 0; };
  auto one_pass = [&](const std::string& name) { return options.fp8_one_pass_components.count(name) > 0; };
  auto seed = [&](const std::string& name) { return ComponentSeed(options.component_seeds, name, options.weight_seed); };
  // `folder`: the component's folder under `dir` (the VAE's encoder and decoder share "vae").
  auto shared = [&](const std::string& name, const std::string& folder, const ComponentCache::Loader& load) {
    return LoadMaybeShared(cache, name, absl::StrCat(dir, "/", folder), options.dtype, random_weights, seed(name),
                           fp8(name) ? "fp8" : "", load);
  };
  ASSIGN_OR_RETURN(auto text_encoder, shared("text_encoder", "text_encoder", [&] {
    return MakeComponent<Qwen3TextEncoder>("text_encoder", qc, options.dtype, absl::StrCat(dir, "/text_encoder"),
                                           random_weights, seed("text_encoder"), Qwen3UnusedWeightPrefixes(qc),
                                           fp8("text_encoder"), options.host_spill_dir, one_pass("text_encoder"));
  }));
  ASSIGN_OR_RETURN(auto transformer, shared("transformer", "transformer", [&] {
    return MakeComponent<ZImageTransformer>("transformer", tc, options.dtype, absl::StrCat(dir, "/transformer"),
                                            random_weights, seed("transformer"), {}, fp8("transformer"), options.host_spill_dir, one_pass("transformer"));
  }));
  ASSIGN_OR_RETURN(auto vae, shared("vae", "vae", [&] {
    return MakeComponent<AutoencoderKLDecoder>("vae", vc, options.dtype, absl::StrCat(dir, "/vae"), random_weights,
                                               seed("vae"), VaeDecoderIgnoredPrefixes(), fp8("vae"), options.host_spill_dir, one_pass("vae"));
  }));
  // The encoder half of the same VAE folder, its own component (placed apart: it runs only for
  // images in).
  ASSIGN_OR_RETURN(auto vae_encoder, shared("vae_encoder", "vae", [&] {
    return MakeComponent<AutoencoderKLEncoder>("vae_encoder", vc, options.dtype, absl::StrCat(dir, "/vae"),
                                               random_weights, seed("vae_encoder"),
                                               VaeEncoderIgnoredPrefixes(vc), fp8("vae_encoder"), options.host_spill_dir, one_pass("vae_encoder"));
  }));
  return std::unique_ptr<Pipeline>(new ZImagePipeline(options, std::move(tokenizer), std::move(text_encoder),
                                                      std::move(vae_encoder), std::move(transformer),
                                                      std::move(vae)));
}

absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyZImagePipeline(const ZImagePipelineOptions& base) {
  ZImagePipelineOptions options = base;
  if (options.default_size == 0) options.default_size = 256;
  Qwen3Config qc;
  qc.vocab_size = 259;  // 256 bytes + 3 special tokens.
  qc.hidden_size = 64;
  qc.num_hidden_layers = 3;
  qc.num_attention_heads = 4;
  qc.num_key_value_heads = 2;
  qc.head_dim = 16;
  qc.intermediate_size = 128;
  ZImageTransformerConfig tc;
  tc.in_channels = 4;
  tc.dim = 64;
  tc.n_heads = 2;
  tc.n_layers = 2;
  tc.n_refiner_layers = 1;
  tc.cap_feat_dim = 64;
  tc.axes_dims = {8, 12, 12};
  tc.axes_lens = {1024, 128, 128};
  AutoencoderKLConfig vc;
  vc.latent_channels = 4;
  vc.block_out_channels = {16, 32, 32, 32};
  vc.layers_per_block = 1;
  vc.norm_num_groups = 8;
  RETURN_IF_ERROR(ValidateComponents(tc, vc, qc, "built-in zimage-tiny transformer config"));
  RETURN_IF_ERROR(ValidateOptions(options));
  RETURN_IF_ERROR(CheckDefaultSize(options.default_size, tc, vc));
  auto tokenizer = BpeTokenizer::ByteLevel({"<|endoftext|>", "<|im_start|>", "<|im_end|>"});
  if (tokenizer == nullptr) return absl::InternalError("built-in tokenizer failed to build");
  auto fp8 = [&](const std::string& name) { return options.fp8_components.count(name) > 0; };
  auto one_pass = [&](const std::string& name) { return options.fp8_one_pass_components.count(name) > 0; };
  auto seed = [&](const std::string& name) { return ComponentSeed(options.component_seeds, name, options.weight_seed); };
  ASSIGN_OR_RETURN(auto text_encoder, MakeComponent<Qwen3TextEncoder>("text_encoder", qc, options.dtype, "", true,
                                                                      seed("text_encoder"), {}, fp8("text_encoder"), options.host_spill_dir, one_pass("text_encoder")));
  ASSIGN_OR_RETURN(auto transformer, MakeComponent<ZImageTransformer>("transformer", tc, options.dtype, "", true,
                                                                      seed("transformer"), {}, fp8("transformer"), options.host_spill_dir, one_pass("transformer")));
  ASSIGN_OR_RETURN(auto vae, MakeComponent<AutoencoderKLDecoder>("vae", vc, options.dtype, "", true,
                                                                 seed("vae"), {}, fp8("vae"), options.host_spill_dir, one_pass("vae")));
  ASSIGN_OR_RETURN(auto vae_encoder, MakeComponent<AutoencoderKLEncoder>("vae_encoder", vc, options.dtype, "", true,
                                                                         seed("vae_encoder"), {},
                                                                         fp8("vae_encoder"), options.host_spill_dir, one_pass("vae_encoder")));
  return std::unique_ptr<Pipeline>(new ZImagePipeline(options, std::move(tokenizer), std::move(text_encoder),
                                                      std::move(vae_encoder), std::move(transformer),
                                                      std::move(vae)));
}

}  // namespace stowage
