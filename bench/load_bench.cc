// load_bench: closed-loop clients against a running server, for the batching benchmark.
//
// For each batching setting (--batch_sizes; 1 = off, set through the admin SetBatching RPC) and
// each client count N (--concurrency), N clients each send --requests_per_client Generate requests
// one after another (a client sends its next request when its previous reply arrives). One JSON line
// per (setting, N) goes to --out and a table row to stdout:
//   {"bench":"batching","mode":..,"compress":..,"compute":..,"batching":true|false,"max_batch_size":..,"concurrency":N,
//    "images_per_s":..,"p50_s":..,"p99_s":..,"mean_batch_size":..,"requests":..,"failed":..,
//    "size":..,"steps":..,"format":"png"|"png_fast"|"rgb","machine":..,
//    "server_mean_s":{"queue_wait":..,"batch_wait":..,"run_time":..,"run_time_per_image":..,
//                     "stages":{"<stage>":..}},
//    "started_unix_s":..,"ended_unix_s":..}
// images_per_s = successful requests / wall time of the row; p50/p99 of the client-side latency.
// server_mean_s: the means over the row's successful replies of what each reply's RequestStats says
// (queue_wait, batch_wait, run_time; run_time_per_image = run_time / batch_size; each stage's time by
// its name — a batch's shared stages are the batch's, so a batch counts once per member): where the
// server's time goes, apart from the client's side. started_unix_s / ended_unix_s: the row's wall-clock
// span (to join with samples taken beside it, e.g. the GPU's clocks and power).
// Before each setting's rows, --warmup requests run alone (not measured).
//
//   load_bench --target=127.0.0.1:50051 --token=T --mode=streamed --machine=h200 --out=rows.jsonl
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "bench/bench_client.h"
#include "google/protobuf/util/time_util.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address.");
ABSL_FLAG(std::string, token, "", "Admin token (SetBatching).");
ABSL_FLAG(std::string, pipeline, "", "Pipeline; empty = default.");
ABSL_FLAG(int32_t, size, 1024, "Image width and height.");
ABSL_FLAG(int32_t, steps, 8, "Denoising steps.");
ABSL_FLAG(std::string, concurrency, "1,2,4,8", "Client counts, comma separated.");
ABSL_FLAG(std::string, batch_sizes, "1,8",
          "max_batch_size settings, comma separated (1 = off); \"keep\": the server's own setting, no admin call.");
ABSL_FLAG(int32_t, max_queue_delay_ms, 200,
          "max_queue_delay_ms when batching is on (about a reply's PNG transfer and the client's turnaround).");
ABSL_FLAG(int32_t, requests_per_client, 4, "Requests each client sends per row.");
ABSL_FLAG(int32_t, min_requests, 8, "Each row sends at least this many requests in all.");
ABSL_FLAG(int32_t, warmup, 1, "Unmeasured requests before each batching setting.");
ABSL_FLAG(std::string, mode, "unknown", "Label for the placement mode (resident, streamed).");
ABSL_FLAG(std::string, compress, "none", "Label for the streamed host copy's format (none, int8_grouped, int4).");
ABSL_FLAG(std::string, compute, "bf16", "Label for the transformer's compute mode (bf16, fp8).");
ABSL_FLAG(std::string, machine, "unknown", "Label for the machine.");
ABSL_FLAG(std::string, format, "png",
          "Image format the clients ask for: png (the default), png_fast (lossless, faster to encode) or rgb "
          "(raw pixels, nothing encoded).");
ABSL_FLAG(std::string, out, "", "JSON lines file to append to.");

namespace {

using Clock = std::chrono::steady_clock;

// A flag's list of counts; exits with status 2 (after saying which entry) when one is not >= 1.
std::vector<int> IntList(const std::string& text, const std::string& flag) {
  auto list = stowage::bench::PositiveIntList(text, flag);
  if (!list) std::exit(2);
  return *list;
}

struct Outcome {
  double latency_s = 0;
  bool ok = false;
  int batch_size = 0;
  // The reply's RequestStats in seconds: queue_wait, batch_wait, run_time, run_time_per_image; and
  // each stage by its name.
  std::map<std::string, double> server_s;
  std::map<std::string, double> stage_s;
};

double UnixSeconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

double Seconds(const google::protobuf::Duration& d) {
  return static_cast<double>(google::protobuf::util::TimeUtil::DurationToNanoseconds(d)) * 1e-9;
}

stowage::v1::ImageFormat g_format = stowage::v1::IMAGE_FORMAT_PNG;

Outcome GenerateOnce(stowage::v1::GenerationService::Stub& stub, int client, int index) {
  stowage::v1::GenerateRequest request;
  request.set_output_format(g_format);
  request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
  request.set_prompt(absl::StrCat("a lighthouse on a cliff at dusk, study ", client, "-", index));
  request.set_width(absl::GetFlag(FLAGS_size));
  request.set_height(absl::GetFlag(FLAGS_size));
  request.set_num_inference_steps(absl::GetFlag(FLAGS_steps));
  request.set_guidance_scale(0.0f);
  request.set_seed(static_cast<uint64_t>(client * 1000 + index));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  stowage::v1::GenerateResponse response;
  const auto start = Clock::now();
  const grpc::Status status = stub.Generate(&context, request, &response);
  Outcome o;
  o.latency_s = std::chrono::duration<double>(Clock::now() - start).count();
  // A reply in another format than asked for counts as failed (the rows name the format).
  o.ok = status.ok() && response.format() == g_format;
  if (status.ok() && !o.ok) std::cerr << "load_bench: asked for format " << g_format << ", got " << response.format() << "\n";
  o.batch_size = response.stats().batch_size();
  if (o.ok) {
    const stowage::v1::RequestStats& stats = response.stats();
    o.server_s["queue_wait"] = Seconds(stats.queue_wait());
    o.server_s["batch_wait"] = Seconds(stats.batch_wait());
    o.server_s["run_time"] = Seconds(stats.run_time());
    o.server_s["run_time_per_image"] = Seconds(stats.run_time()) / std::max(1, stats.batch_size());
    for (const stowage::v1::StageTiming& stage : stats.stages()) o.stage_s[stage.stage()] += Seconds(stage.duration());
  }
  if (!status.ok()) std::cerr << "load_bench: request failed: " << status.error_message() << "\n";
  return o;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "png") {
    g_format = stowage::v1::IMAGE_FORMAT_PNG;
  } else if (format == "png_fast") {
    g_format = stowage::v1::IMAGE_FORMAT_PNG_FAST;
  } else if (format == "rgb") {
    g_format = stowage::v1::IMAGE_FORMAT_RGB;
  } else {
    std::cerr << "load_bench: --format is '" << format << "'; allowed: png, png_fast, rgb\n";
    return 2;
  }
  auto channel = stowage::bench::MakeChannel(absl::GetFlag(FLAGS_target));
  auto stub = stowage::v1::GenerationService::NewStub(channel);
  auto admin = stowage::v1::AdminService::NewStub(channel);
  std::string pipeline = absl::GetFlag(FLAGS_pipeline);
  if (pipeline.empty()) pipeline = stowage::bench::DefaultPipeline(*stub);
  if (pipeline.empty()) return 1;
  std::ofstream out;
  if (!absl::GetFlag(FLAGS_out).empty()) out.open(absl::GetFlag(FLAGS_out), std::ios::app);
  std::printf("%-24s %-6s %4s %8s %8s %8s %10s %6s\n", "mode", "batch", "N", "img/s", "p50 s", "p99 s", "mean batch",
              "failed");
  int exit_code = 0;
  const bool keep = absl::GetFlag(FLAGS_batch_sizes) == "keep";
  for (const int batch : keep ? std::vector<int>{0} : IntList(absl::GetFlag(FLAGS_batch_sizes), "batch_sizes")) {
    if (!keep && !stowage::bench::SetBatching(*admin, absl::GetFlag(FLAGS_token), pipeline, batch,
                                               absl::GetFlag(FLAGS_max_queue_delay_ms))) {
      return 1;
    }
    for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) (void)GenerateOnce(*stub, 999, i);
    for (const int n : IntList(absl::GetFlag(FLAGS_concurrency), "concurrency")) {
      const int per_client = std::max(absl::GetFlag(FLAGS_requests_per_client),
                                      (absl::GetFlag(FLAGS_min_requests) + n - 1) / n);
      absl::Mutex mu;
      std::vector<Outcome> outcomes;
      const auto start = Clock::now();
      const double started_unix_s = UnixSeconds();
      std::vector<std::thread> clients;
      for (int c = 0; c < n; ++c) {
        clients.emplace_back([&, c] {
          for (int i = 0; i < per_client; ++i) {
            const Outcome o = GenerateOnce(*stub, c, i);
            absl::MutexLock lock(&mu);
            outcomes.push_back(o);
          }
        });
      }
      for (std::thread& t : clients) t.join();
      const double wall = std::chrono::duration<double>(Clock::now() - start).count();
      const double ended_unix_s = UnixSeconds();
      std::vector<double> latencies;
      double batch_sum = 0;
      int failed = 0;
      std::map<std::string, double> server_sum, stage_sum;
      for (const Outcome& o : outcomes) {
        if (!o.ok) {
          ++failed;
          continue;
        }
        latencies.push_back(o.latency_s);
        batch_sum += o.batch_size;
        for (const auto& [name, seconds] : o.server_s) server_sum[name] += seconds;
        for (const auto& [name, seconds] : o.stage_s) stage_sum[name] += seconds;
      }
      // {"queue_wait":..,...,"stages":{..}}: each sum over the successful replies, divided by their
      // number (a stage a reply lacks counts 0); stage names keep letters, digits, '_', '.' and '-'
      // (others become '_': the server's names are plain words).
      const auto means = [&](const std::map<std::string, double>& sums) {
        std::string json;
        for (const auto& [name, sum] : sums) {
          std::string key = name;
          for (char& ch : key) {
            if (!absl::ascii_isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '.' && ch != '-') ch = '_';
          }
          absl::StrAppend(&json, json.empty() ? "" : ",",
                          absl::StrFormat("\"%s\":%.6f", key, sum / static_cast<double>(latencies.size())));
        }
        return json;
      };
      const std::string fixed = means(server_sum);
      const std::string server_mean =
          absl::StrCat("{", fixed, fixed.empty() ? "" : ",", "\"stages\":{", means(stage_sum), "}}");
      if (failed > 0) exit_code = 1;
      const double images_per_s = static_cast<double>(latencies.size()) / wall;
      const double mean_batch = latencies.empty() ? 0 : batch_sum / static_cast<double>(latencies.size());
      const double p50 = stowage::bench::Quantile(latencies, 0.5), p99 = stowage::bench::Quantile(latencies, 0.99);
      const std::string label = absl::StrCat(absl::GetFlag(FLAGS_mode), "/", absl::GetFlag(FLAGS_compress), "/",
                                             absl::GetFlag(FLAGS_compute));
      std::printf("%-24s %-6d %4d %8.3f %8.3f %8.3f %10.2f %6d\n", label.c_str(), batch, n,
                  images_per_s, p50, p99, mean_batch, failed);
      std::printf("  server means (s): %s\n", server_mean.c_str());
      std::fflush(stdout);
      if (out.is_open()) {
        out << absl::StrFormat(
                   "{\"bench\":\"batching\",\"mode\":\"%s\",\"compress\":\"%s\",\"compute\":\"%s\",\"batching\":%s,\"max_batch_size\":%d,"
                   "\"max_queue_delay_ms\":%d,\"concurrency\":%d,\"images_per_s\":%.4f,\"p50_s\":%.4f,"
                   "\"p99_s\":%.4f,\"mean_batch_size\":%.3f,\"requests\":%d,\"failed\":%d,\"size\":%d,"
                   "\"steps\":%d,\"format\":\"%s\",\"machine\":\"%s\",\"server_mean_s\":%s,"
                   "\"started_unix_s\":%.3f,\"ended_unix_s\":%.3f}",
                   absl::GetFlag(FLAGS_mode), absl::GetFlag(FLAGS_compress), absl::GetFlag(FLAGS_compute),
                   batch > 1 ? "true" : "false", batch,
                   batch > 1 ? absl::GetFlag(FLAGS_max_queue_delay_ms) : 0, n, images_per_s, p50, p99, mean_batch,
                   static_cast<int>(outcomes.size()), failed, absl::GetFlag(FLAGS_size), absl::GetFlag(FLAGS_steps),
                   format, absl::GetFlag(FLAGS_machine), server_mean, started_unix_s, ended_unix_s)
            << "\n";
        out.flush();
      }
    }
  }
  return exit_code;
}
