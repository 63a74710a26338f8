#include "tests/runtime/latch_pipeline.h"

#include <utility>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "offload/module.h"

namespace stowage {

void LatchGate::Allow(int steps) {
  absl::MutexLock lock(&mu_);
  allowed_ += steps;
}

void LatchGate::Open() {
  absl::MutexLock lock(&mu_);
  open_ = true;
}

void LatchGate::AwaitArrivals(int count) {
  std::pair<LatchGate*, int> wait{this, count};
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](std::pair<LatchGate*, int>* w) ABSL_NO_THREAD_SAFETY_ANALYSIS { return w->first->arrivals_ >= w->second; },
      &wait));
}

int LatchGate::arrivals() const {
  absl::MutexLock lock(&mu_);
  return arrivals_;
}

std::vector<std::vector<std::string>> LatchGate::batches() const {
  absl::MutexLock lock(&mu_);
  return batches_;
}

void LatchGate::Arrive() {
  absl::MutexLock lock(&mu_);
  ++arrivals_;
  mu_.Await(absl::Condition(
      +[](LatchGate* g) ABSL_NO_THREAD_SAFETY_ANALYSIS { return g->open_ || g->passed_ < g->allowed_; }, this));
  ++passed_;
}

void LatchGate::RecordBatch(std::vector<std::string> prompts) {
  absl::MutexLock lock(&mu_);
  batches_.push_back(std::move(prompts));
}

namespace {

class LatchModule : public Module {
 public:
  LatchModule() : Module("LatchModule") { weight_ = AddParameter("weight", at::ones({256})); }
  // One step's "compute": reads the weights where placement put them.
  void Forward() {
    ForwardScope scope(*this);
    (void)tensor(weight_).sum().item<float>();
  }

 private:
  int weight_;
};

class LatchPipeline : public Pipeline {
 public:
  LatchPipeline(std::string name, std::shared_ptr<LatchGate> gate, std::unique_ptr<Component> transformer)
      : name_(std::move(name)), gate_(std::move(gate)), transformer_(std::move(transformer)) {
    limits_.default_width = 64;
    limits_.default_height = 64;
    limits_.max_size = 256;
    limits_.default_steps = 2;
  }

  const std::string& name() const override { return name_; }
  std::string description() const override { return "latch: a test pipeline whose steps wait at a gate"; }
  const PipelineLimits& limits() const override { return limits_; }
  std::vector<Component*> components() override { return {transformer_.get()}; }
  bool batched() const override { return true; }

  absl::StatusOr<Image> Run(const GenerationParams& params, ComponentRunner& runner, RunContext& context) override {
    std::vector<absl::StatusOr<Image>> results = RunBatch({BatchMember{&params, &context}}, runner);
    return std::move(results.front());
  }

  std::vector<absl::StatusOr<Image>> RunBatch(const std::vector<BatchMember>& members,
                                              ComponentRunner& runner) override {
    BatchRun run(members);
    if (members.empty() || !run.Compatible()) return run.TakeResults();
    std::vector<std::string> prompts;
    for (const BatchMember& m : members) prompts.push_back(m.params->prompt);
    gate_->RecordBatch(std::move(prompts));
    const int steps = members.front().params->steps;
    run.BeginStage("denoise", steps);
    auto* module = static_cast<LatchModule*>(&transformer_->module());
    for (int step = 1; step <= steps; ++step) {
      run.Filter([&](size_t i) { return members[i].context->CheckInterrupt(); });
      if (run.active().empty()) break;
      gate_->Arrive();
      const absl::Status ran = runner.Run(*transformer_, [&] { module->Forward(); });
      run.Filter([&](size_t) { return ran; });
      for (size_t i : run.active()) members[i].context->ReportStep(step, steps);
    }
    for (size_t i : run.active()) {
      members[i].context->EndStage();
      Image image;
      image.width = members[i].params->width;
      image.height = members[i].params->height;
      image.rgb.assign(static_cast<size_t>(image.width) * image.height * 3,
                       static_cast<uint8_t>(members[i].params->seed % 256));
      run.set_result(i, std::move(image));
    }
    return run.TakeResults();
  }

 private:
  std::string name_;
  std::shared_ptr<LatchGate> gate_;
  std::unique_ptr<Component> transformer_;
  PipelineLimits limits_;
};

}  // namespace

PipelineRegistry LatchRegistry(std::shared_ptr<LatchGate> gate) {
  PipelineArchitecture a;
  a.class_names = {"StowageLatchPipeline"};
  a.builtins = {"latch"};
  a.create_builtin = [gate](const std::string&, const PipelineLoadOptions& o)
      -> absl::StatusOr<std::unique_ptr<Pipeline>> {
    if (!o.fp8_components.empty()) return absl::UnimplementedError("latch: no FP8 compute");
    absl::StatusOr<std::unique_ptr<Component>> transformer =
        Component::Create("transformer", std::make_unique<LatchModule>(), at::kFloat);
    if (!transformer.ok()) return transformer.status();
    std::unique_ptr<Pipeline> pipeline = std::make_unique<LatchPipeline>(o.name, gate, std::move(*transformer));
    return pipeline;
  };
  a.load_dir = [](const std::string& dir, const PipelineLoadOptions&) -> absl::StatusOr<std::unique_ptr<Pipeline>> {
    return absl::InvalidArgumentError(absl::StrCat(dir, ": the latch family has no model directories"));
  };
  PipelineRegistry registry;
  const absl::Status registered = registry.Register(std::move(a));
  if (!registered.ok()) std::abort();  // A fresh registry takes any name.
  return registry;
}

}  // namespace stowage
