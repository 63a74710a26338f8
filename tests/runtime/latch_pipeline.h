// The "latch" pipeline family: a pipeline whose denoising steps wait at a gate the test holds (as
// TF Serving's FakeLoader blocks on a latch), so tests of the runtime — lifecycles, batching,
// cancellation, the order of admin changes and requests — decide what happens when, without gRPC
// and without sleeping.
//
// It is also the small example of a new family: this file pair and one Register call (LatchRegistry)
// are all it takes; nothing under runtime/ or server/ names it. The runtime gets the registry
// through RuntimeFactories.
//
//   auto gate = std::make_shared<LatchGate>();
//   PipelineRegistry registry = LatchRegistry(gate);
//   ... DeviceSet::Create(config, nullptr, RuntimeFactories{&registry}) with builtin "latch" ...
//   std::thread t([&] { devices->Generate(request, control); });
//   gate->AwaitArrivals(1);   // its first step waits at the gate: the request is running
//   ... act while it runs ...
//   gate->Allow(2);           // two steps may pass
#ifndef STOWAGE_TESTS_RUNTIME_LATCH_PIPELINE_H_
#define STOWAGE_TESTS_RUNTIME_LATCH_PIPELINE_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "models/pipeline_registry.h"

namespace stowage {

// The gate every denoising step of the family's pipelines passes. Thread-safe.
class LatchGate {
 public:
  // Lets `steps` more steps pass (over all runs, in arrival order).
  void Allow(int steps);
  // Every step from now on passes (teardown; a test that failed midway never hangs its runs).
  void Open();
  // Blocks until `count` steps in all have arrived at the gate (passed or waiting).
  void AwaitArrivals(int count);
  int arrivals() const;

  // One entry per RunBatch call, in order: its members' prompts.
  std::vector<std::vector<std::string>> batches() const;

  // Called by the pipeline.
  void Arrive();
  void RecordBatch(std::vector<std::string> prompts);

 private:
  mutable absl::Mutex mu_;
  int allowed_ ABSL_GUARDED_BY(mu_) = 0;
  int passed_ ABSL_GUARDED_BY(mu_) = 0;
  int arrivals_ ABSL_GUARDED_BY(mu_) = 0;
  bool open_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::vector<std::string>> batches_ ABSL_GUARDED_BY(mu_);
};

// A registry with the family's one built-in, "latch": one component ("transformer", 256 float
// weights that placement moves like any component's) run once per step; batched (one RunBatch per
// batch); images of the requested size whose bytes are the member's seed modulo 256.
PipelineRegistry LatchRegistry(std::shared_ptr<LatchGate> gate);

}  // namespace stowage

#endif  // STOWAGE_TESTS_RUNTIME_LATCH_PIPELINE_H_
