#include "models/tiny_pipeline.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"
#include "models/byte_tokenizer.h"
#include "models/flow_match_scheduler.h"
#include "models/weight_init.h"
#include "offload/status_macros.h"

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
  TinyPipeline(const TinyPipelineOptions& options, std::unique_ptr<Component> text_encoder,
               std::unique_ptr<Component> transformer, std::unique_ptr<Component> vae)
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
    const c10::Device device = options_.device;
    const bool guided = params.guidance_scale > 1.0f;

    context.BeginStage("tokenize");
    std::vector<std::string> texts = {params.prompt};
    if (guided) texts.insert(texts.begin(), params.negative_prompt);  // [negative, positive]
    ASSIGN_OR_RETURN(TokenBatch tokens, tokenizer_.Encode(texts));
    const auto [ids, mask] = ToTensors(tokens, device);

    context.BeginStage("encode_prompt");
    at::Tensor text;
    RETURN_IF_ERROR(runner.Run(*text_encoder_, [&] {
      text = static_cast<TinyTextEncoder&>(text_encoder_->module()).Forward(ids, mask);
    }));
    RETURN_IF_ERROR(context.CheckInterrupt());

    const int64_t factor = static_cast<TinyVaeDecoder&>(vae_->module()).upscale();
    const int64_t channels = options_.transformer.in_channels;
    at::Generator gen = at::detail::createCPUGenerator(params.seed);
    at::Tensor latents = at::randn({1, channels, params.height / factor, params.width / factor}, gen,
                                   at::TensorOptions().dtype(at::kFloat))
                             .to(device);

    FlowMatchEulerScheduler scheduler(options_.scheduler);
    scheduler.SetTimesteps(params.steps);
    context.BeginStage("denoise", params.steps);
    auto& dit = static_cast<TinyDiT&>(transformer_->module());
    for (int i = 0; i < params.steps; ++i) {
      const int64_t batch = guided ? 2 : 1;
      const at::Tensor t =
          at::full({batch}, scheduler.timesteps()[i], at::TensorOptions().dtype(at::kFloat).device(device));
      const at::Tensor model_in = latents.expand({batch, -1, -1, -1});
      at::Tensor velocity;
      RETURN_IF_ERROR(runner.Run(*transformer_, [&] {
        velocity = dit.Forward(model_in, t, text, mask).to(at::kFloat);
      }));
      if (guided) {
        const at::Tensor uncond = velocity.slice(0, 0, 1);
        const at::Tensor cond = velocity.slice(0, 1, 2);
        velocity = uncond + (cond - uncond) * params.guidance_scale;
      }
      latents = scheduler.Step(velocity, i, latents);
      context.ReportStep(i + 1, params.steps);
      RETURN_IF_ERROR(context.CheckInterrupt());
    }

    context.BeginStage("decode");
    at::Tensor pixels;
    RETURN_IF_ERROR(runner.Run(*vae_, [&] {
      pixels = static_cast<TinyVaeDecoder&>(vae_->module()).Forward(latents.to(options_.dtype));
    }));
    context.EndStage();
    return ImageFromTensor(pixels);
  }

 private:
  TinyPipelineOptions options_;
  PipelineLimits limits_;
  ByteTokenizer tokenizer_;
  std::unique_ptr<Component> text_encoder_;
  std::unique_ptr<Component> transformer_;
  std::unique_ptr<Component> vae_;
};

template <typename T, typename Config>
absl::StatusOr<std::unique_ptr<Component>> MakeComponent(const std::string& name,
                                                         const Config& config,
                                                         const TinyPipelineOptions& options) {
  std::unique_ptr<Module> module;
  RETURN_IF_ERROR(CatchAsStatus(absl::StrCat("building ", name), [&] {
    module = std::make_unique<T>(config, LayerOptions{options.dtype});
    InitializeRandomWeights(*module, options.weight_seed);
  }));
  return Component::Create(name, std::move(module), options.dtype);
}

}  // namespace

absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyPipeline(const TinyPipelineOptions& options) {
  if (options.dtype != at::kFloat && options.dtype != at::kBFloat16) {
    return absl::InvalidArgumentError("tiny pipeline dtype must be float32 or bfloat16");
  }
  ASSIGN_OR_RETURN(auto text_encoder,
                   MakeComponent<TinyTextEncoder>("text_encoder", options.text_encoder, options));
  ASSIGN_OR_RETURN(auto transformer, MakeComponent<TinyDiT>("transformer", options.transformer, options));
  ASSIGN_OR_RETURN(auto vae, MakeComponent<TinyVaeDecoder>("vae", options.vae, options));
  return std::unique_ptr<Pipeline>(new TinyPipeline(options, std::move(text_encoder),
                                                    std::move(transformer), std::move(vae)));
}

}  // namespace stowage
