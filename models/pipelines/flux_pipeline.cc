#include "models/pipelines/flux_pipeline.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "models/nets/autoencoder_kl.h"
#include "models/nets/clip_text_encoder.h"
#include "models/tokenizers/clip_tokenizer.h"
#include "models/pipelines/component_factory.h"
#include "models/core/config_checks.h"
#include "models/core/device_copy.h"
#include "models/core/diffusers_format.h"
#include "models/nets/flux_latents.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/pipelines/denoise.h"
#include "models/nets/flux_transformer.h"
#include "models/core/image.h"
#include "models/nets/t5_encoder.h"
#include "models/tokenizers/t5_tokenizer.h"

namespace stowage {
namespace {

// The scheduler as FluxPipeline configures FlowMatchEulerDiscreteScheduler: [dev] shifts by the
// image's token count (use_dynamic_shifting, exponential), [schnell] by a fixed shift (1: none).
struct FluxSchedule {
  bool dynamic = true;
  double shift = 3.0;
  int64_t base_image_seq_len = 256;
  int64_t max_image_seq_len = 4096;
  double base_shift = 0.5;
  double max_shift = 1.15;

  std::vector<float> Sigmas(int steps, int64_t image_tokens) const {
    if (dynamic) {
      return FluxSigmas(steps, FluxShift(image_tokens, base_image_seq_len, max_image_seq_len, base_shift, max_shift));
    }
    return ShiftedSigmas(steps, shift);
  }
};

absl::StatusOr<FluxSchedule> ReadSchedule(const std::string& path) {
  FluxSchedule s;
  auto json = ReadJsonFile(path);
  if (absl::IsNotFound(json.status())) return s;  // diffusers' defaults for [dev].
  if (!json.ok()) return json.status();
  ASSIGN_OR_RETURN(s.dynamic, ConfigBool(*json, "use_dynamic_shifting", false, path));
  ASSIGN_OR_RETURN(s.shift, ConfigDouble(*json, "shift", 1.0, path));
  ASSIGN_OR_RETURN(s.base_image_seq_len, ConfigInt(*json, "base_image_seq_len", s.base_image_seq_len, path));
  ASSIGN_OR_RETURN(s.max_image_seq_len, ConfigInt(*json, "max_image_seq_len", s.max_image_seq_len, path));
  ASSIGN_OR_RETURN(s.base_shift, ConfigDouble(*json, "base_shift", s.base_shift, path));
  ASSIGN_OR_RETURN(s.max_shift, ConfigDouble(*json, "max_shift", s.max_shift, path));
  if (json->fields().count("time_shift_type") > 0 &&
      json->fields().at("time_shift_type").string_value() != "exponential") {
    return absl::UnimplementedError(absl::StrCat(path, ": time_shift_type must be \"exponential\""));
  }
  ConfigCheck check(path);
  check.Above("shift", s.shift, 0.0, 1e4)
      .Range("base_image_seq_len", s.base_image_seq_len, 1, int64_t{1} << 30)
      .Range("max_image_seq_len", s.max_image_seq_len, 1, int64_t{1} << 30)
      .Between("base_shift", s.base_shift, -100.0, 100.0)
      .Between("max_shift", s.max_shift, -100.0, 100.0);
  RETURN_IF_ERROR(check.status());
  if (s.dynamic && s.max_image_seq_len == s.base_image_seq_len) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": max_image_seq_len must differ from base_image_seq_len (the shift's slope divides by "
                           "their difference)"));
  }
  return s;
}

struct FluxParts {
  FluxTransformerConfig transformer;
  AutoencoderKLConfig vae;
  ClipTextConfig clip;
  T5Config t5;
};

// What the components assume of each other; `where` is named in errors.
absl::Status ValidateParts(const FluxParts& p, const std::string& where) {
  ConfigCheck check(where);
  check.Equals("in_channels", p.transformer.in_channels, "4 x the vae's latent_channels (2x2 packing)",
               4 * p.vae.latent_channels)
      .Equals("patch_size", p.transformer.patch_size, "1 (latents come packed)", 1)
      .Equals("joint_attention_dim", p.transformer.joint_attention_dim, "text_encoder_2's d_model", p.t5.d_model)
      .Equals("pooled_projection_dim", p.transformer.pooled_projection_dim, "text_encoder's hidden_size",
              p.clip.hidden_size)
      .Equals("out_channels", p.transformer.out(), "in_channels", p.transformer.in_channels);
  return check.status();
}

class FluxPipeline : public Pipeline {
 public:
  FluxPipeline(const FluxPipelineOptions& options, const FluxSchedule& schedule,
               std::unique_ptr<ClipTokenizer> clip_tokenizer, std::unique_ptr<T5Tokenizer> t5_tokenizer,
               std::shared_ptr<Component> clip, std::shared_ptr<Component> t5, std::shared_ptr<Component> vae_encoder,
               std::shared_ptr<Component> transformer, std::shared_ptr<Component> vae)
      : options_(options),
        schedule_(schedule),
        clip_tokenizer_(std::move(clip_tokenizer)),
        t5_tokenizer_(std::move(t5_tokenizer)),
        clip_(std::move(clip)),
        t5_(std::move(t5)),
        vae_encoder_(std::move(vae_encoder)),
        transformer_(std::move(transformer)),
        vae_(std::move(vae)) {
    const bool dev = Transformer().config().guidance_embeds;
    limits_.default_width = static_cast<int>(options.default_size);
    limits_.default_height = static_cast<int>(options.default_size);
    limits_.min_size = 64;
    limits_.max_size = 2048;
    limits_.size_multiple = static_cast<int>(Vae().upscale() * 2);  // Packing takes 2x2 latent patches.
    limits_.default_steps = dev ? 28 : 4;
    limits_.max_steps = 100;
    limits_.default_guidance_scale = dev ? 3.5f : 0.0f;
    limits_.max_prompt_bytes = 4096;  // Tokens beyond the encoders' lengths are cut, as diffusers does.
    limits_.accepts_images = true;
    limits_.mixes_adapters = true;
  }

  const std::string& name() const override { return options_.name; }
  std::string description() const override {
    return absl::StrCat("Flux.1 ", Transformer().config().guidance_embeds ? "[dev]" : "[schnell]",
                        " (MMDiT transformer, CLIP-L and T5-XXL text encoders, Flux VAE), diffusers-compatible weights");
  }
  const PipelineLimits& limits() const override { return limits_; }
  std::vector<Component*> components() override {
    return {clip_.get(), t5_.get(), vae_encoder_.get(), transformer_.get(), vae_.get()};
  }
  bool batched() const override { return true; }

  absl::StatusOr<Image> Run(const GenerationParams& params, ComponentRunner& runner, RunContext& context) override {
    return std::move(RunBatch({BatchMember{&params, &context}}, runner).front());
  }

  std::vector<absl::StatusOr<Image>> RunBatch(const std::vector<BatchMember>& members,
                                              ComponentRunner& runner) override {
    c10::InferenceMode inference_mode;
    // The denoising loop runs where the transformer is; the encoders and decoder may sit elsewhere.
    const c10::Device device = runner.DeviceOf(*transformer_, options_.device);
    BatchRun run(members);
    if (members.empty() || !run.Compatible(limits_.mixes_adapters)) return run.TakeResults();
    const std::vector<size_t>& active = run.active();  // Shrinks as members leave (run.Filter).
    // The members' adapters as the caller installed them, one row each (null: the same for all),
    // and those of the members `indices` as the rows of one batched forward.
    const LoraRows* member_rows = ActiveLoraRows();
    auto rows_of = [&](const std::vector<size_t>& indices) {
      LoraRows rows;
      for (size_t i : indices) rows.push_back((*member_rows)[i]);
      return rows;
    };

    // Tokenize: CLIP's 77 ids and T5's max_sequence_length ids per member.
    run.BeginStage("tokenize", 0);
    const int64_t clip_length = Clip().config().max_position_embeddings;
    std::vector<std::vector<int64_t>> clip_ids(members.size()), t5_ids(members.size());
    run.Filter([&](size_t i) -> absl::Status {
      const GenerationParams& params = *members[i].params;
      if (!params.negative_prompt.empty()) {
        return absl::InvalidArgumentError(
            "negative_prompt: Flux pipelines take none (guidance is distilled into [dev]; true CFG is not "
            "supported); leave it empty");
      }
      ASSIGN_OR_RETURN(clip_ids[i], clip_tokenizer_->Encode(params.prompt, clip_length));
      ASSIGN_OR_RETURN(t5_ids[i], t5_tokenizer_->Encode(params.prompt, options_.max_sequence_length));
      return absl::OkStatus();
    });

    // Encode: CLIP's pooled output and T5's hidden states, every member at once per encoder.
    run.BeginStage("encode_prompt", 0);
    at::Tensor pooled, text;
    if (!active.empty()) {
      auto stack = [&](const std::vector<std::vector<int64_t>>& ids, const Component& encoder) {
        std::vector<at::Tensor> rows;
        for (size_t i : active) rows.push_back(at::tensor(ids[i]));
        return at::stack(rows).to(runner.DeviceOf(encoder, options_.device));
      };
      const LoraRows encoder_rows = member_rows != nullptr ? rows_of(active) : LoraRows();
      std::optional<ScopedLoraRows> lora_rows;
      if (member_rows != nullptr) lora_rows.emplace(&encoder_rows);
      const absl::Status clip_ran =
          runner.Run(*clip_, [&] { pooled = Clip().Forward(stack(clip_ids, *clip_)).pooled; });
      if (pooled.defined()) pooled = pooled.to(device);
      run.Filter([&](size_t) { return clip_ran; });
      if (!active.empty()) {
        runner.Prefetch(*transformer_);  // Its first groups copy while T5 encodes.
        const absl::Status t5_ran = runner.Run(*t5_, [&] { text = T5().Forward(stack(t5_ids, *t5_)); });
        if (text.defined()) text = text.to(device);
        run.Filter([&](size_t) { return t5_ran; });
      }
    }
    // The members the encoders' rows belong to (members leaving from here on are selected out).
    const std::vector<size_t> encoded_rows = active;
    run.Filter([&](size_t i) { return members[i].context->CheckInterrupt(); });

    // Latents: [C, H/8, W/8] per member from its seed on a CPU generator (diffusers' randn_tensor
    // with a CPU generator draws the same numbers), packed into 2x2 patches, kept in the model's
    // dtype between steps (as diffusers' Flux pipelines keep them).
    const GenerationParams& shape = *members.front().params;
    DenoiseFamily family;
    family.transformer = transformer_.get();
    family.vae = vae_.get();
    family.vae_encoder = vae_encoder_.get();
    family.default_device = options_.device;
    family.device = device;
    family.latent_dtype = options_.dtype;
    const int64_t lh = shape.height / Vae().upscale(), lw = shape.width / Vae().upscale();
    family.latent_height = lh;
    family.latent_width = lw;
    const int64_t channels = Transformer().config().in_channels / 4;
    family.sigmas = schedule_.Sigmas(shape.steps, (lh / 2) * (lw / 2));
    family.draw_noise = [&](at::Generator& generator) {
      return PackLatents(at::randn({1, channels, lh, lw}, generator, at::TensorOptions().dtype(at::kFloat))).to(device);
    };
    family.image_to_layout = [](const at::Tensor& x) { return PackLatents(x); };
    family.mask_to_layout = [&](const at::Tensor& mask) {
      return PackLatents(mask.expand({1, channels, lh, lw}).contiguous());
    };
    const at::Tensor img_ids = LatentImageIds(lh, lw).to(device);
    const at::Tensor txt_ids = at::zeros({options_.max_sequence_length, 3}, at::TensorOptions().dtype(at::kFloat)).to(device);
    // The encoders' rows of the members still running, selected again only when one has left.
    std::vector<size_t> selected_for = encoded_rows;
    at::Tensor step_text = text, step_pooled = pooled;
    // One transformer forward over every running member's packed latents.
    family.forward = [&](int step, const std::vector<size_t>& running, const std::vector<at::Tensor>& latents,
                         std::vector<at::Tensor>* velocities) -> absl::Status {
      if (running != selected_for) {
        std::vector<int64_t> rows;
        for (size_t i : running) {
          rows.push_back(std::find(encoded_rows.begin(), encoded_rows.end(), i) - encoded_rows.begin());
        }
        const at::Tensor index = ToDeviceWithoutWaiting(at::tensor(rows), device);  // Members came or went.
        step_text = text.index_select(0, index);
        step_pooled = pooled.index_select(0, index);
        selected_for = running;
      }
      std::vector<at::Tensor> xs;
      std::vector<float> guidance;
      for (size_t i : running) {
        xs.push_back(latents[i]);
        guidance.push_back(members[i].params->guidance_scale);
      }
      const at::Tensor x = at::cat(xs);
      const auto b = static_cast<int64_t>(running.size());
      // diffusers: t = sigma * 1000 in float32, cast to the model's dtype, then t / 1000 in that dtype.
      // Made on the device (device_copy.h): a host tensor copied each step would make the host wait
      // for the last step's kernels before it queued this one's.
      const at::Tensor timestep =
          at::full({b}, family.sigmas[step] * 1000.0f, at::TensorOptions().dtype(at::kFloat).device(device))
              .to(options_.dtype) /
          1000;
      at::Tensor g;
      if (Transformer().config().guidance_embeds) g = FloatsOnDevice(guidance, device);
      at::Tensor out;
      const LoraRows rows = member_rows != nullptr ? rows_of(running) : LoraRows();
      std::optional<ScopedLoraRows> lora_rows;
      if (member_rows != nullptr) lora_rows.emplace(&rows);
      RETURN_IF_ERROR(runner.Run(*transformer_, [&] {
        out = Transformer().Forward(x, step_text, step_pooled, timestep, img_ids, txt_ids, g);
      }));
      for (int64_t k = 0; k < b; ++k) (*velocities)[static_cast<size_t>(k)] = out.narrow(0, k, 1);
      return absl::OkStatus();
    };
    const c10::Device vae_device = runner.DeviceOf(*vae_, options_.device);
    family.decode = [&](const at::Tensor& x) {
      return Vae().Decode(UnpackLatents(x, lh, lw).to(vae_device).to(vae_->dtype()));
    };
    Denoise(members, runner, run, family);
    return run.TakeResults();
  }

 private:
  ClipTextEncoder& Clip() { return static_cast<ClipTextEncoder&>(clip_->module()); }
  T5Encoder& T5() { return static_cast<T5Encoder&>(t5_->module()); }
  FluxTransformer& Transformer() const { return static_cast<FluxTransformer&>(transformer_->module()); }
  AutoencoderKLDecoder& Vae() const { return static_cast<AutoencoderKLDecoder&>(vae_->module()); }

  FluxPipelineOptions options_;
  FluxSchedule schedule_;
  PipelineLimits limits_;
  std::unique_ptr<ClipTokenizer> clip_tokenizer_;
  std::unique_ptr<T5Tokenizer> t5_tokenizer_;
  std::shared_ptr<Component> clip_;
  std::shared_ptr<Component> t5_;
  std::shared_ptr<Component> vae_encoder_;
  std::shared_ptr<Component> transformer_;
  std::shared_ptr<Component> vae_;
};

absl::Status ValidateOptions(const FluxPipelineOptions& options, const AutoencoderKLConfig& vae) {
  ConfigCheck check("Flux pipeline options");
  check.Range("max_sequence_length", options.max_sequence_length, 1, 4096)
      .Range("default_size", options.default_size, 64, 2048);
  RETURN_IF_ERROR(check.status());
  if (vae.block_out_channels.empty() || vae.block_out_channels.size() > 16) return absl::OkStatus();  // Validate() says why.
  const int64_t multiple = (int64_t{1} << (vae.block_out_channels.size() - 1)) * 2;
  if (options.default_size % multiple != 0) {
    return absl::InvalidArgumentError(absl::StrCat("default_size ", options.default_size, " is not a multiple of ",
                                                   multiple, " (the VAE's upscale factor times 2, for packing)"));
  }
  return absl::OkStatus();
}

// Tokenizer ids must index the encoders' embeddings.
absl::Status CheckVocab(int64_t max_id, int64_t vocab_size, const std::string& tokenizer, const std::string& encoder) {
  if (max_id < vocab_size) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(tokenizer, ": token id ", max_id, " is outside ", encoder,
                                                 "'s vocab_size (", vocab_size, ")"));
}

absl::StatusOr<std::unique_ptr<Pipeline>> Assemble(const FluxPipelineOptions& options, const FluxSchedule& schedule,
                                                   const FluxParts& parts, std::unique_ptr<ClipTokenizer> clip_tokenizer,
                                                   std::unique_ptr<T5Tokenizer> t5_tokenizer, const std::string& dir,
                                                   bool random_weights, ComponentCache* cache) {
  auto seed = [&](const std::string& name) { return ComponentSeed(options.component_seeds, name, options.weight_seed); };
  // `folder`: the component's folder under `dir` (the VAE's encoder and decoder share "vae").
  auto shared = [&](const std::string& name, const std::string& folder,
                    const ComponentCache::Loader& load) -> absl::StatusOr<std::shared_ptr<Component>> {
    if (dir.empty()) {
      ASSIGN_OR_RETURN(std::unique_ptr<Component> component, load());
      return std::shared_ptr<Component>(std::move(component));
    }
    return LoadMaybeShared(cache, name, absl::StrCat(dir, "/", folder), options.dtype, random_weights, seed(name),
                           options.fp8_components.count(name) ? "fp8" : "", load);
  };
  auto fp8 = [&](const std::string& name) { return options.fp8_components.count(name) > 0; };
  auto one_pass = [&](const std::string& name) { return options.fp8_one_pass_components.count(name) > 0; };
  auto where = [&](const std::string& name) { return dir.empty() ? std::string() : absl::StrCat(dir, "/", name); };
  ASSIGN_OR_RETURN(auto clip, shared("text_encoder", "text_encoder", [&] {
    return MakeComponent<ClipTextEncoder>("text_encoder", parts.clip, options.dtype, where("text_encoder"),
                                          random_weights, seed("text_encoder"), {"text_model.embeddings.position_ids"},
                                          fp8("text_encoder"), options.host_spill_dir, one_pass("text_encoder"));
  }));
  ASSIGN_OR_RETURN(auto t5, shared("text_encoder_2", "text_encoder_2", [&] {
    return MakeComponent<T5Encoder>("text_encoder_2", parts.t5, options.dtype, where("text_encoder_2"), random_weights,
                                    seed("text_encoder_2"), {"encoder.embed_tokens."}, fp8("text_encoder_2"), options.host_spill_dir, one_pass("text_encoder_2"));
  }));
  ASSIGN_OR_RETURN(auto transformer, shared("transformer", "transformer", [&] {
    return MakeComponent<FluxTransformer>("transformer", parts.transformer, options.dtype, where("transformer"),
                                          random_weights, seed("transformer"), {}, fp8("transformer"), options.host_spill_dir, one_pass("transformer"));
  }));
  ASSIGN_OR_RETURN(auto vae, shared("vae", "vae", [&] {
    return MakeComponent<AutoencoderKLDecoder>("vae", parts.vae, options.dtype, where("vae"), random_weights,
                                               seed("vae"), VaeDecoderIgnoredPrefixes(), fp8("vae"), options.host_spill_dir, one_pass("vae"));
  }));
  // The encoder half of the same VAE folder, its own component (placed apart: it runs only for
  // images in).
  ASSIGN_OR_RETURN(auto vae_encoder, shared("vae_encoder", "vae", [&] {
    return MakeComponent<AutoencoderKLEncoder>("vae_encoder", parts.vae, options.dtype, where("vae"), random_weights,
                                               seed("vae_encoder"), VaeEncoderIgnoredPrefixes(parts.vae),
                                               fp8("vae_encoder"), options.host_spill_dir, one_pass("vae_encoder"));
  }));
  return std::unique_ptr<Pipeline>(new FluxPipeline(options, schedule, std::move(clip_tokenizer),
                                                    std::move(t5_tokenizer), std::move(clip), std::move(t5),
                                                    std::move(vae_encoder), std::move(transformer), std::move(vae)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<Pipeline>> LoadFluxPipeline(const std::string& dir, const FluxPipelineOptions& base,
                                                           bool random_weights, ComponentCache* cache) {
  FluxPipelineOptions options = base;
  ASSIGN_OR_RETURN(auto index, ReadModelIndex(dir));
  if (index.count("transformer") == 0 || index.at("transformer") != "FluxTransformer2DModel") {
    return absl::InvalidArgumentError(
        absl::StrCat("'", dir, "/model_index.json': transformer is not a FluxTransformer2DModel"));
  }
  FluxParts parts;
  const std::string tpath = absl::StrCat(dir, "/transformer/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct tj, ReadJsonFile(tpath));
  ASSIGN_OR_RETURN(parts.transformer, FluxTransformerConfigFromJson(tj, tpath));
  const std::string vpath = absl::StrCat(dir, "/vae/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct vj, ReadJsonFile(vpath));
  ASSIGN_OR_RETURN(parts.vae, AutoencoderKLConfigFromJson(vj, vpath));
  const std::string cpath = absl::StrCat(dir, "/text_encoder/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct cj, ReadJsonFile(cpath));
  ASSIGN_OR_RETURN(parts.clip, ClipTextConfigFromJson(cj, cpath));
  const std::string t5path = absl::StrCat(dir, "/text_encoder_2/config.json");
  ASSIGN_OR_RETURN(google::protobuf::Struct t5j, ReadJsonFile(t5path));
  ASSIGN_OR_RETURN(parts.t5, T5ConfigFromJson(t5j, t5path));
  RETURN_IF_ERROR(ValidateParts(parts, tpath));
  ASSIGN_OR_RETURN(FluxSchedule schedule, ReadSchedule(absl::StrCat(dir, "/scheduler/scheduler_config.json")));
  if (options.default_size == 0) options.default_size = 1024;  // Flux's (128 latent rows of 8 pixels).
  RETURN_IF_ERROR(ValidateOptions(options, parts.vae));
  ASSIGN_OR_RETURN(std::unique_ptr<ClipTokenizer> clip_tokenizer, ClipTokenizer::Load(absl::StrCat(dir, "/tokenizer")));
  RETURN_IF_ERROR(CheckVocab(clip_tokenizer->max_id(), parts.clip.vocab_size, absl::StrCat(dir, "/tokenizer"), cpath));
  ASSIGN_OR_RETURN(std::unique_ptr<T5Tokenizer> t5_tokenizer, T5Tokenizer::Load(absl::StrCat(dir, "/tokenizer_2")));
  RETURN_IF_ERROR(CheckVocab(t5_tokenizer->max_id(), parts.t5.vocab_size, absl::StrCat(dir, "/tokenizer_2"), t5path));
  return Assemble(options, schedule, parts, std::move(clip_tokenizer), std::move(t5_tokenizer), dir, random_weights,
                  cache);
}

absl::StatusOr<std::unique_ptr<Pipeline>> CreateTinyFluxPipeline(const FluxPipelineOptions& base) {
  FluxPipelineOptions options = base;
  if (options.default_size == 0) options.default_size = 128;
  options.max_sequence_length = std::min<int64_t>(options.max_sequence_length, 64);
  FluxParts p;
  p.clip.vocab_size = 514;  // ClipTokenizer::ByteLevel: 512 byte tokens and two special ones.
  p.clip.hidden_size = 32;
  p.clip.intermediate_size = 64;
  p.clip.num_hidden_layers = 2;
  p.clip.num_attention_heads = 2;
  p.clip.max_position_embeddings = 77;
  p.clip.eos_token_id = 513;
  p.t5.vocab_size = 259;  // T5Tokenizer::ByteLevel: bytes + 3.
  p.t5.d_model = 32;
  p.t5.d_kv = 8;
  p.t5.d_ff = 64;
  p.t5.num_layers = 2;
  p.t5.num_heads = 4;
  p.t5.relative_attention_num_buckets = 8;
  p.t5.relative_attention_max_distance = 16;
  p.transformer.in_channels = 16;
  p.transformer.num_layers = 1;
  p.transformer.num_single_layers = 1;
  p.transformer.attention_head_dim = 16;
  p.transformer.num_attention_heads = 2;
  p.transformer.joint_attention_dim = 32;
  p.transformer.pooled_projection_dim = 32;
  p.transformer.guidance_embeds = true;
  p.transformer.axes_dims_rope = {4, 6, 6};
  p.vae.latent_channels = 4;
  p.vae.block_out_channels = {16, 32, 32, 32};
  p.vae.layers_per_block = 1;
  p.vae.norm_num_groups = 8;
  RETURN_IF_ERROR(ValidateParts(p, "built-in flux-tiny transformer config"));
  RETURN_IF_ERROR(ValidateOptions(options, p.vae));
  return Assemble(options, FluxSchedule{}, p, ClipTokenizer::ByteLevel(), T5Tokenizer::ByteLevel(), "", true, nullptr);
}

}  // namespace stowage
