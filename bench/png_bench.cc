// PNG encoding of one image, the way replies encode it, beside libpng at the same settings (zlib level 1,
// the Sub filter: what EncodePng used before the parallel writer). One JSON line per encoder and image:
//   {"bench":"png","image":"noise"|"smooth","encoder":"libpng_level1"|"parallel","threads":..,
//    "median_ms":..,"min_ms":..,"bytes":..,"width":..,"height":..,"machine":..}
// "noise" is what random weights decode to (incompressible: the worst case); "smooth" gradients with
// a little noise stand for a trained model's image.
//   bazel run //bench:png_bench -- --size=1024 --iters=15 --machine="$(hostname)" [--out=FILE]
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
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/libpng_level1.h"
#include "models/core/png_writer.h"

ABSL_FLAG(int, size, 1024, "Image width and height");
ABSL_FLAG(int, iters, 15, "Encodes per row (median and minimum reported)");
ABSL_FLAG(std::string, threads, "1,0", "Thread limits of the parallel writer to measure (0: its default)");
ABSL_FLAG(std::string, machine, "unknown", "Recorded in every row");
ABSL_FLAG(std::string, commit, "unknown", "Recorded in every row");
ABSL_FLAG(std::string, out, "", "Also append the rows to this file");

namespace {

template <typename F>
std::pair<double, double> Time(F&& encode, size_t* bytes) {
  std::vector<double> ms;
  for (int i = 0; i < absl::GetFlag(FLAGS_iters); ++i) {
    const auto start = std::chrono::steady_clock::now();
    *bytes = encode().size();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front()};
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const int n = absl::GetFlag(FLAGS_size);
  if (n <= 0 || n > 8192 || absl::GetFlag(FLAGS_iters) <= 0) {
    std::cerr << "png_bench: --size must be 1..8192 and --iters positive\n";
    return 2;
  }
  std::mt19937 rng(1);
  std::vector<uint8_t> noise(static_cast<size_t>(n) * n * 3), smooth(noise.size());
  for (uint8_t& b : noise) b = static_cast<uint8_t>(rng());
  for (int y = 0; y < n; ++y) {
    for (int x = 0; x < n; ++x) {
      uint8_t* p = &smooth[(static_cast<size_t>(y) * n + x) * 3];
      p[0] = static_cast<uint8_t>(x * 255 / n);
      p[1] = static_cast<uint8_t>(y * 255 / n);
      p[2] = static_cast<uint8_t>((x + y) / 8 + rng() % 4);
    }
  }
  std::ofstream file;
  if (!absl::GetFlag(FLAGS_out).empty()) file.open(absl::GetFlag(FLAGS_out), std::ios::app);
  auto row = [&](const char* image, const char* encoder, int threads, std::pair<double, double> t, size_t bytes) {
    const std::string line = absl::StrFormat(
        R"({"bench":"png","image":"%s","encoder":"%s","threads":%d,"median_ms":%.2f,"min_ms":%.2f,"bytes":%d,)"
        R"("width":%d,"height":%d,"machine":"%s","commit":"%s"})",
        image, encoder, threads, t.first, t.second, bytes, n, n, absl::GetFlag(FLAGS_machine),
        absl::GetFlag(FLAGS_commit));
    std::cout << line << std::endl;
    if (file.is_open()) file << line << "\n";
  };
  std::vector<int> thread_limits;
  for (absl::string_view part : absl::StrSplit(absl::GetFlag(FLAGS_threads), ',')) {
    int t = 0;
    if (!absl::SimpleAtoi(part, &t) || t < 0) {
      std::cerr << "png_bench: --threads takes non-negative integers, not '" << part << "'\n";
      return 2;
    }
    thread_limits.push_back(t);
  }
  for (const auto& image : {std::pair<const char*, const std::vector<uint8_t>*>{"noise", &noise}, {"smooth", &smooth}}) {
    const char* name = image.first;
    const std::vector<uint8_t>* rgb = image.second;  // Not a structured binding: lambdas capture it.
    size_t bytes = 0;
    const auto t = Time([&] { return stowage::LibpngLevel1(*rgb, n, n); }, &bytes);
    row(name, "libpng_level1", 1, t, bytes);
    for (int limit : thread_limits) {
      const int used = std::min(stowage::PngWriterThreads(limit), (n + stowage::kPngStripRows - 1) / stowage::kPngStripRows);
      const auto p = Time([&] { return *stowage::WriteRgbPng(rgb->data(), n, n, limit); }, &bytes);
      row(name, "parallel", used, p, bytes);
    }
  }
  return 0;
}
