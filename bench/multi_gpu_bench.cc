// multi_gpu_bench: closed-loop clients against a running server with several devices, for the
// multi-GPU benchmark (bench/multi_gpu.sh, issue 13). N clients (--concurrency) each send Generate
// requests one after another (the next when the previous reply arrived) until the row has sent
// --requests in all. One JSON line per client count goes to --out and a table row to stdout:
//   {"bench":"multi_gpu","gpus":G,"layout":"replicas"|"split"|"single","concurrency":N,
//    "images_per_s":..,"p50_s":..,"p99_s":..,"peak_device_bytes":[per device, in --devices order],
//    "devices":[names],"requests":..,"failed":..,"size":..,"steps":..,"machine":..}
// images_per_s = successful requests / wall time of the row; p50/p99 of the client-side latency;
// peak_device_bytes[d] = the largest peak_device_memory_bytes any reply reported for device d
// (RequestStats.devices: the home device and, for a split pipeline, its other devices).
// Before the rows, --warmup requests run alone per device (not measured).
//
//   multi_gpu_bench --target=127.0.0.1:50051 --pipeline=zimage --gpus=2 --layout=split \
//     --devices=cuda:0,cuda:1 --machine=h200x2 --out=rows.jsonl
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <map>
#include <mutex>
#include <string>
#include <optional>
#include <thread>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_client.h"
#include "stowage/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address.");
ABSL_FLAG(std::string, pipeline, "", "Pipeline; empty = default.");
ABSL_FLAG(int32_t, size, 1024, "Image width and height.");
ABSL_FLAG(int32_t, steps, 8, "Denoising steps.");
ABSL_FLAG(std::string, concurrency, "1,2,4", "Client counts, comma separated.");
ABSL_FLAG(int32_t, requests, 16, "Requests per row (spread over the clients).");
ABSL_FLAG(int32_t, warmup, 2, "Unmeasured requests before the rows.");
ABSL_FLAG(int32_t, gpus, 1, "Label: devices the server uses.");
ABSL_FLAG(std::string, layout, "single", "Label: replicas, split or single.");
ABSL_FLAG(std::string, devices, "", "The server's devices, comma separated (order of peak_device_bytes).");
ABSL_FLAG(std::string, machine, "unknown", "Label for the machine.");
ABSL_FLAG(std::string, out, "", "JSON lines file to append to.");

namespace {

using Clock = std::chrono::steady_clock;

struct Row {
  std::vector<double> latencies;
  std::map<std::string, int64_t> peaks;
  int failed = 0;
  std::string first_error;
};

bool Generate(stowage::v1::GenerationService::Stub& stub, uint64_t seed, Row& row, std::mutex& mu) {
  stowage::v1::GenerateRequest request;
  request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
  request.set_prompt("a lighthouse on a rocky cliff above the sea at dusk, warm light, oil painting");
  request.set_width(absl::GetFlag(FLAGS_size));
  request.set_height(absl::GetFlag(FLAGS_size));
  request.set_num_inference_steps(absl::GetFlag(FLAGS_steps));
  request.set_seed(seed);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::minutes(10));
  stowage::v1::GenerateResponse response;
  const Clock::time_point start = Clock::now();
  const grpc::Status status = stub.Generate(&context, request, &response);
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  std::lock_guard<std::mutex> lock(mu);
  if (!status.ok()) {
    ++row.failed;
    if (row.first_error.empty()) row.first_error = status.error_message();
    return false;
  }
  row.latencies.push_back(seconds);
  for (const auto& usage : response.stats().devices()) {
    row.peaks[usage.device()] = std::max(row.peaks[usage.device()], usage.peak_device_memory_bytes());
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  auto channel = stowage::bench::MakeChannel(absl::GetFlag(FLAGS_target));
  auto stub = stowage::v1::GenerationService::NewStub(channel);
  const std::vector<std::string> devices =
      absl::StrSplit(absl::GetFlag(FLAGS_devices), ',', absl::SkipEmpty());
  const std::optional<std::vector<int>> counts =
      stowage::bench::PositiveIntList(absl::GetFlag(FLAGS_concurrency), "concurrency");
  if (!counts) return 2;
  {
    // Warm-up: every device places its components and loads its kernels once (replicas are chosen
    // by expected wait, so concurrent warm-ups reach every replica).
    Row ignored;
    std::mutex mu;
    std::vector<std::thread> threads;
    for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) {
      threads.emplace_back([&, i] { (void)Generate(*stub, 1000 + static_cast<uint64_t>(i), ignored, mu); });
    }
    for (std::thread& t : threads) t.join();
    if (ignored.failed > 0) {
      std::cerr << "warm-up failed: " << ignored.first_error << "\n";
      return 1;
    }
  }
  std::ofstream out;
  if (!absl::GetFlag(FLAGS_out).empty()) out.open(absl::GetFlag(FLAGS_out), std::ios::app);
  int rc = 0;
  for (int n : *counts) {
    Row row;
    std::mutex mu;
    std::atomic<int> next{0};
    const int total = std::max(absl::GetFlag(FLAGS_requests), n);
    const Clock::time_point start = Clock::now();
    std::vector<std::thread> clients;
    for (int c = 0; c < n; ++c) {
      clients.emplace_back([&] {
        for (int i = next++; i < total; i = next++) (void)Generate(*stub, static_cast<uint64_t>(i), row, mu);
      });
    }
    for (std::thread& t : clients) t.join();
    const double wall = std::chrono::duration<double>(Clock::now() - start).count();
    std::vector<std::string> peaks, quoted;
    for (const std::string& d : devices) {
      peaks.push_back(absl::StrCat(row.peaks.count(d) > 0 ? row.peaks[d] : 0));
      quoted.push_back(absl::StrCat("\"", d, "\""));
    }
    const double ips = static_cast<double>(row.latencies.size()) / wall;
    const std::string line = absl::StrCat(
        "{\"bench\":\"multi_gpu\",\"gpus\":", absl::GetFlag(FLAGS_gpus), ",\"layout\":\"", absl::GetFlag(FLAGS_layout),
        "\",\"concurrency\":", n, ",\"images_per_s\":", ips, ",\"p50_s\":", stowage::bench::Quantile(row.latencies, 0.5),
        ",\"p99_s\":", stowage::bench::Quantile(row.latencies, 0.99), ",\"peak_device_bytes\":[", absl::StrJoin(peaks, ","),
        "],\"devices\":[", absl::StrJoin(quoted, ","), "],\"requests\":", total, ",\"failed\":", row.failed,
        ",\"size\":", absl::GetFlag(FLAGS_size), ",\"steps\":", absl::GetFlag(FLAGS_steps), ",\"machine\":\"",
        absl::GetFlag(FLAGS_machine), "\"}");
    if (out.is_open()) out << line << "\n";
    std::cout << absl::GetFlag(FLAGS_layout) << " gpus=" << absl::GetFlag(FLAGS_gpus) << " N=" << n
              << " images/s=" << ips << " p50=" << stowage::bench::Quantile(row.latencies, 0.5) << "s failed=" << row.failed
              << " peaks=[" << absl::StrJoin(peaks, ",") << "]\n";
    if (row.failed > 0) {
      std::cerr << row.failed << " requests failed; first: " << row.first_error << "\n";
      rc = 1;
    }
  }
  return rc;
}
