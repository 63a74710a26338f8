// batch_equivalence: how far a batched request's image is from the same request run alone, through a
// running server. Turns batching on (SetBatching), sends --members requests with different prompts
// and seeds at once (one batch), turns batching off, sends each alone, decodes the PNGs and compares
// them pixel by pixel. One JSON line to --out and a summary to stdout:
//   {"bench":"batch_vs_alone","members":N,"batch_sizes":[..],"max_abs_diff":..,"values_over_1":..,
//    "values":..,"identical_images":..,"size":..,"steps":..,"machine":..}
// max_abs_diff is in 8-bit levels over every RGB value of every member; values_over_1 counts values
// that differ by more than one level; rounds is how many times the members were sent before they ran
// as one batch (the server holds a batch open for members only once the requests' key has shown
// concurrent demand, so a first round may split). Exit status 1 when a request fails or the
// requests did not run as one batch within kMaxRounds.
//
//   batch_equivalence --target=127.0.0.1:50051 --token=T --members=4 --size=1024 --steps=8 --out=rows.jsonl
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "bench/bench_client.h"
#include "models/core/image.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address.");
ABSL_FLAG(std::string, token, "", "Admin token (SetBatching).");
ABSL_FLAG(std::string, pipeline, "", "Pipeline; empty = the default.");
ABSL_FLAG(int32_t, members, 4, "Requests in the batch (2..64).");
ABSL_FLAG(int32_t, size, 1024, "Image width and height.");
ABSL_FLAG(int32_t, steps, 8, "Denoising steps.");
ABSL_FLAG(std::string, machine, "unknown", "Label for the machine.");
ABSL_FLAG(std::string, out, "", "JSON lines file to append to.");

namespace {

using stowage::v1::AdminService;
using stowage::v1::GenerationService;

// Batches held open until they are full (the test sends exactly that many requests at once).
constexpr int kHoldMs = 10000;

stowage::v1::GenerateRequest Request(const std::string& pipeline, int i) {
  // Prompts of different lengths: the batch pads and masks them.
  static const char* kPrompts[] = {"a red circle", "a lighthouse on a rocky cliff above the sea at dusk, oil painting",
                                   "green", "two cats sleeping on a windowsill in the afternoon sun"};
  stowage::v1::GenerateRequest r;
  r.set_pipeline(pipeline);
  r.set_prompt(absl::StrCat(kPrompts[i % 4], i >= 4 ? absl::StrCat(" ", i) : ""));
  r.set_width(absl::GetFlag(FLAGS_size));
  r.set_height(absl::GetFlag(FLAGS_size));
  r.set_num_inference_steps(absl::GetFlag(FLAGS_steps));
  r.set_guidance_scale(0.0f);
  r.set_seed(static_cast<uint64_t>(100 + i));
  return r;
}

bool Generate(GenerationService::Stub& stub, const stowage::v1::GenerateRequest& request,
              stowage::v1::GenerateResponse* response) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  const grpc::Status status = stub.Generate(&context, request, response);
  if (!status.ok()) std::cerr << "batch_equivalence: Generate: " << status.error_message() << "\n";
  return status.ok();
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int members = absl::GetFlag(FLAGS_members);
  if (members < 2 || members > 64) {
    std::cerr << "batch_equivalence: --members must be within 2..64\n";
    return 2;
  }
  auto channel = stowage::bench::MakeChannel(absl::GetFlag(FLAGS_target));
  auto stub = GenerationService::NewStub(channel);
  auto admin = AdminService::NewStub(channel);
  std::string pipeline = absl::GetFlag(FLAGS_pipeline);
  if (pipeline.empty()) pipeline = stowage::bench::DefaultPipeline(*stub);
  if (pipeline.empty()) return 1;
  const std::string token = absl::GetFlag(FLAGS_token);
  if (!stowage::bench::SetBatching(*admin, token, pipeline, members, kHoldMs)) return 1;
  std::vector<stowage::v1::GenerateResponse> batched(static_cast<size_t>(members));
  std::vector<char> ok(static_cast<size_t>(members), 0);
  constexpr int kMaxRounds = 5;
  int rounds = 0;
  for (bool together = false; !together && rounds < kMaxRounds;) {
    ++rounds;
    std::vector<std::thread> threads;
    for (int i = 0; i < members; ++i) {
      threads.emplace_back([&, i] { ok[i] = Generate(*stub, Request(pipeline, i), &batched[i]) ? 1 : 0; });
    }
    for (std::thread& t : threads) t.join();
    together = std::all_of(batched.begin(), batched.end(),
                           [&](const stowage::v1::GenerateResponse& r) { return r.stats().batch_size() == members; });
  }
  if (!stowage::bench::SetBatching(*admin, token, pipeline, 1, 0)) return 1;
  int max_diff = 0;
  int64_t over_one = 0, values = 0, identical = 0;
  std::vector<int> batch_sizes;
  for (int i = 0; i < members; ++i) {
    stowage::v1::GenerateResponse alone;
    if (!ok[i] || !Generate(*stub, Request(pipeline, i), &alone)) return 1;
    batch_sizes.push_back(batched[i].stats().batch_size());
    auto a = stowage::DecodePng(batched[i].image());
    auto b = stowage::DecodePng(alone.image());
    if (!a.ok() || !b.ok() || a->rgb.size() != b->rgb.size()) {
      std::cerr << "batch_equivalence: undecodable or mismatched images\n";
      return 1;
    }
    bool same = true;
    for (size_t k = 0; k < a->rgb.size(); ++k) {
      const int d = std::abs(static_cast<int>(a->rgb[k]) - static_cast<int>(b->rgb[k]));
      max_diff = std::max(max_diff, d);
      over_one += d > 1;
      same = same && d == 0;
    }
    values += static_cast<int64_t>(a->rgb.size());
    identical += same;
  }
  const bool one_batch = std::all_of(batch_sizes.begin(), batch_sizes.end(), [&](int s) { return s == members; });
  const std::string row = absl::StrFormat(
      "{\"bench\":\"batch_vs_alone\",\"members\":%d,\"batch_sizes\":[%s],\"max_abs_diff\":%d,\"values_over_1\":%d,"
      "\"values\":%d,\"identical_images\":%d,\"size\":%d,\"steps\":%d,\"rounds\":%d,\"machine\":\"%s\"}",
      members, absl::StrJoin(batch_sizes, ","), max_diff, over_one, values, identical, absl::GetFlag(FLAGS_size),
      absl::GetFlag(FLAGS_steps), rounds, absl::GetFlag(FLAGS_machine));
  std::printf("%s\n", row.c_str());
  if (!absl::GetFlag(FLAGS_out).empty()) std::ofstream(absl::GetFlag(FLAGS_out), std::ios::app) << row << "\n";
  if (!one_batch) {
    std::cerr << "batch_equivalence: the requests did not run as one batch of " << members << "\n";
    return 1;
  }
  return 0;
}
