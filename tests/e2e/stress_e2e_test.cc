// Everything at once against one in-process server, for a bounded time: unary and streamed
// generation, cancellation and short deadlines, group offload switched on and off, strategies
// switched, the device's memory budget set and lifted, a pipeline loaded and unloaded (and used while
// it comes and goes; host copies pinned, so its weights may be prefetched while the other runs),
// placement views and the metrics page read. Every answer must be one of the documented ones, the server must still
// answer a health check at the end, and the same request must still give the same image.
//
// Runs under ThreadSanitizer in CI (`./stowage test`); STOWAGE_STRESS_SECONDS sets the duration.
#include <atomic>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "absl/synchronization/mutex.h"
#include "google/protobuf/text_format.h"
#include "tests/e2e/e2e_harness.h"
#include "tests/e2e/http_get.h"

namespace stowage {
namespace {

using std::chrono::milliseconds;

absl::Duration StressDuration() {
  const char* env = std::getenv("STOWAGE_STRESS_SECONDS");
  const int seconds = env != nullptr ? std::atoi(env) : 6;
  return absl::Seconds(seconds > 0 && seconds <= 600 ? seconds : 6);
}

// Counts every status code each actor saw, and flags any outside its allowed set.
class Tally {
 public:
  void Record(const std::string& actor, const grpc::Status& status, const std::set<grpc::StatusCode>& allowed) {
    absl::MutexLock lock(&mu_);
    ++counts_[actor][status.error_code()];
    if (status.ok() || allowed.count(status.error_code()) > 0) return;
    unexpected_.push_back(actor + ": " + std::to_string(status.error_code()) + " " + status.error_message());
  }
  std::vector<std::string> unexpected() const {
    absl::MutexLock lock(&mu_);
    return unexpected_;
  }
  std::string Summary() const {
    absl::MutexLock lock(&mu_);
    std::string out;
    for (const auto& [actor, codes] : counts_) {
      out += actor + ":";
      for (const auto& [code, n] : codes) out += " " + std::to_string(code) + "x" + std::to_string(n);
      out += "\n";
    }
    return out;
  }
  int ok(const std::string& actor) const {
    absl::MutexLock lock(&mu_);
    auto it = counts_.find(actor);
    if (it == counts_.end()) return 0;
    auto ok = it->second.find(grpc::OK);
    return ok == it->second.end() ? 0 : ok->second;
  }

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::map<grpc::StatusCode, int>> counts_ ABSL_GUARDED_BY(mu_);
  std::vector<std::string> unexpected_ ABSL_GUARDED_BY(mu_);
};

TEST(StressTest, EverythingAtOnceForABoundedTime) {
  v1::ServerConfig config;
  config.set_queue_depth(8);
  config.set_metrics_address("127.0.0.1:0");
  // Host copies pinned: the next pipeline's weights may be prefetched while a request runs.
  ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"pb(
    device { pin_host_copies: true }
    pipelines { name: "zimage-tiny" builtin: "zimage-tiny" default: true })pb", &config));
  E2eServer server(config);
  ASSERT_TRUE(server.ok());
  v1::GenerateResponse reference;
  ASSERT_TRUE(server.Generate(E2eServer::SmallRequest("", 11), &reference).ok());
  v1::ListPipelinesResponse listed;
  ASSERT_TRUE(server.Pipelines(&listed).ok());
  int64_t weights = 0;
  for (const auto& p : listed.pipelines()) {
    for (const auto& c : p.components()) weights += c.weight_bytes();
  }

  const absl::Time end = absl::Now() + StressDuration();
  auto running = [&] { return absl::Now() < end; };
  Tally tally;
  // Requests may meet a full queue, a deadline, a cancellation, or the extra pipeline mid-change.
  const std::set<grpc::StatusCode> request_codes = {grpc::RESOURCE_EXHAUSTED, grpc::DEADLINE_EXCEEDED,
                                                    grpc::CANCELLED};
  const std::set<grpc::StatusCode> extra_codes = {grpc::RESOURCE_EXHAUSTED, grpc::DEADLINE_EXCEEDED,
                                                  grpc::NOT_FOUND, grpc::UNAVAILABLE, grpc::FAILED_PRECONDITION};
  std::vector<std::thread> actors;

  for (int i = 0; i < 2; ++i) {
    actors.emplace_back([&, i] {
      while (running()) {
        v1::GenerateResponse response;
        const grpc::Status s = server.Generate(E2eServer::SmallRequest("", 11), &response);
        tally.Record("generate", s, request_codes);
        if (s.ok() && response.image() != reference.image()) tally.Record("image", grpc::Status(grpc::DATA_LOSS, "image changed"), {});
        (void)i;
      }
    });
  }
  actors.emplace_back([&] {  // Streams, cancelled after the first event every other time.
    for (int n = 0; running(); ++n) {
      grpc::ClientContext context;
      context.set_deadline(In(milliseconds(60000)));
      auto reader = server.generation().GenerateStream(&context, E2eServer::SmallRequest("", 11));
      v1::GenerateStreamResponse message;
      bool first = reader->Read(&message);
      if (first && n % 2 == 0) context.TryCancel();
      while (reader->Read(&message)) {
      }
      tally.Record("stream", reader->Finish(), request_codes);
    }
  });
  actors.emplace_back([&] {  // Deadlines that expire in the queue or mid-run.
    while (running()) {
      tally.Record("deadline", server.Generate(E2eServer::SmallRequest("", 3), nullptr, milliseconds(20)),
                   request_codes);
    }
  });
  actors.emplace_back([&] {  // Group offload on and off, on the component the requests use.
    while (running()) {
      v1::EnableGroupOffloadRequest enable;
      enable.set_component_id("zimage-tiny/transformer");
      enable.mutable_options()->set_use_stream(true);
      v1::EnableGroupOffloadResponse enabled;
      tally.Record("enable", server.admin().EnableGroupOffload(E2eServer::Authed().get(), enable, &enabled), {});
      v1::DisableGroupOffloadRequest disable;
      disable.set_component_id("zimage-tiny/transformer");
      v1::DisableGroupOffloadResponse disabled;
      tally.Record("disable", server.admin().DisableGroupOffload(E2eServer::Authed().get(), disable, &disabled), {});
    }
  });
  actors.emplace_back([&] {  // Strategies.
    const std::vector<std::string> strategies = {
        R"pb(strategy { footprint { reserve_bytes: 0 } })pb",
        R"pb(strategy { custom: "text-encoders-only" })pb",
        R"pb(strategy { workflow { rules { after { component: "text_encoder" offload: "text_encoder" } } } })pb"};
    for (size_t n = 0; running(); ++n) {
      v1::SetOffloadStrategyRequest request;
      ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(strategies[n % strategies.size()], &request));
      v1::SetOffloadStrategyResponse response;
      tally.Record("strategy", server.admin().SetOffloadStrategy(E2eServer::Authed().get(), request, &response), {});
    }
  });
  actors.emplace_back([&] {  // The device's budget set (room for both pipelines, not for much more) and lifted.
    for (int n = 0; running(); ++n) {
      // Beside the device's context as it is now (CUDA's on the GPU host grows as kernels load).
      v1::GetPlacementResponse now;
      tally.Record("budget_read", server.admin().GetPlacement(E2eServer::Authed().get(), {}, &now), {});
      v1::SetMemoryBudgetRequest request;
      request.set_memory_budget_bytes(n % 2 == 0 ? now.context_bytes() + 4 * weights : 0);
      v1::SetMemoryBudgetResponse response;
      // Refused when what cannot move at that moment does not fit: a clear status, nothing changed.
      tally.Record("budget", server.admin().SetMemoryBudget(E2eServer::Authed().get(), request, &response),
                   {grpc::FAILED_PRECONDITION});
      absl::SleepFor(absl::Milliseconds(30));
    }
  });
  actors.emplace_back([&] {  // A pipeline that comes and goes.
    while (running()) {
      v1::LoadPipelineRequest load;
      load.mutable_pipeline()->set_name("extra");
      load.mutable_pipeline()->set_builtin("tiny");
      v1::LoadPipelineResponse loaded;
      tally.Record("load", server.admin().LoadPipeline(E2eServer::Authed().get(), load, &loaded), {});
      absl::SleepFor(absl::Milliseconds(20));
      v1::UnloadPipelineRequest unload;
      unload.set_name("extra");
      v1::UnloadPipelineResponse unloaded;
      tally.Record("unload", server.admin().UnloadPipeline(E2eServer::Authed().get(), unload, &unloaded), {});
    }
  });
  actors.emplace_back([&] {  // Requests for the pipeline that comes and goes.
    while (running()) {
      tally.Record("extra", server.Generate(E2eServer::SmallRequest("extra", 5)), extra_codes);
    }
  });
  actors.emplace_back([&] {  // Readers: placement, pipelines, log, metrics page.
    while (running()) {
      v1::GetPlacementResponse placement;
      tally.Record("placement", server.admin().GetPlacement(E2eServer::Authed().get(), {}, &placement), {});
      grpc::ClientContext context;
      v1::ListPipelinesResponse list;
      tally.Record("list", server.generation().ListPipelines(&context, {}, &list), {});
      v1::GetPlacementLogResponse log;
      tally.Record("log", server.admin().GetPlacementLog(E2eServer::Authed().get(), {}, &log), {});
      const std::string page = HttpGet(server.server().metrics_address(), "/metrics");
      if (page.find("stowage_component_state") == std::string::npos) {
        tally.Record("metrics", grpc::Status(grpc::DATA_LOSS, "metrics page without placement"), {});
      }
    }
  });
  for (auto& t : actors) t.join();

  std::cout << "status codes seen (code x count):\n" << tally.Summary();
  for (const std::string& line : tally.unexpected()) ADD_FAILURE() << line;
  EXPECT_GT(tally.ok("generate"), 0);
  EXPECT_GT(tally.ok("enable"), 0);
  EXPECT_GT(tally.ok("load"), 0);
  EXPECT_GT(tally.ok("budget"), 0);
  EXPECT_TRUE(HealthServing(server.channel()));
  // Still the same image, whichever state the switches ended in.
  v1::GenerateResponse after;
  ASSERT_TRUE(server.Generate(E2eServer::SmallRequest("", 11), &after).ok());
  EXPECT_EQ(after.image(), reference.image());
}

}  // namespace
}  // namespace stowage
