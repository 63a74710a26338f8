#include "server/generation_core.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <random>

#include <ATen/Parallel.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/notification.h"
#include "google/protobuf/util/time_util.h"
#include "models/diffusers_format.h"
#include "models/tiny_pipeline.h"
#include "models/zimage_pipeline.h"
#include "base/status_macros.h"
#include "server/config.h"
#include "base/process_memory.h"

namespace stowage {
namespace {

using google::protobuf::util::TimeUtil;

google::protobuf::Duration ToProto(absl::Duration d) {
  return TimeUtil::NanosecondsToDuration(absl::ToInt64Nanoseconds(d));
}

absl::StatusOr<std::unique_ptr<DeviceBackend>> CreateBackend(const v1::DeviceConfig& device) {
  v1::DeviceConfig::Kind kind = device.kind();
  if (kind == v1::DeviceConfig::KIND_UNSPECIFIED) {
    kind = CudaAvailable() ? v1::DeviceConfig::KIND_CUDA : v1::DeviceConfig::KIND_SIMULATED;
  }
  std::unique_ptr<DeviceBackend> backend;
  if (kind == v1::DeviceConfig::KIND_CUDA) {
    ASSIGN_OR_RETURN(backend, CreateCudaBackend(device.index()));
  } else {
    SimulatedBackendOptions options;
    options.index = device.index();
    options.bandwidth_bytes_per_second = device.simulated_bandwidth_bytes_per_second();
    backend = CreateSimulatedBackend(options);
  }
  if (device.memory_budget_bytes() > 0) {
    RETURN_IF_ERROR(backend->SetMemoryBudget(device.memory_budget_bytes()));
  }
  return backend;
}

absl::Status CheckSize(const char* field, int value, const PipelineLimits& limits) {
  if (value < limits.min_size || value > limits.max_size || value % limits.size_multiple != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        field, " is ", value, "; allowed: ", limits.min_size, " to ", limits.max_size,
        " in multiples of ", limits.size_multiple, ", or 0 for the default"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<GenerationCore>> GenerationCore::Create(
    const v1::ServerConfig& config, ServerMetrics* metrics) {
  std::unique_ptr<GenerationCore> core(new GenerationCore());
  core->metrics_ = metrics;
  if (config.cpu_threads() > 0) at::set_num_threads(config.cpu_threads());
  ASSIGN_OR_RETURN(core->backend_, CreateBackend(config.device()));
  core->placement_ = std::make_unique<PlacementManager>(core->backend_.get());
  for (const v1::PipelineConfig& p : config.pipelines()) {
    ASSIGN_OR_RETURN(std::shared_ptr<Hosted> hosted, core->Build(p));
    absl::MutexLock lock(&core->pipelines_mu_);
    core->pipelines_.push_back(std::move(hosted));
  }
  if (config.has_strategy()) {
    ASSIGN_OR_RETURN(std::unique_ptr<OffloadStrategy> strategy,
                     ToOffloadStrategy(config.strategy(), core->ComponentNames()));
    core->placement_->SetStrategy(std::move(strategy));
  }
  for (const std::string& warning : core->placement_->Warnings()) {
    std::cerr << "stowage_server: warning: " << warning << std::endl;
  }
  const std::string device = core->backend_->name();
  core->worker_ = std::make_unique<DeviceWorker>(
      device, config.queue_depth(), [metrics, device](int depth) {
        if (metrics != nullptr) metrics->SetQueueDepth(device, depth);
      });
  if (metrics != nullptr) metrics->SetQueueDepth(device, 0);
  return core;
}

GenerationCore::~GenerationCore() {
  worker_.reset();
  // Group offloading hooks the pipelines' modules: placement lets go of them first.
  absl::MutexLock lock(&pipelines_mu_);
  for (const auto& hosted : pipelines_) placement_->Unregister(hosted->pipeline->name());
}

absl::StatusOr<std::shared_ptr<GenerationCore::Hosted>> GenerationCore::Build(
    const v1::PipelineConfig& p) {
  TinyPipelineOptions options;
  options.name = p.name();
  options.dtype = p.dtype() == "bfloat16" ? at::kBFloat16 : at::kFloat;
  options.weight_seed = p.weight_seed();
  options.device = backend_->torch_device();
  ZImagePipelineOptions zimage;
  zimage.name = p.name();
  zimage.dtype = options.dtype;
  zimage.weight_seed = options.weight_seed;
  zimage.device = options.device;
  std::unique_ptr<Pipeline> pipeline;
  if (p.source_case() == v1::PipelineConfig::kModelDir) {
    ASSIGN_OR_RETURN(auto index, ReadModelIndex(p.model_dir()));
    if (index.count("transformer") > 0 && index.at("transformer") == "ZImageTransformer2DModel") {
      ASSIGN_OR_RETURN(pipeline, LoadZImagePipeline(p.model_dir(), zimage, p.random_weights(), &component_cache_));
    } else {
      ASSIGN_OR_RETURN(pipeline, LoadTinyPipeline(p.model_dir(), options, p.random_weights(), &component_cache_));
    }
  } else if (p.builtin() == "zimage-tiny") {
    ASSIGN_OR_RETURN(pipeline, CreateTinyZImagePipeline(zimage));
  } else {
    ASSIGN_OR_RETURN(pipeline, CreateTinyPipeline(options));
  }
  for (Component* component : pipeline->components()) {
    RETURN_IF_ERROR(placement_->Register(p.name(), component));
  }
  if (p.group_offload().enabled()) {
    absl::StatusOr<PipelineGroupOffloadOptions> offload =
        ToPipelineGroupOffloadOptions(p.group_offload(), p.name());
    absl::Status status = offload.status();
    if (status.ok()) status = placement_->EnablePipelineGroupOffload(p.name(), *offload);
    if (!status.ok()) {
      placement_->Unregister(p.name());
      return status;
    }
  }
  auto hosted = std::make_shared<Hosted>();
  hosted->pipeline = std::move(pipeline);
  hosted->is_default = p.default_();
  return hosted;
}

absl::StatusOr<v1::Pipeline> GenerationCore::LoadPipeline(const v1::PipelineConfig& config) {
  v1::PipelineConfig p = config;
  RETURN_IF_ERROR(FinalizePipelineConfig(p, "pipeline"));
  p.set_default_(false);
  {
    absl::MutexLock lock(&pipelines_mu_);
    for (const auto& hosted : pipelines_) {
      if (hosted->pipeline->name() == p.name()) {
        return absl::AlreadyExistsError(absl::StrCat("pipeline '", p.name(), "' is already loaded"));
      }
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Hosted> hosted, Build(p));
  absl::MutexLock lock(&pipelines_mu_);
  if (pipelines_.empty()) hosted->is_default = true;
  pipelines_.push_back(hosted);
  return Describe(*hosted);
}

absl::Status GenerationCore::UnloadPipeline(const std::string& name,
                                            const std::function<absl::Status()>& interrupt) {
  std::shared_ptr<Hosted> hosted;
  {
    absl::MutexLock lock(&pipelines_mu_);
    for (auto it = pipelines_.begin(); it != pipelines_.end(); ++it) {
      if ((*it)->pipeline->name() == name) {
        hosted = *it;
        pipelines_.erase(it);
        break;
      }
    }
    if (hosted == nullptr) return absl::NotFoundError(absl::StrCat("pipeline '", name, "' is not loaded"));
    if (hosted->is_default && !pipelines_.empty()) pipelines_.front()->is_default = true;
  }
  // In-flight requests hold their own references.
  while (hosted.use_count() > 1) {
    if (interrupt) {
      absl::Status status = interrupt();
      if (!status.ok()) {
        absl::MutexLock lock(&pipelines_mu_);
        pipelines_.push_back(hosted);  // Give up: it keeps serving.
        return status;
      }
    }
    absl::SleepFor(absl::Milliseconds(10));
  }
  placement_->Unregister(name);
  return absl::OkStatus();
}

std::vector<std::string> GenerationCore::ComponentNames() {
  absl::MutexLock lock(&pipelines_mu_);
  std::vector<std::string> names;
  for (const auto& hosted : pipelines_) {
    for (Component* c : hosted->pipeline->components()) {
      if (std::find(names.begin(), names.end(), c->name()) == names.end()) names.push_back(c->name());
    }
  }
  return names;
}

absl::StatusOr<std::shared_ptr<GenerationCore::Hosted>> GenerationCore::Resolve(const std::string& name) {
  absl::MutexLock lock(&pipelines_mu_);
  std::vector<std::string> names;
  for (const auto& hosted : pipelines_) {
    if (name.empty() ? hosted->is_default : hosted->pipeline->name() == name) return hosted;
    names.push_back(hosted->pipeline->name());
  }
  if (name.empty()) return absl::NotFoundError("no pipeline is loaded");
  return absl::NotFoundError(absl::StrCat("pipeline '", name, "' not found; available: ",
                                          absl::StrJoin(names, ", ")));
}

std::string GenerationCore::PipelineLabel(const v1::GenerateRequest& request) {
  absl::StatusOr<std::shared_ptr<Hosted>> hosted = Resolve(request.pipeline());
  return hosted.ok() ? (*hosted)->pipeline->name() : "unknown";
}

absl::StatusOr<GenerationParams> GenerationCore::Validate(const v1::GenerateRequest& request,
                                                          const Pipeline& pipeline) const {
  const PipelineLimits& limits = pipeline.limits();
  GenerationParams params;
  if (request.prompt().empty()) return absl::InvalidArgumentError("prompt is required");
  if (static_cast<int>(request.prompt().size()) > limits.max_prompt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("prompt is ", request.prompt().size(),
                                                   " bytes; at most ", limits.max_prompt_bytes,
                                                   " bytes allowed by pipeline '", pipeline.name(), "'"));
  }
  if (static_cast<int>(request.negative_prompt().size()) > limits.max_prompt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("negative_prompt is ", request.negative_prompt().size(),
                                                   " bytes; at most ", limits.max_prompt_bytes,
                                                   " bytes allowed by pipeline '", pipeline.name(), "'"));
  }
  params.prompt = request.prompt();
  params.negative_prompt = request.negative_prompt();
  params.width = request.width() == 0 ? limits.default_width : request.width();
  params.height = request.height() == 0 ? limits.default_height : request.height();
  RETURN_IF_ERROR(CheckSize("width", params.width, limits));
  RETURN_IF_ERROR(CheckSize("height", params.height, limits));
  if (request.num_inference_steps() < 0 || request.num_inference_steps() > limits.max_steps) {
    return absl::InvalidArgumentError(absl::StrCat("num_inference_steps is ", request.num_inference_steps(),
                                                   "; allowed: 1 to ", limits.max_steps,
                                                   ", or 0 for the default (", limits.default_steps, ")"));
  }
  params.steps = request.num_inference_steps() == 0 ? limits.default_steps : request.num_inference_steps();
  if (request.has_guidance_scale()) {
    const float g = request.guidance_scale();
    if (!std::isfinite(g) || g < 0.0f || g > 100.0f) {
      return absl::InvalidArgumentError(
          absl::StrCat("guidance_scale is ", g, "; must be finite and within [0, 100]"));
    }
    params.guidance_scale = g;
  } else {
    params.guidance_scale = limits.default_guidance_scale;
  }
  if (request.output_format() != v1::IMAGE_FORMAT_UNSPECIFIED &&
      request.output_format() != v1::IMAGE_FORMAT_PNG) {
    return absl::InvalidArgumentError(absl::StrCat("output_format ", static_cast<int>(request.output_format()),
                                                   " is not supported; allowed: IMAGE_FORMAT_PNG"));
  }
  if (request.request_id().size() > 128) {
    return absl::InvalidArgumentError("request_id is longer than 128 characters");
  }
  for (char c : request.request_id()) {
    if (c < 0x20 || c > 0x7e) {
      return absl::InvalidArgumentError("request_id must be printable ASCII");
    }
  }
  if (request.has_seed()) {
    params.seed = request.seed();
  } else {
    std::random_device device;
    params.seed = (static_cast<uint64_t>(device()) << 32) ^ device();
  }
  return params;
}

absl::StatusOr<v1::GenerateResponse> GenerationCore::Generate(const v1::GenerateRequest& request,
                                                              const CallControl& control) {
  ASSIGN_OR_RETURN(std::shared_ptr<Hosted> hosted, Resolve(request.pipeline()));
  ASSIGN_OR_RETURN(GenerationParams params, Validate(request, *hosted->pipeline));
  RETURN_IF_ERROR(control.interrupt ? control.interrupt() : absl::OkStatus());

  absl::Notification done;
  absl::StatusOr<v1::GenerateResponse> result = absl::InternalError("request did not run");
  DeviceWorker::Job job;
  job.run = [&](absl::Duration queue_wait) {
    result = RunOnWorker(*hosted, params, request, control, queue_wait);
    done.Notify();
  };
  if (control.interrupt) {
    job.cancelled = [&] { return !control.interrupt().ok(); };
    job.drop = [&] {
      result = control.interrupt();
      if (result.ok()) result = absl::CancelledError("dropped from the queue");
      done.Notify();
    };
  }
  RETURN_IF_ERROR(worker_->Submit(std::move(job)));
  done.WaitForNotification();
  return result;
}

absl::StatusOr<v1::GenerateResponse> GenerationCore::RunOnWorker(Hosted& hosted,
                                                                 const GenerationParams& params,
                                                                 const v1::GenerateRequest& request,
                                                                 const CallControl& control,
                                                                 absl::Duration queue_wait) {
  RETURN_IF_ERROR(control.interrupt ? control.interrupt() : absl::OkStatus());
  const absl::Time start = absl::Now();
  const std::string request_id =
      request.request_id().empty() ? absl::StrCat("req-", ++request_counter_) : request.request_id();
  placement_->SetRequestId(request_id);
  backend_->ResetPeakStats();
  // Peak RSS falls back to the lifetime peak where clear_refs is not writable (still an upper
  // bound, never an under-report).
  (void)ResetPeakRss();
  const DeviceMemoryStats before = backend_->GetMemoryStats();

  const google::protobuf::Duration queue_wait_proto = ToProto(queue_wait);
  RunContext context(control.interrupt, [&](const std::string& stage, int step, int total) {
    if (!control.on_progress) return;
    v1::Progress progress;
    progress.set_stage(stage);
    progress.set_step(step);
    progress.set_total_steps(total);
    *progress.mutable_elapsed() = ToProto(absl::Now() - start);
    *progress.mutable_queue_wait() = queue_wait_proto;
    control.on_progress(progress);
  });
  RETURN_IF_ERROR(hosted.pipeline->CheckSourceFiles());
  absl::StatusOr<Image> run = hosted.pipeline->Run(params, *placement_, context);
  RETURN_IF_ERROR(hosted.pipeline->CheckSourceFiles());  // Changed during the run: discard it.
  ASSIGN_OR_RETURN(Image image, std::move(run));
  context.BeginStage("encode_image");
  ASSIGN_OR_RETURN(std::string png, EncodePng(image));
  context.EndStage();
  backend_->Synchronize();

  const DeviceMemoryStats after = backend_->GetMemoryStats();
  v1::GenerateResponse response;
  response.set_image(std::move(png));
  response.set_format(v1::IMAGE_FORMAT_PNG);
  response.set_width(image.width);
  response.set_height(image.height);
  response.set_seed(params.seed);
  response.set_pipeline(hosted.pipeline->name());
  response.set_request_id(request_id);
  v1::RequestStats* stats = response.mutable_stats();
  *stats->mutable_queue_wait() = queue_wait_proto;
  *stats->mutable_run_time() = ToProto(absl::Now() - start);
  for (const RunContext::StageTime& stage : context.stage_times()) {
    v1::StageTiming* timing = stats->add_stages();
    timing->set_stage(stage.stage);
    *timing->mutable_duration() = ToProto(stage.duration);
  }
  stats->set_peak_device_memory_bytes(after.peak_allocated_bytes);
  absl::StatusOr<ProcessMemory> memory = ReadProcessMemory();
  if (memory.ok()) stats->set_peak_cpu_rss_bytes(memory->peak_rss_bytes);
  stats->set_host_to_device_bytes(after.host_to_device_bytes - before.host_to_device_bytes);
  stats->set_device_to_host_bytes(after.device_to_host_bytes - before.device_to_host_bytes);
  stats->set_device(backend_->name());
  return response;
}

v1::Pipeline GenerationCore::Describe(const Hosted& hosted) const {
  const Pipeline& p = *hosted.pipeline;
  const PipelineLimits& limits = p.limits();
  v1::Pipeline out;
  out.set_name(p.name());
  out.set_description(p.description());
  out.set_is_default(hosted.is_default);
  out.set_device(backend_->name());
  out.set_default_width(limits.default_width);
  out.set_default_height(limits.default_height);
  out.set_min_size(limits.min_size);
  out.set_max_size(limits.max_size);
  out.set_size_multiple(limits.size_multiple);
  out.set_default_inference_steps(limits.default_steps);
  out.set_max_inference_steps(limits.max_steps);
  out.set_default_guidance_scale(limits.default_guidance_scale);
  out.set_max_prompt_bytes(limits.max_prompt_bytes);
  for (Component* component : hosted.pipeline->components()) {
    v1::PipelineComponent* c = out.add_components();
    c->set_name(component->name());
    c->set_kind(component->kind());
    c->set_weight_bytes(component->weight_bytes());
    c->set_parameter_count(component->parameter_count());
    c->set_dtype(DtypeName(component->dtype()));
  }
  return out;
}

v1::ListPipelinesResponse GenerationCore::ListPipelines() {
  absl::MutexLock lock(&pipelines_mu_);
  v1::ListPipelinesResponse response;
  for (const auto& hosted : pipelines_) *response.add_pipelines() = Describe(*hosted);
  return response;
}

}  // namespace stowage
