// placement_bench: how long one placement decision takes with 10, 100 and 1000 resident
// components under memory pressure (the footprint strategy must pick evictions). Prints a table and
// writes JSON lines {"components", "decision_us" (median), ...} to --out.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "placement/strategy.h"

ABSL_FLAG(std::string, out, "", "JSON-lines file to append rows to");
ABSL_FLAG(std::string, machine, "unknown", "Machine name recorded in every row");
ABSL_FLAG(int, repeats, 2001, "Decisions timed per size (median reported)");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::ofstream out;
  if (!absl::GetFlag(FLAGS_out).empty()) out.open(absl::GetFlag(FLAGS_out), std::ios::app);
  std::printf("%-11s %12s %12s %12s\n", "components", "median_us", "p99_us", "evicted");
  for (int n : {10, 100, 1000}) {
    std::mt19937_64 rng(n);
    std::vector<stowage::Candidate> resident;
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      const int64_t bytes = (int64_t{1} << 20) * (1 + static_cast<int64_t>(rng() % 4096));
      resident.push_back({"p" + std::to_string(i % 7) + "/c" + std::to_string(i), "c" + std::to_string(i),
                          bytes, absl::UnixEpoch() + absl::Seconds(static_cast<int64_t>(rng() % 100000))});
      total += bytes;
    }
    auto strategy = stowage::MakeFootprintStrategy(int64_t{1} << 30);
    stowage::StrategyInput input;
    input.target = {"p0/target", "target", total / 3, absl::Now()};
    input.needed_bytes = total / 3;  // A third of everything must go: many evictions to choose.
    input.free_bytes = 0;
    input.resident = resident;
    std::vector<double> micros;
    size_t evicted = 0;
    for (int r = 0; r < absl::GetFlag(FLAGS_repeats); ++r) {
      const auto start = std::chrono::steady_clock::now();
      const std::vector<std::string> ids = strategy->BeforeRun(input);
      micros.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count());
      evicted = ids.size();
    }
    std::sort(micros.begin(), micros.end());
    const double median = micros[micros.size() / 2];
    const double p99 = micros[micros.size() * 99 / 100];
    std::printf("%-11d %12.1f %12.1f %12zu\n", n, median, p99, evicted);
    if (out.is_open()) {
      out << absl::StrFormat("{\"components\": %d, \"decision_us\": %.2f, \"p99_us\": %.2f, "
                             "\"evicted\": %d, \"strategy\": \"footprint\", \"machine\": \"%s\"}\n",
                             n, median, p99, evicted, absl::GetFlag(FLAGS_machine));
    }
  }
  return 0;
}
