#include "models/pipelines/tiny_pipeline.h"

#include <sys/stat.h>

#include <cerrno>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"
#include "models/tokenizers/byte_tokenizer.h"
#include "models/core/diffusers_format.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/core/weight_init.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "models/core/config_checks.h"

namespace stowage {
namespace {

// Converts a token batch to [B, L] ids and mask tensors on `device`.
std::pair<at::Tensor, at::Tensor> ToTensors(const TokenBatch& batch, const c10::Device& device) {
  const int64_t b = static_cast<int64_t>(batch.ids.size());
  at::Tensor ids = at::empty({b, batch.length}, at::kLong);
  at::Tensor mask = at::empty({b, batch.length}, at::kBool);
  auto ids_a = ids.accessor<int64_t, 2>();
  auto mask_a = mask.accessor<bool, 2>();
  for (int64_t i = 0; i < b; ++i) {
    for (int64_t j = 0; j < batch.length; ++j) {
      ids_a[i][j] = batch.ids[i][j];
      mask_a[i][j] = batch.mask[i][j];
    }
  }
  return {ids.to(device), mask.to(device)};
}

class TinyPipeline : public Pipeline {
 public:
  TinyPipeline(const TinyPipelineOptions& options, std::shared_ptr<Component> text_encoder,
               std::shared_ptr<Component> transformer, std::shared_ptr<Component> vae)
      : options_(options),
        tokenizer_(static_cast<int>(options.text_encoder.max_tokens)),
        text_encoder_(std::move(text_encoder)),
        transformer_(std::move(transformer)),
        vae_(std::move(vae)) {
    const int64_t factor = static_cast<TinyVaeDecoder&>(vae_->module()).upscale() *
                           options.transformer.patch_size;
    limits_.size_multiple = static_cast<int>(factor);
    limits_.max_prompt_bytes = tokenizer_.max_text_bytes();
    limits_.default_guidance_scale = 3.0f;
  }

  const std::string& name() const override { return options_.name; }
  std::string description() const override {
    return "Built-in tiny text-to-image pipeline (byte tokenizer, DiT denoiser, conv VAE decoder) "
           "with deterministic random weights: fast, needs no download, draws noise-like images.";
  }
  const PipelineLimits& limits() const override { return limits_; }
  std::vector<Component*> components() override {
    return {text_encoder_.get(), transformer_.get(), vae_.get()};
  }

  absl::StatusOr<Image> Run(const GenerationParams& params, ComponentRunner& runner,
                            RunContext& context) override {
    c10::InferenceMode inference_mode;
    // The denoising loop runs where the transformer is; the encoder and decoder may sit elsewhere.
    const c10::Device device = runner.DeviceOf(*transformer_, options_.device);
    const bool guided = params.guidance_scale > 1.0f;

    context.BeginStage("tokenize");
    std::vector<std::string> texts = {params.prompt};
    if (guided) texts.insert(texts.begin(), params.negative_prompt);  // [negative, positive]
    ASSIGN_OR_RETURN(TokenBatch tokens, tokenizer_.Encode(texts));
    // Not a structured binding: lambdas below capture these, which C++17 (clang) does not allow.
    const std::pair<at::Tensor, at::Tensor> id_mask =
        ToTensors(tokens, runner.DeviceOf(*text_encoder_, options_.device));
    const at::Tensor& ids = id_mask.first;
    const at::Tensor mask = id_mask.second.to(device);

    context.BeginStage("encode_prompt");
    at::Tensor text;
    runner.Prefetch(*transformer_);  // Its first groups copy while the prompt encodes.
    RETURN_IF_ERROR(runner.Run(*text_encoder_, [&] {
      text = static_cast<TinyTextEncoder&>(text_encoder_->module()).Forward(ids, id_mask.second);
    }));
    text = text.to(device);
    RETURN_IF_ERROR(context.CheckInterrupt());

    const int64_t factor = static_cast<TinyVaeDecoder&>(vae_->module()).upscale();
    const int64_t channels = options_.transformer.in_channels;
    at::Generator gen = at::detail::createCPUGenerator(params.seed);
    at::Tensor latents = at::randn({1, channels, params.height / factor, params.width / factor}, gen,
                                   at::TensorOptions().dtype(at::kFloat))
                             .to(device);

    FlowMatchEulerScheduler scheduler(options_.scheduler);
    scheduler.SetTimesteps(params.steps);
    // Latents to pixels (inside a run of the VAE).
    const c10::Device vae_device = runner.DeviceOf(*vae_, options_.device);
    auto decode = [&](const at::Tensor& x) {
      return static_cast<TinyVaeDecoder&>(vae_->module()).Forward(x.to(vae_device).to(options_.dtype));
    };
    context.BeginStage("denoise", params.steps);
    auto& dit = static_cast<TinyDiT&>(transformer_->module());
    for (int i = 0; i < params.steps; ++i) {
      const int64_t batch = guided ? 2 : 1;
      const at::Tensor t =
          at::full({batch}, scheduler.timesteps()[i], at::TensorOptions().dtype(at::kFloat).device(device));
      const at::Tensor model_in = latents.expand({batch, -1, -1, -1});
      at::Tensor velocity;
      if (i == params.steps - 1) {
        runner.Prefetch(*vae_);                // The decoder's first groups: during the last step.
        runner.LastRunNext(*transformer_);     // And none of a next step's transformer groups.
      }
      RETURN_IF_ERROR(runner.Run(*transformer_, [&] {
        velocity = dit.Forward(model_in, t, text, mask).to(at::kFloat);
      }));
      if (guided) {
        const at::Tensor uncond = velocity.slice(0, 0, 1);
        const at::Tensor cond = velocity.slice(0, 1, 2);
        velocity = uncond + (cond - uncond) * params.guidance_scale;
      }
      if (context.WantsPreview(i + 1)) {
        const at::Tensor clean = EulerStep(latents, velocity, -scheduler.sigmas()[i]);
        const BatchMember self{&params, &context};
        DeliverPreviews(runner, *vae_, {self}, i + 1, {{0, clean}}, decode);
      }
      latents = scheduler.Step(velocity, i, latents);
      context.ReportStep(i + 1, params.steps);
      if (i < params.steps - 1) runner.BetweenSteps(i + 1, params.steps);
      RETURN_IF_ERROR(context.CheckInterrupt());
    }

    context.BeginStage("decode");
    at::Tensor pixels;
    RETURN_IF_ERROR(runner.Run(*vae_, [&] { pixels = decode(latents); }));
    absl::StatusOr<Image> image = ImageFromTensor(pixels);  // Its bytes on the host count in the decode.
    context.EndStage();
    return image;
  }

 private:
  TinyPipelineOptions options_;
  PipelineLimits limits_;
  ByteTokenizer tokenizer_;
  std::shared_ptr<Component> text_encoder_;
  std::shared_ptr<Component> transformer_;
  std::shared_ptr<Component> vae_;
};

template <typename T, typename Config>
absl::StatusOr<std::unique_ptr<Component>> MakeComponent(const std::string& name,
                                                         const Config& config,
                                                         const TinyPipelineOptions& options) {
  RETURN_IF_ERROR(Validate(config, absl::StrCat("built-in ", name, " config")));
  std::unique_ptr<Module> module;
  RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("building ", name), [&] {
    module = std::make_unique<T>(config, LayerOptions{options.dtype});
    InitializeRandomWeights(*module, ComponentSeed(options.component_seeds, name, options.weight_seed));
  }));
  if (!options.host_spill_dir.empty()) RETURN_IF_ERROR(SpillComponentHostCopies(*module, options.host_spill_dir, name));
  return Component::Create(name, std::move(module), options.dtype);
}

google::protobuf::Struct ConfigOf(const std::string& class_name,
                                  const std::vector<std::pair<std::string, double>>& numbers,
                                  const std::vector<std::pair<std::string, std::vector<int64_t>>>& lists = {}) {
  google::protobuf::Struct config;
  (*config.mutable_fields())["_class_name"].set_string_value(class_name);
  for (const auto& [k, v] : numbers) (*config.mutable_fields())[k].set_number_value(v);
  for (const auto& [k, v] : lists) {
    auto* list = (*config.mutable_fields())[k].mutable_list_value();
    for (int64_t x : v) list->add_values()->set_number_value(static_cast<double>(x));
  }
  return config;
}

absl::Status ExpectClass(const google::protobuf::Struct& config, const std::string& expected,
                         const std::string& path) {
  auto it = config.fields().find("_class_name");
  const std::string got = it == config.fields().end() ? "" : it->second.string_value();
  if (got != expected) {
    return absl::InvalidArgumentError(absl::StrCat("'", path, "': _class_name is '", Truncated(got),
                                                   "'; this loader builds '", expected, "'"));
  }
  return absl::OkStatus();
}

template <typename T, typename Config>
absl::StatusOr<std::unique_ptr<Component>> LoadComponent(const std::string& dir, const std::string& name,
                                                         const Config& config,
                                                         const TinyPipelineOptions& options,
                                                         bool random_weights) {
  RETURN_IF_ERROR(Validate(config, absl::StrCat(dir, "/", name, "/config.json")));
  std::unique_ptr<Module> module;
  RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("building ", name), [&] {
    module = std::make_unique<T>(config, LayerOptions{options.dtype});
  }));
  const std::string component_dir = absl::StrCat(dir, "/", name);
  if (random_weights) {
    InitializeRandomWeights(*module, ComponentSeed(options.component_seeds, name, options.weight_seed));
  } else {
    RETURN_IF_ERROR(LoadComponentWeights(*module, component_dir, options.dtype));
  }
  if (!options.host_spill_dir.empty()) RETURN_IF_ERROR(SpillComponentHostCopies(*module, options.host_spill_dir, name));
  return Component::Create(name, std::move(module), options.dtype);
}

// Every component's config, then what the components assume of each other. `where` names the
// transformer's config in cross-component errors.
absl::Status ValidateTinyPipeline(const TinyPipelineOptions& options, const std::string& where) {
  RETURN_IF_ERROR(Validate(options.text_encoder, "text_encoder config"));
  RETURN_IF_ERROR(Validate(options.transformer, "transformer config"));
  RETURN_IF_ERROR(Validate(options.vae, "vae config"));
  RETURN_IF_ERROR(Validate(options.scheduler, "scheduler config"));
  ConfigCheck check(where);
  check.Equals("in_channels", options.transformer.in_channels, "the vae's latent_channels", options.vae.latent_channels)
      .Equals("text_dim", options.transformer.text_dim, "the text encoder's dim", options.text_encoder.dim);
  return check.status();
}

}  // namespace

absl::Status SaveTinyPipeline(const TinyPipelineOptions& options, const std::string& dir,
                              int64_t max_shard_bytes) {
  RETURN_IF_ERROR(ValidateTinyPipeline(options, "tiny pipeline transformer config"));
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return absl::PermissionDeniedError(absl::StrCat("cannot create '", dir, "'"));
  }
  google::protobuf::Struct index;
  (*index.mutable_fields())["_class_name"].set_string_value("StowageTinyPipeline");
  for (const auto& [name, cls] : std::vector<std::pair<std::string, std::string>>{
           {"text_encoder", "TinyTextEncoder"}, {"transformer", "TinyDiT"}, {"vae", "TinyVaeDecoder"},
           {"scheduler", "FlowMatchEulerDiscreteScheduler"}}) {
    auto* pair = (*index.mutable_fields())[name].mutable_list_value();
    pair->add_values()->set_string_value("stowage");
    pair->add_values()->set_string_value(cls);
  }
  RETURN_IF_ERROR(WriteJsonFile(absl::StrCat(dir, "/model_index.json"), index));
  const TinyTextEncoderConfig& te = options.text_encoder;
  const TinyDiTConfig& tr = options.transformer;
  const TinyVaeDecoderConfig& vae = options.vae;
  std::unique_ptr<Module> module;
  RETURN_IF_ERROR(CatchAsStatus("building the pipeline", [&] {
    module = std::make_unique<TinyTextEncoder>(te, LayerOptions{options.dtype});
    InitializeRandomWeights(*module, ComponentSeed(options.component_seeds, "text_encoder", options.weight_seed));
  }));
  RETURN_IF_ERROR(SaveComponent(*module, absl::StrCat(dir, "/text_encoder"),
                                ConfigOf("TinyTextEncoder", {{"vocab_size", te.vocab_size}, {"max_tokens", te.max_tokens},
                                                             {"dim", te.dim}, {"heads", te.heads}, {"layers", te.layers}})));
  RETURN_IF_ERROR(CatchAsStatus("building the pipeline", [&] {
    module = std::make_unique<TinyDiT>(tr, LayerOptions{options.dtype});
    InitializeRandomWeights(*module, ComponentSeed(options.component_seeds, "transformer", options.weight_seed));
  }));
  RETURN_IF_ERROR(SaveComponent(*module, absl::StrCat(dir, "/transformer"),
                                ConfigOf("TinyDiT", {{"in_channels", tr.in_channels}, {"patch_size", tr.patch_size},
                                                     {"dim", tr.dim}, {"heads", tr.heads}, {"layers", tr.layers},
                                                     {"text_dim", tr.text_dim}, {"mlp_ratio", tr.mlp_ratio},
                                                     {"timestep_dim", tr.timestep_dim}}),
                                max_shard_bytes));
  RETURN_IF_ERROR(CatchAsStatus("building the pipeline", [&] {
    module = std::make_unique<TinyVaeDecoder>(vae, LayerOptions{options.dtype});
    InitializeRandomWeights(*module, ComponentSeed(options.component_seeds, "vae", options.weight_seed));
  }));
  RETURN_IF_ERROR(SaveComponent(*module, absl::StrCat(dir, "/vae"),
                                ConfigOf("TinyVaeDecoder",
                                         {{"latent_channels", vae.latent_channels}, {"groups", vae.groups},
                                          {"scaling_factor", vae.scaling_factor}, {"shift_factor", vae.shift_factor}},
                                         {{"block_out_channels", vae.channels}})));
  const std::string scheduler_dir = absl::StrCat(dir, "/scheduler");
  ::mkdir(scheduler_dir.c_str(), 0755);
  return WriteJsonFile(absl::StrCat(scheduler_dir, "/scheduler_config.json"),
                       ConfigOf("FlowMatchEulerDiscreteScheduler",
                                {{"num_train_timesteps", options.scheduler.num_train_timesteps},
                                 {"shift", options.scheduler.shift}}));
}

absl::StatusOr<std::unique_ptr<Pipeline>> LoadTinyPipeline(const std::string& dir,
                                                           const TinyPipelineOptions& base,
                                                           bool random_weights, ComponentCache* cache) {
  TinyPipelineOptions options = base;
  ASSIGN_OR_RETURN(auto index, ReadModelIndex(dir));
  for (const std::string name : {"text_encoder", "transformer", "vae"}) {
    if (index.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat("'", dir, "/model_index.json' has no '", name, "' component"));
    }
  }
  const std::string te_path = absl::StrCat(dir, "/text_encoder/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct te, ReadJsonFile(te_path));
  RETURN_IF_ERROR(ExpectClass(te, "TinyTextEncoder", te_path));
  ASSIGN_OR_RETURN(options.text_encoder, TinyTextEncoderConfigFromJson(te, options.text_encoder, te_path));
  const std::string tr_path = absl::StrCat(dir, "/transformer/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct tr, ReadJsonFile(tr_path));
  RETURN_IF_ERROR(ExpectClass(tr, "TinyDiT", tr_path));
  ASSIGN_OR_RETURN(options.transformer, TinyDiTConfigFromJson(tr, options.transformer, tr_path));
  const std::string vae_path = absl::StrCat(dir, "/vae/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct vae, ReadJsonFile(vae_path));
  RETURN_IF_ERROR(ExpectClass(vae, "TinyVaeDecoder", vae_path));
  ASSIGN_OR_RETURN(options.vae, TinyVaeDecoderConfigFromJson(vae, options.vae, vae_path));
  const std::string scheduler_path = absl::StrCat(dir, "/scheduler/scheduler_config.json");
  auto scheduler = ReadJsonFile(scheduler_path);
  if (scheduler.ok()) {
    ASSIGN_OR_RETURN(options.scheduler, FlowMatchSchedulerConfigFromJson(*scheduler, options.scheduler, scheduler_path));
  } else if (!absl::IsNotFound(scheduler.status())) {
    return scheduler.status();  // Present but malformed: not silently the defaults.
  }
  RETURN_IF_ERROR(ValidateTinyPipeline(options, tr_path));
  auto shared = [&](const std::string& name, const ComponentCache::Loader& load) {
    return LoadMaybeShared(cache, name, absl::StrCat(dir, "/", name), options.dtype, random_weights,
                           ComponentSeed(options.component_seeds, name, options.weight_seed), "", load);
  };
  ASSIGN_OR_RETURN(auto text_encoder, shared("text_encoder", [&] {
    return LoadComponent<TinyTextEncoder>(dir, "text_encoder", options.text_encoder, options, random_weights);
  }));
  ASSIGN_OR_RETURN(auto transformer, shared("transformer", [&] {
    return LoadComponent<TinyDiT>(dir, "transformer", options.transformer, options, random_weights);
  }));
  ASSIGN_OR_RETURN(auto vae_component, shared("vae", [&] {
    return LoadComponent<TinyVaeDecoder>(dir, "vae", options.vae, options, random_weights);
  }));
  return std::unique_ptr<Pipeline>(new TinyPipeline(options, std::move(text_encoder), std::move(transformer),
                                                    std::move(vae_component)));
}

absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyPipeline(const TinyPipelineOptions& options) {
  if (options.dtype != at::kFloat && options.dtype != at::kBFloat16) {
    return absl::InvalidArgumentError("tiny pipeline dtype must be float32 or bfloat16");
  }
  RETURN_IF_ERROR(ValidateTinyPipeline(options, "built-in tiny pipeline transformer config"));
  ASSIGN_OR_RETURN(auto text_encoder,
                   MakeComponent<TinyTextEncoder>("text_encoder", options.text_encoder, options));
  ASSIGN_OR_RETURN(auto transformer, MakeComponent<TinyDiT>("transformer", options.transformer, options));
  ASSIGN_OR_RETURN(auto vae, MakeComponent<TinyVaeDecoder>("vae", options.vae, options));
  return std::unique_ptr<Pipeline>(new TinyPipeline(options, std::move(text_encoder),
                                                    std::move(transformer), std::move(vae)));
}

}  // namespace stowage
