// Host-side e4m3 encoding, one thread: what quantizing to fp8 on the CPU costs a value. One JSON line
// per row:
//   {"bench":"fp8_encode","row":..,"ns_per_value":..,"values":..,"machine":..,"commit":..}
// Rows: "reference" (EncodeE4M3Reference in a loop: the frexp/ldexp formulation the compressed
// formats used before), "bit_arithmetic" (EncodeE4M3Floats: the blocks of 16 the compressed formats
// use now) — both over the same Gaussian floats, and the bytes compared — and "bf16_rows"
// (fused::QuantizeBf16RowsE4M3: FP8 compute's conversion of bfloat16 weights at load, the row maximum
// and the division included). Median of --iters passes.
//   bazel run //bench:fp8_encode_bench -- --iters=7 --machine="$(hostname)" --commit=C [--out=FILE]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "base/fp8_e4m3.h"
#include "models/core/fused_ops.h"

ABSL_FLAG(int, iters, 7, "Passes per row (median reported)");
ABSL_FLAG(int64_t, rows, 3072, "Rows of the [rows, 3072] weight encoded");
ABSL_FLAG(std::string, machine, "unknown", "Recorded in every row");
ABSL_FLAG(std::string, commit, "unknown", "Recorded in every row");
ABSL_FLAG(std::string, out, "", "Also append the rows to this file");

namespace {

template <typename F>
double MedianSeconds(F&& pass) {
  std::vector<double> seconds;
  for (int i = 0; i < absl::GetFlag(FLAGS_iters); ++i) {
    const auto start = std::chrono::steady_clock::now();
    pass();
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(seconds.begin(), seconds.end());
  return seconds[seconds.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int64_t rows = absl::GetFlag(FLAGS_rows), k = 3072;
  if (rows <= 0 || absl::GetFlag(FLAGS_iters) <= 0) {
    std::cerr << "fp8_encode_bench: --rows and --iters must be positive\n";
    return 2;
  }
  const int64_t n = rows * k;
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 30.0f);  // Values across e4m3's range, some beyond it.
  std::vector<float> x(static_cast<size_t>(n));
  std::vector<uint16_t> bf16(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    x[i] = normal(rng);
    bf16[i] = static_cast<uint16_t>(stowage::BitsOfFloat(x[i] * 0.001f) >> 16);  // Weight-sized values.
  }
  std::vector<uint8_t> reference(x.size()), fast(x.size()), rows_out(x.size());
  std::vector<float> scales(static_cast<size_t>(rows));
  struct Row {
    const char* name;
    double seconds;
  };
  const Row measured[] = {
      {"reference",
       MedianSeconds([&] {
         for (int64_t i = 0; i < n; ++i) reference[i] = stowage::EncodeE4M3Reference(x[i]);
       })},
      {"bit_arithmetic", MedianSeconds([&] { stowage::EncodeE4M3Floats(x.data(), n, fast.data()); })},
      {"bf16_rows", MedianSeconds([&] {
         stowage::fused::QuantizeBf16RowsE4M3(bf16.data(), k, 0, rows, rows_out.data(), scales.data());
       })},
  };
  if (reference != fast) {
    std::cerr << "fp8_encode_bench: the two encoders disagree\n";
    return 1;
  }
  std::ofstream out;
  if (!absl::GetFlag(FLAGS_out).empty()) out.open(absl::GetFlag(FLAGS_out), std::ios::app);
  for (const Row& r : measured) {
    const std::string line = absl::StrFormat(
        "{\"bench\": \"fp8_encode\", \"row\": \"%s\", \"ns_per_value\": %.3f, \"values\": %d, \"machine\": \"%s\", "
        "\"commit\": \"%s\"}",
        r.name, r.seconds * 1e9 / static_cast<double>(n), n, absl::GetFlag(FLAGS_machine), absl::GetFlag(FLAGS_commit));
    std::printf("%s\n", line.c_str());
    if (out.is_open()) out << line << "\n";
  }
  return 0;
}
