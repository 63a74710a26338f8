// offload_bench: step time, device memory and host RAM of every offload mode, on either
//   - a transformer stack with Z-Image-Turbo's main-block shapes (30 blocks, dim 3840, 30 heads,
//     FFN 10240, bf16, 4096 image + 512 text tokens), random weights filled in memory, or
//   - the real transformer of a diffusers-format directory (--model_dir: its transformer/ folder's
//     config.json and safetensors, mapped without copies): ZImageTransformer2DModel or
//     FluxTransformer2DModel (by the config's _class_name), one forward at 1024x1024 (4096 image
//     tokens) with 512 caption tokens — the input the diffusers side of
//     bench/diffusers_offload_bench.py uses (Z-Image: a 16x128x128 latent; Flux: 4096 packed
//     64-channel tokens, T5 features, a CLIP pooled vector, t = 0.5 and for [dev] guidance 3.5).
// Prints a table and appends one JSON line per row to --out.
//
//   offload_bench --out=bench/results/offload_bench.jsonl --machine="NVIDIA H200"
//   offload_bench --model_dir=/tmp/zimage-weights --rows=resident,block_pinned,...
//   offload_bench --config=small --backend=sim     (a seconds-long run for CI)
// Rows block_int8 / block_fp8 stream the block-level groups as 8-bit (compress int8 / fp8_e4m3):
// streamed_bytes is then the 8-bit bytes per forward, floor_8bit_s their PCIe floor, and rel_l2 the
// relative L2 error of the output against a resident forward of the same weights and inputs
// (computed once before the row's timed forwards; 0 for uncompressed rows). prepare_s is the time
// of GroupOffloader::Apply (planning, pinning, quantizing).
#include <fcntl.h>
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <torch/version.h>
#if defined(STOWAGE_WITH_CUDA) && TORCH_VERSION_MAJOR >= 2
#include <set>

#include <torch/csrc/autograd/profiler_kineto.h>
#define STOWAGE_KINETO_TRACE 1
#endif

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/transformer_stack.h"
#include "models/core/fused_ops.h"
#include "models/core/diffusers_format.h"
#include "models/nets/flux_latents.h"
#include "models/nets/flux_transformer.h"
#include "models/core/layers.h"
#include "models/nets/zimage_transformer.h"
#include "offload/compression.h"
#include "offload/device_backend.h"
#include "offload/group_offload.h"
#include "offload/host_spill.h"
#include "offload/host_weights.h"
#include "offload/safetensors.h"
#include "base/status_macros.h"
#include "base/process_memory.h"

ABSL_FLAG(std::string, config, "full", "full (Z-Image main-block shapes) or small (CI smoke run)");
ABSL_FLAG(std::string, backend, "auto", "cuda, sim, or auto (CUDA when present)");
ABSL_FLAG(std::string, rows,
          "resident,block_pinned,leaf_pinned,block_lowram,leaf_lowram,block_disk,budget25,budget50,budget75",
          "Comma-separated rows to run (also: block_int8, block_fp8, block_int8grouped, block_int4, "
          "memcpy_probe, pin_probe, widen_probe; a compressed row with \"_wg\" in its name widens a group's weights in shared "
          "launches, one ending in _d<N> prefetches N groups, one with _b<NN> keeps what a device budget of NN % of the "
          "weights holds beside its slots resident)");
ABSL_FLAG(int, warmup, 2, "Untimed forwards per row (the first records the order)");
ABSL_FLAG(int, iters, 5, "Timed forwards per row (median reported)");
ABSL_FLAG(bool, back_to_back, false,
          "The timed forwards run one after another with no synchronisation between them, as a server's "
          "denoising steps do (the next forward's copies queue behind this one's compute); step_s is their "
          "mean (one synchronisation at the end), not the median of synchronised forwards; rows say back_to_back");
ABSL_FLAG(std::string, out, "", "JSON-lines file to append rows to");
ABSL_FLAG(std::string, machine, "unknown", "Machine name recorded in every row");
ABSL_FLAG(std::string, disk_dir, "/tmp/stowage-offload-bench", "Directory for the disk row");
ABSL_FLAG(int64_t, staging_mib, 64, "Staging buffer size (low-CPU-RAM and disk rows)");
ABSL_FLAG(int, staging_buffers, 4, "Staging buffers (low-CPU-RAM and disk rows)");
ABSL_FLAG(int, prefetch_depth, 0,
          "Prefetch depth of the streamed rows (a row's _d<N> suffix wins); 0: the engine's choice, as the "
          "server's default (GroupOffloadOptions::prefetch_depth: 4 for compressed block-level streaming "
          "without a budget where it fits, else 1); rows carry the depth that ran");
ABSL_FLAG(double, resident_step_s, 0,
          "Resident step time measured by an earlier process (rows run one process each)");
ABSL_FLAG(int, staging_threads, 8, "Threads copying into the staging buffers");
ABSL_FLAG(bool, pinned_huge_pages, true,
          "CUDA: pinned host buffers from huge-page memory registered in place instead of cudaHostAlloc "
          "where the kernel runs transparent huge pages (CudaBackendOptions::pinned_huge_pages; a row's "
          "pinned_huge_pages says whether it did); false: cudaHostAlloc");
ABSL_FLAG(std::string, spill_dir, "",
          "A directory: before each row takes its host copies, the model's tensors that no file holds "
          "(random weights, FP8 compute's converted weights) move into a mapped file there, as the server "
          "does with PipelineConfig.host_spill_dir (offload/host_spill.h); rows carry spilled_bytes and "
          "rss_after_prepare_bytes. Empty: they stay in RAM");
ABSL_FLAG(std::string, widen_layout, "",
          "CUDA widening kernels' thread layout: coalesced or strided (empty: the kernels' default, coalesced "
          "unless STOWAGE_WIDEN_LAYOUT=strided); rows carry widen_layout, and widen_probe times both "
          "whatever this says");
ABSL_FLAG(std::string, model_dir, "",
          "Diffusers-format Z-Image or Flux directory: benchmark its real transformer (transformer/ "
          "folder) instead of the synthetic stack");
ABSL_FLAG(int64_t, caption_tokens, 512, "--model_dir: caption tokens of the forward");
ABSL_FLAG(std::string, save_output, "",
          "Write the last timed forward's output (float32) to this safetensors file (e.g. from the "
          "resident row, as the reference of compressed rows run in other processes)");
ABSL_FLAG(std::string, reference, "",
          "Compressed rows: compare with the output saved by --save_output instead of a resident forward "
          "in this process (which would put every bf16 weight in this process's RSS)");
ABSL_FLAG(int64_t, image_size, 1024, "--model_dir: image side in pixels (latent side = size / 8)");
ABSL_FLAG(std::string, inputs, "",
          "--model_dir: read the forward's inputs from this safetensors file instead of drawing them "
          "(Z-Image: latents, caption; Flux: hidden, text, pooled), e.g. the ones bench/compute_bench.py "
          "gave diffusers");
ABSL_FLAG(std::string, compute, "bf16",
          "bf16, or fp8: the transformer blocks' linear layers are converted to FP8 on the host before "
          "their host copies are taken, as the server does at load (models/core/layers.h "
          "ConvertBlockLinearsToFp8); rows resident, block_pinned or block_int4");
ABSL_FLAG(int64_t, quantize_chunk_elements, stowage::kQuantizeChunkElements,
          "Compressed rows: values quantized at a time at load (GroupOffloadOptions::quantize_chunk_elements; "
          "the staging halves and the source pages read at once scale with it)");
ABSL_FLAG(bool, fp8_one_pass, true,
          "--compute=fp8 with a block_int4 row: the linear layers' FP8 form is declared, not made on the "
          "host (ConvertBlockLinearsToFp8 deferred), and the int4 copy is made from the bf16 weights in one "
          "pass on the device, as the server does for such a component; false: the FP8 host copy first, "
          "then its int4 copy (two passes). One pass leaves the row's own resident reference out (no rel_l2: "
          "compute_bench measures it against diffusers)");
ABSL_FLAG(std::string, profile, "",
          "CUDA builds: after the timed forwards, trace one more forward with LibTorch's Kineto profiler "
          "and save the Chrome trace here (bench/compute_bench.py summarises its kernels)");
ABSL_FLAG(int64_t, batch, 1,
          "Samples in one forward (requests batched together, 1..64): the synthetic stack's batch rows; with "
          "--model_dir the model's inputs repeated (Z-Image's ForwardBatch, Flux's batch dimension), sample 0's "
          "output compared and saved");
ABSL_FLAG(int, lora_adapters, 0,
          "Synthetic stack: LoRA adapters attached to every Linear (rank --lora_rank, on the device); batch row i "
          "applies adapter i % N (a batch mixing N adapters; 1: every row the same one, the uniform path)");
ABSL_FLAG(int64_t, lora_rank, 16, "Rank of the --lora_adapters adapters");
ABSL_FLAG(std::string, compute_priority, "default",
          "CUDA: the stream the forwards run on: default (the device's default stream, the lowest priority, "
          "as the copy and widening streams) or high (a stream of the highest priority: the widening's "
          "blocks then only take the SMs the compute leaves idle; DeviceBackend::EnterComputeThread, as the "
          "server's device.high_priority_compute)");
ABSL_FLAG(bool, fused, true,
          "Run the fused CUDA kernels where they apply (models/core/fused_ops.h); false: the plain "
          "LibTorch reference path");

namespace stowage {
namespace {

struct Shape {
  TransformerStackConfig model;
  int64_t tokens;
};

Shape ShapeFor(const std::string& name) {
  if (name == "small") return {{16, 256, 4, 512, 64}, 64};
  return {{}, 4096 + 512};
}

struct RowResult {
  std::string row;
  double step_s = 0;
  int64_t peak_device = 0;
  int64_t peak_rss = 0;
  int64_t weight_bytes = 0;
  int64_t streamed_bytes = 0;
  int64_t working_set = 0;
  int64_t resident_bytes = 0;  // Streamed rows with a budget: the groups kept on the device.
  int prefetch_depth = 0;
  int64_t pinned_in_place = 0;
  std::string pin_in_place_error;
  std::string compress = "none";
  double rel_l2 = 0;
  double prepare_s = 0;  // GroupOffloader::Apply: planning, pinning and (compressed rows) quantizing.
  // Of prepare_s: --compute=fp8's conversion on the host; the compressed store's pinned allocations
  // (on a thread of their own, beside the quantizing) and its quantizing (GroupOffloadStats).
  double prepare_fp8_s = 0;
  int64_t spilled_bytes = 0;          // --spill_dir: bytes moved into the mapped file.
  int64_t rss_after_prepare = 0;      // The process's RSS once the row's copies are prepared.
  double prepare_pin_alloc_s = 0;
  double prepare_quantize_s = 0;
  int64_t one_pass_fp8_weights = 0;  // GroupOffloadStats::one_pass_fp8_weights.
  int64_t samples = 0;               // BenchModel::samples after the timed forwards.
  std::string model;
};

// One call of `fn` under the Kineto profiler (CPU ops and CUDA kernels), saved as a Chrome trace.
absl::Status TraceOnce(const std::function<void()>& fn, const std::string& path) {
#ifdef STOWAGE_KINETO_TRACE
  namespace impl = torch::profiler::impl;
  const impl::ProfilerConfig config(impl::ProfilerState::KINETO);
  const std::set<impl::ActivityType> activities{impl::ActivityType::CPU, impl::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  fn();
  auto result = torch::autograd::profiler::disableProfiler();
  result->save(path);
  return absl::OkStatus();
#else
  (void)fn;
  return absl::UnimplementedError("--profile=" + path + ": this build has no CUDA LibTorch with Kineto");
#endif
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Pinned host→device bandwidth in bytes per second (median of 5 copies of 1 GiB, or less on small
// runs).
double MeasureBandwidth(DeviceBackend& backend, int64_t bytes) {
  auto host = backend.AllocatePinnedHost(bytes);
  auto device = backend.AllocateBytes(bytes);
  if (!host.ok() || !device.ok()) return 0;
  host->fill_(7);
  std::vector<double> seconds;
  for (int i = 0; i < 6; ++i) {
    backend.Synchronize();
    const auto start = std::chrono::steady_clock::now();
    backend.CopyToDeviceAsync(*device, *host);
    auto done = backend.RecordOnCopyStream();
    done->Wait();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (i > 0) seconds.push_back(s);
  }
  return static_cast<double>(bytes) / Median(seconds);
}

// Host memcpy bandwidth, pageable → pinned, with `threads` threads over 64 MiB chunks of a 2 GiB
// source: the ceiling of the staged (low-CPU-RAM, disk) rows, which copy exactly this way.
double MeasureMemcpy(DeviceBackend& backend, int threads, int64_t total) {
  at::Tensor src = at::empty({total}, at::TensorOptions().dtype(at::kByte));
  src.fill_(3);
  const int64_t chunk = int64_t{64} << 20;
  auto staging = backend.AllocatePinnedHost(chunk);
  if (!staging.ok()) return 0;
  uint8_t* dst = staging->data_ptr<uint8_t>();
  const uint8_t* from = src.data_ptr<uint8_t>();
  std::vector<double> runs;
  for (int rep = 0; rep < 3; ++rep) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t off = 0; off < total; off += chunk) {
      const int64_t n = std::min(chunk, total - off);
      const int64_t slice = (n + threads - 1) / threads;
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        const int64_t b = t * slice;
        const int64_t e = std::min(n, b + slice);
        if (b < e) pool.emplace_back([=] { std::memcpy(dst + b, from + off + b, static_cast<size_t>(e - b)); });
      }
      for (std::thread& th : pool) th.join();
    }
    runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  return static_cast<double>(total) / Median(runs);
}

// The widening kernels alone, nothing beside them on the device: for a format and an output dtype,
// `weights` weights of [rows, k] quantized on the device, then widened `passes` times one launch
// each (WidenInto, as the store does by default) or in shared launches (WidenAllInto,
// widen_per_group). The rate counts the bytes a pass reads (codes and scales) and writes (the
// widened weights): against the device's memory bandwidth it says whether the kernel or its
// contention with the compute is what a streamed step pays for widening.
struct WidenRate {
  double seconds_per_pass = 0;
  int64_t bytes_per_pass = 0;
};

// Seconds one call of `pass` takes on the device: two untimed calls, then the mean of ten.
double SecondsPerPass(DeviceBackend& backend, const std::function<void()>& pass) {
  pass();
  pass();
  backend.Synchronize();
  constexpr int kPasses = 10;
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < kPasses; ++i) pass();
  backend.Synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / kPasses;
}
WidenRate MeasureWidening(DeviceBackend& backend, CompressFormat format, at::ScalarType out_dtype,
                           bool shared, int weights, int64_t rows, int64_t k) {
  c10::InferenceMode inference;
  const at::TensorOptions on_device = at::TensorOptions().device(backend.torch_device());
  std::vector<QuantizedTensor> quantized;
  std::vector<WidenTarget> targets;
  int64_t bytes = 0;
  for (int i = 0; i < weights; ++i) {
    const at::Tensor w = at::randn({rows, k}, on_device.dtype(at::kFloat)).to(at::kBFloat16);
    quantized.push_back(Quantize(w, format));
    WidenTarget target;
    target.q = quantized.back().q.contiguous();
    target.scale = quantized.back().scale.contiguous();
    target.out = at::empty({rows, k}, on_device.dtype(out_dtype));
    bytes += static_cast<int64_t>(target.q.nbytes() + target.scale.nbytes() + target.out.nbytes());
    targets.push_back(std::move(target));
  }
  // Off CUDA the widening needs int4's nibble buffer and the scale codes' table.
  WidenScratch scratch;
  if (format == CompressFormat::kInt4 && !backend.torch_device().is_cuda()) {
    scratch.nibbles = at::empty({AlignScratch(rows * k / 2)}, on_device.dtype(at::kByte));
    scratch.table_f32 = Fp8E4M3Table(at::kFloat).to(backend.torch_device());
  }
  const auto pass = [&] {
    if (shared) {
      WidenAllInto(targets, format, scratch);
    } else {
      for (const WidenTarget& t : targets) WidenInto(t.out, t.q, t.scale, format, scratch);
    }
  };
  WidenRate rate;
  rate.seconds_per_pass = SecondsPerPass(backend, pass);
  rate.bytes_per_pass = bytes;
  return rate;
}

// Bytes a second (read plus written) of device-to-device copies of `weights` [rows, k] tensors of
// `dtype`: what the device's memory gives a plain copy, the ceiling a widening pass is judged by.
double MeasureDeviceCopy(DeviceBackend& backend, at::ScalarType dtype, int weights, int64_t rows, int64_t k) {
  c10::InferenceMode inference;
  const at::TensorOptions on_device = at::TensorOptions().device(backend.torch_device()).dtype(at::kByte);
  const int64_t bytes_each = rows * k * static_cast<int64_t>(c10::elementSize(dtype));
  std::vector<at::Tensor> src, dst;
  for (int i = 0; i < weights; ++i) {
    src.push_back(at::zeros({bytes_each}, on_device));
    dst.push_back(at::empty({bytes_each}, on_device));
  }
  const double seconds = SecondsPerPass(backend, [&] {
    for (int i = 0; i < weights; ++i) dst[i].copy_(src[i]);
  });
  return 2.0 * static_cast<double>(bytes_each) * weights / seconds;
}

// Ways of getting `total` bytes of page-locked host memory, each timed (median of 3, bytes a second):
// the backend's pinned allocation (CUDA: cudaHostAlloc) — what a compressed store's groups use — and
// anonymous memory written once, then registered in place (CUDA: cudaHostRegister), with and without
// transparent huge pages (pinning 2 MiB pages instead of 4 KiB ones).
struct PinRates {
  double host_alloc = 0;
  double register_4k = 0;
  double register_huge = 0;
};

PinRates MeasurePinning(DeviceBackend& backend, int64_t total) {
  PinRates rates;
  std::vector<double> alloc_runs, small_runs, huge_runs;
  for (int rep = 0; rep < 3; ++rep) {
    {
      const auto start = std::chrono::steady_clock::now();
      auto pinned = backend.AllocatePinnedHost(total);
      if (!pinned.ok()) return rates;
      alloc_runs.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    for (const bool huge : {false, true}) {
      const auto start = std::chrono::steady_clock::now();
      void* p = ::mmap(nullptr, static_cast<size_t>(total), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p == MAP_FAILED) return rates;
      (void)::madvise(p, static_cast<size_t>(total), huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
      std::memset(p, 0, static_cast<size_t>(total));  // The pages exist before they are locked.
      const absl::Status registered = backend.RegisterHostMemory(p, total, /*read_only=*/false);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      if (registered.ok()) (void)backend.UnregisterHostMemory(p);
      ::munmap(p, static_cast<size_t>(total));
      if (!registered.ok()) return rates;
      (huge ? huge_runs : small_runs).push_back(seconds);
    }
  }
  rates.host_alloc = static_cast<double>(total) / Median(alloc_runs);
  rates.register_4k = static_cast<double>(total) / Median(small_runs);
  rates.register_huge = static_cast<double>(total) / Median(huge_runs);
  return rates;
}

// The model a row runs: its module tree (weights on the host) and one forward on the device.
struct BenchModel {
  std::unique_ptr<Module> root;
  std::function<at::Tensor()> forward;  // Valid once the weights are placed.
  std::string model_name = "transformer_stack";  // Recorded in the JSON lines.
  // Samples the last forward computed (--batch; the rows' "samples"): set by the forward itself.
  std::shared_ptr<int64_t> samples = std::make_shared<int64_t>(0);
};

// `drawn`, unless --inputs names a file: then its tensor `name`, on the device, in the model dtype.
absl::StatusOr<at::Tensor> Input(const std::string& name, at::Tensor drawn) {
  const std::string path = absl::GetFlag(FLAGS_inputs);
  if (path.empty()) return drawn;
  ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(path));
  ASSIGN_OR_RETURN(at::Tensor saved, file->Get(name));
  if (saved.sizes() != drawn.sizes()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": input '", name, "' has shape ",
                                                   c10::str(saved.sizes()), "; the forward takes ",
                                                   c10::str(drawn.sizes())));
  }
  return saved.to(drawn.options()).clone();
}

// The time to read `dir`'s safetensors files from the page cache: every file read through once to warm
// the cache, then again, timed, on one thread into one 64 MiB buffer (what the streaming issue's
// "preparing a copy at load" is measured against).
absl::StatusOr<double> PageCacheReadSeconds(const std::string& dir) {
  std::vector<std::string> files;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(dir, error)) {
    if (entry.path().extension() == ".safetensors") files.push_back(entry.path().string());
  }
  if (error) return absl::NotFoundError(absl::StrCat(dir, ": ", error.message()));
  if (files.empty()) return absl::NotFoundError(absl::StrCat(dir, ": no .safetensors files"));
  std::vector<char> buffer(size_t{64} << 20);
  double seconds = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const auto start = std::chrono::steady_clock::now();
    for (const std::string& file : files) {
      const int fd = ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return absl::NotFoundError(absl::StrCat(file, ": ", std::strerror(errno)));
      ssize_t n = 0;
      while ((n = ::read(fd, buffer.data(), buffer.size())) > 0) {
      }
      ::close(fd);
      if (n < 0) return absl::DataLossError(absl::StrCat(file, ": read failed"));
    }
    seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return seconds;
}

absl::StatusOr<BenchModel> MakeModel(const Shape& shape, DeviceBackend& backend, at::ScalarType dtype) {
  const auto options = at::TensorOptions().dtype(dtype).device(backend.torch_device());
  BenchModel bench;
  const std::string model_dir = absl::GetFlag(FLAGS_model_dir);
  if (model_dir.empty()) {
    auto stack = std::make_unique<TransformerStack>(shape.model, LayerOptions{dtype});
    FillBenchmarkWeights(*stack, 7);
    at::manual_seed(0);  // The same inputs in every process (rows compare outputs across processes).
    const int64_t batch = absl::GetFlag(FLAGS_batch);
    const at::Tensor x = at::randn({batch, shape.tokens, shape.model.dim}, options);
    const at::Tensor c = at::randn({batch, shape.model.modulation_dim}, options);
    TransformerStack* raw = stack.get();
    const int adapters = absl::GetFlag(FLAGS_lora_adapters);
    auto samples = bench.samples;
    if (adapters <= 0) {
      bench.forward = [raw, x, c, samples] {
        at::Tensor y = raw->Forward(x, c);
        *samples = y.size(0);
        return y;
      };
    } else {
      // Adapters on every Linear, on the device (as LoadAdapter places them), small random values.
      const int64_t rank = absl::GetFlag(FLAGS_lora_rank);
      at::Generator gen = at::detail::createCPUGenerator(11);
      absl::Status attached = absl::OkStatus();
      stack->ForEachModule([&](Module& m) {
        auto* linear = dynamic_cast<Linear*>(&m);
        if (linear == nullptr || !attached.ok()) return;
        for (int a = 0; a < adapters; ++a) {
          LoraWeights w;
          w.down = (at::randn({rank, linear->in_features()}, gen) * 0.01).to(options);
          w.up = (at::randn({linear->out_features(), rank}, gen) * 0.01).to(options);
          attached = linear->AttachLora(absl::StrCat("adapter", a), std::move(w));
          if (!attached.ok()) return;
        }
      });
      RETURN_IF_ERROR(attached);
      auto scales = std::make_shared<std::vector<LoraScales>>();
      for (int64_t i = 0; i < batch; ++i) scales->push_back({{absl::StrCat("adapter", i % adapters), 1.0f}});
      auto rows = std::make_shared<LoraRows>();
      for (const LoraScales& s : *scales) rows->push_back(&s);
      bench.forward = [raw, x, c, scales, rows, samples] {
        const ScopedLoraRows scoped(rows.get());
        at::Tensor y = raw->Forward(x, c);
        *samples = y.size(0);
        return y;
      };
    }
    bench.root = std::move(stack);
    return bench;
  }
  const std::string dir = model_dir + "/transformer";
  ASSIGN_OR_RETURN(auto json, ReadJsonFile(dir + "/config.json"));
  const auto class_name = json.fields().find("_class_name");
  if (class_name != json.fields().end() && class_name->second.string_value() == "FluxTransformer2DModel") {
    ASSIGN_OR_RETURN(FluxTransformerConfig config, FluxTransformerConfigFromJson(json));
    auto model = std::make_unique<FluxTransformer>(config, LayerOptions{dtype});
    RETURN_IF_ERROR(LoadComponentWeights(*model, dir, dtype));
    const int64_t side = absl::GetFlag(FLAGS_image_size) / 8;  // Latent side; packed 2x2 patches.
    const int64_t text_tokens = absl::GetFlag(FLAGS_caption_tokens);
    at::manual_seed(0);
    ASSIGN_OR_RETURN(const at::Tensor hidden,
                     Input("hidden", at::randn({1, (side / 2) * (side / 2), config.in_channels}, options)));
    ASSIGN_OR_RETURN(const at::Tensor text, Input("text", at::randn({1, text_tokens, config.joint_attention_dim}, options)));
    ASSIGN_OR_RETURN(const at::Tensor pooled, Input("pooled", at::randn({1, config.pooled_projection_dim}, options)));
    const at::Tensor timestep = at::full({1}, 0.5, options);
    const at::Tensor img_ids = LatentImageIds(side, side).to(backend.torch_device());
    const at::Tensor txt_ids = at::zeros({text_tokens, 3}, img_ids.options());
    const at::Tensor guidance = config.guidance_embeds ? at::full({1}, 3.5, options) : at::Tensor();
    FluxTransformer* raw = model.get();
    // --batch: the same sample `batch` times along the batch dimension; sample 0's output is the row's.
    const int64_t batch = absl::GetFlag(FLAGS_batch);
    const at::Tensor hidden_b = hidden.repeat({batch, 1, 1}), text_b = text.repeat({batch, 1, 1});
    const at::Tensor pooled_b = pooled.repeat({batch, 1}), timestep_b = timestep.repeat({batch});
    const at::Tensor guidance_b = guidance.defined() ? guidance.repeat({batch}) : guidance;
    auto samples = bench.samples;
    bench.forward = [=] {
      at::Tensor y = raw->Forward(hidden_b, text_b, pooled_b, timestep_b, img_ids, txt_ids, guidance_b);
      *samples = y.size(0);
      return y.narrow(0, 0, 1);
    };
    bench.root = std::move(model);
    bench.model_name = "FluxTransformer2DModel";
    return bench;
  }
  ASSIGN_OR_RETURN(ZImageTransformerConfig config, ZImageTransformerConfigFromJson(json));
  auto model = std::make_unique<ZImageTransformer>(config, LayerOptions{dtype});
  RETURN_IF_ERROR(LoadComponentWeights(*model, dir, dtype));  // Views of the mapped files.
  const int64_t side = absl::GetFlag(FLAGS_image_size) / 8;
  at::manual_seed(0);  // The same inputs in every process (rows compare outputs across processes).
  ASSIGN_OR_RETURN(const at::Tensor latents, Input("latents", at::randn({config.in_channels, 1, side, side}, options)));
  ASSIGN_OR_RETURN(const at::Tensor caption,
                   Input("caption", at::randn({absl::GetFlag(FLAGS_caption_tokens), config.cap_feat_dim}, options)));
  ZImageTransformer* raw = model.get();
  const int64_t batch = absl::GetFlag(FLAGS_batch);
  auto samples = bench.samples;
  if (batch == 1) {
    bench.forward = [raw, latents, caption, samples] {
      *samples = 1;
      return raw->Forward(latents, 0.5, caption);
    };
  } else {
    // --batch: the same sample `batch` times in one forward (as the server batches requests of one
    // size); sample 0's output is the row's.
    const std::vector<at::Tensor> latents_b(static_cast<size_t>(batch), latents);
    const std::vector<at::Tensor> captions_b(static_cast<size_t>(batch), caption);
    bench.forward = [raw, latents_b, captions_b, samples] {
      std::vector<at::Tensor> y = raw->ForwardBatch(latents_b, 0.5, captions_b);
      *samples = static_cast<int64_t>(y.size());
      return y[0];
    };
  }
  bench.root = std::move(model);
  bench.model_name = "ZImageTransformer2DModel";
  return bench;
}

// One forward of a small stack of the same kind on the device (FP8 GEMMs too with --compute=fp8), then
// everything freed: the kernel libraries (cuBLAS / cuBLASLt, cuDNN) are loaded, as in any process that
// has served, and no weights are held — the process's base, warm.
absl::Status WarmKernelLibraries(DeviceBackend& backend, at::ScalarType dtype) {
  const Shape shape = ShapeFor("small");
  TransformerStack stack(shape.model, LayerOptions{dtype});
  FillBenchmarkWeights(stack, 5);
  c10::InferenceMode guard;
  if (absl::GetFlag(FLAGS_compute) == "fp8") {
    RETURN_IF_ERROR(fused::Fp8Supported(backend.torch_device()));
    RETURN_IF_ERROR(ConvertBlockLinearsToFp8(stack).status());
  }
  ASSIGN_OR_RETURN(auto weights, HostWeights::Capture(stack));
  RETURN_IF_ERROR(weights->OnloadAll(backend));
  const auto options = at::TensorOptions().dtype(dtype).device(backend.torch_device());
  (void)stack.Forward(at::randn({1, shape.tokens, shape.model.dim}, options),
                      at::randn({1, shape.model.modulation_dim}, options));
  backend.Synchronize();
  weights->OffloadAll();
  backend.ReleaseCachedMemory();
  return absl::OkStatus();
}

absl::StatusOr<RowResult> RunRow(const std::string& row, const Shape& shape, DeviceBackend& backend,
                                 at::ScalarType dtype) {
  (void)ResetPeakRss();
  RowResult result;
  result.row = row;
  ASSIGN_OR_RETURN(BenchModel bench, MakeModel(shape, backend, dtype));
  result.model = bench.model_name;
  Module& model = *bench.root;
  // --spill_dir: a module's tensors that no file holds move into a mapped file, as the server does with
  // host_spill_dir — with FP8 compute each block as it converts (the conversion never holds all of
  // them), then whatever is left.
  std::function<absl::Status(Module&)> spill;
  if (!absl::GetFlag(FLAGS_spill_dir).empty()) {
    spill = [&result](Module& m) -> absl::Status {
      ASSIGN_OR_RETURN(const SpillStats spilled, SpillHeapTensors(m, absl::GetFlag(FLAGS_spill_dir), "bench"));
      result.spilled_bytes += spilled.bytes;
      return absl::OkStatus();
    };
  }
  // FP8 compute streamed as int4: the FP8 form made with the int4 copy, in one pass (--fp8_one_pass).
  // Only weights in a file's mapping are declared (--model_dir); drawn ones convert at once.
  const bool want_one_pass = absl::GetFlag(FLAGS_compute) == "fp8" && absl::GetFlag(FLAGS_fp8_one_pass) &&
                             row.rfind("block_int4", 0) == 0;
  bool one_pass = false;
  if (absl::GetFlag(FLAGS_compute) == "fp8") {
    // FP8 compute: the blocks' linear layers become FP8 on the host before their host copies are
    // taken, as the server does at load (PipelineConfig.compute). Resident, the onload places the
    // FP8 weights (and scales) of layers that share an input side by side, as in the server, for
    // one FP8 GEMM; streamed, the FP8 weights and scales stream as they are (half the bf16 bytes)
    // and go into the FP8 GEMMs without widening — or, block_int4, as an int4 copy of the FP8
    // weights widened back into e4m3 on the device.
    if ((row.rfind("block_int", 0) == 0 && row.rfind("block_int4", 0) != 0) || row.rfind("block_fp8", 0) == 0) {
      return absl::InvalidArgumentError(
          row + ": --compute=fp8 streams the FP8 weights themselves (block_pinned) or their int4 copy (block_int4)");
    }
    RETURN_IF_ERROR(fused::Fp8Supported(backend.torch_device()));
    const auto start = std::chrono::steady_clock::now();
    c10::InferenceMode guard;
    ASSIGN_OR_RETURN(const int64_t converted, ConvertBlockLinearsToFp8(model, spill, want_one_pass));
    model.ForEachModule([&](Module& m) { one_pass |= !m.deferred_fp8().empty(); });
    result.prepare_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    result.prepare_fp8_s = result.prepare_s;
    std::printf("fp8: %lld linear layers %s in %.2f s\n", static_cast<long long>(converted),
                one_pass ? "declared (made with their int4 copy)" : "converted on the host", result.prepare_s);
  }
  if (spill) {
    const auto start = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(spill(model));
    result.prepare_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("spilled %.2f GB into mapped files\n", result.spilled_bytes / 1e9);
  }
  auto weights = HostWeights::Capture(model);
  if (!weights.ok()) return weights.status();
  result.weight_bytes = (*weights)->bytes();

  const CompressFormat compress = row.rfind("block_int8grouped", 0) == 0 ? CompressFormat::kInt8Grouped
                                  : row.rfind("block_int4", 0) == 0      ? CompressFormat::kInt4
                                  : row.rfind("block_int8", 0) == 0      ? CompressFormat::kInt8
                                  : row.rfind("block_fp8", 0) == 0       ? CompressFormat::kFp8E4M3
                                                                         : CompressFormat::kNone;
  at::Tensor reference;  // Compressed rows: the output of a resident forward, on the host.
  if (compress != CompressFormat::kNone && !absl::GetFlag(FLAGS_reference).empty()) {
    ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(absl::GetFlag(FLAGS_reference)));
    ASSIGN_OR_RETURN(at::Tensor saved, file->Get("output"));
    reference = saved.clone();
  } else if (compress != CompressFormat::kNone && one_pass) {
    result.rel_l2 = -1;  // Not measured: one pass leaves no FP8 host copy to onload as the reference.
  } else if (compress != CompressFormat::kNone) {
    RETURN_IF_ERROR((*weights)->OnloadAll(backend));
    {
      c10::InferenceMode guard;
      reference = bench.forward().to(at::kCPU).to(at::kFloat);
    }
    (*weights)->OffloadAll();
    backend.Synchronize();
    backend.ReleaseCachedMemory();
  }

  std::unique_ptr<GroupOffloader> offloader;
  if (row == "resident") {
    absl::Status status = (*weights)->OnloadAll(backend);
    if (!status.ok()) return status;
    result.streamed_bytes = 0;
    if (absl::GetFlag(FLAGS_compute) != "bf16" && absl::GetFlag(FLAGS_compute) != "fp8") {
      return absl::InvalidArgumentError("--compute must be bf16 or fp8");
    }
  } else {
    GroupOffloadOptions options;
    options.use_stream = backend.supports_streams();
    options.prefetch_depth = absl::GetFlag(FLAGS_prefetch_depth);
    // A row name may end in "_d<N>": prefetch depth N for that row.
    const size_t depth_at = row.rfind("_d");
    if (depth_at != std::string::npos && depth_at + 2 < row.size() &&
        row.find_first_not_of("0123456789", depth_at + 2) == std::string::npos) {
      options.prefetch_depth = std::stoi(row.substr(depth_at + 2));
    }
    options.type = row.rfind("leaf", 0) == 0 ? OffloadType::kLeafLevel : OffloadType::kBlockLevel;
    options.staging_buffer_bytes = absl::GetFlag(FLAGS_staging_mib) << 20;
    options.staging_buffers = absl::GetFlag(FLAGS_staging_buffers);
    options.staging_threads = absl::GetFlag(FLAGS_staging_threads);
    if (row.find("lowram") != std::string::npos) options.target = OffloadTarget::kPageableHost;
    // "_wg" in a compressed row's name: a group's weights widened in shared launches.
    options.widen_per_group = row.find("_wg") != std::string::npos;
    options.quantize_chunk_elements = absl::GetFlag(FLAGS_quantize_chunk_elements);
    if (row.find("disk") != std::string::npos) {
      options.target = OffloadTarget::kDisk;
      options.disk_dir = absl::GetFlag(FLAGS_disk_dir);
    }
    if (row.rfind("budget", 0) == 0) {
      options.budget_bytes = result.weight_bytes * std::stoi(row.substr(6, 2)) / 100;
    }
    // "_b<NN>" in a streamed row's name (e.g. block_int4_b20): a device budget of NN % of the weights'
    // bytes in the compute dtype, so the planner keeps what fits beside the slots resident (spread
    // along the forward) and streams the rest; the row's resident_bytes says how much it kept.
    for (size_t at = row.find("_b"); at != std::string::npos; at = row.find("_b", at + 2)) {
      const size_t digits = row.find_first_not_of("0123456789", at + 2);
      const size_t end = digits == std::string::npos ? row.size() : digits;
      if (end == at + 2 || end - at - 2 > 2 || (end < row.size() && row[end] != '_')) continue;
      options.budget_bytes = result.weight_bytes * std::stoi(row.substr(at + 2, end - at - 2)) / 100;
    }
    options.compress = compress;
    result.compress = CompressFormatName(compress);
    const auto prepare_start = std::chrono::steady_clock::now();
    auto applied = GroupOffloader::Apply("stack", model, **weights, backend, options);
    if (!applied.ok()) return applied.status();
    // The depth that runs (0 asks the engine to choose).
    result.prefetch_depth = options.use_stream ? (*applied)->options().prefetch_depth : 0;
    backend.Synchronize();
    result.prepare_s += std::chrono::duration<double>(std::chrono::steady_clock::now() - prepare_start).count();
    offloader = *std::move(applied);
    result.streamed_bytes = compress != CompressFormat::kNone
                                ? offloader->stats().bytes_per_forward
                                : offloader->stats().streamed_bytes + offloader->stats().always_on_bytes;
    result.working_set = offloader->stats().working_set_bytes;
    result.resident_bytes = offloader->stats().resident_bytes;
    result.prepare_pin_alloc_s = offloader->stats().prepare_pin_alloc_s;
    result.prepare_quantize_s = offloader->stats().prepare_quantize_s;
    result.one_pass_fp8_weights = offloader->stats().one_pass_fp8_weights;
  }

  {
    auto memory = ReadProcessMemory();
    result.rss_after_prepare = memory.ok() ? memory->rss_bytes : 0;
  }
  c10::InferenceMode guard;
  for (int i = 0; i < absl::GetFlag(FLAGS_warmup); ++i) bench.forward();
  backend.Synchronize();
  backend.ResetPeakStats();
  std::vector<double> steps;
  at::Tensor out;
  if (absl::GetFlag(FLAGS_back_to_back)) {
    const int iters = std::max(1, absl::GetFlag(FLAGS_iters));
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) out = bench.forward();
    backend.Synchronize();
    steps.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / iters);
  } else {
    for (int i = 0; i < absl::GetFlag(FLAGS_iters); ++i) {
      const auto start = std::chrono::steady_clock::now();
      out = bench.forward();
      backend.Synchronize();
      steps.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  if (!absl::GetFlag(FLAGS_profile).empty()) {
    RETURN_IF_ERROR(TraceOnce(
        [&] {
          bench.forward();
          backend.Synchronize();
        },
        absl::GetFlag(FLAGS_profile)));
  }
  if (reference.defined() && out.defined()) {
    const at::Tensor got = out.to(at::kCPU).to(at::kDouble);
    const at::Tensor want = reference.to(at::kDouble);
    result.rel_l2 = (got - want).norm().item<double>() / std::max(want.norm().item<double>(), 1e-30);
  }
  if (!absl::GetFlag(FLAGS_save_output).empty() && out.defined()) {
    RETURN_IF_ERROR(WriteSafetensors(absl::GetFlag(FLAGS_save_output),
                                     {{"output", out.to(at::kCPU).to(at::kFloat).contiguous()}}));
  }
  result.step_s = Median(steps);
  result.samples = *bench.samples;
  result.peak_device = backend.GetMemoryStats().peak_allocated_bytes;
  auto memory = ReadProcessMemory();
  result.peak_rss = memory.ok() ? memory->peak_rss_bytes : 0;
  if (offloader) {
    result.pinned_in_place = offloader->stats().pinned_in_place_bytes;
    result.pin_in_place_error = offloader->stats().pin_in_place_error;
  }
  offloader.reset();
  weights->reset();
  backend.Synchronize();
  backend.ReleaseCachedMemory();
  return result;
}

int Main() {
  if (const int64_t batch = absl::GetFlag(FLAGS_batch); batch < 1 || batch > 64) {
    std::cerr << "--batch=" << batch << ": 1..64 samples in one forward\n";
    return 1;
  }
  fused::SetEnabled(absl::GetFlag(FLAGS_fused));
  const Shape shape = ShapeFor(absl::GetFlag(FLAGS_config));
  std::unique_ptr<DeviceBackend> backend;
  const std::string kind = absl::GetFlag(FLAGS_backend);
  const std::string thp_mode = TransparentHugePageMode();
  bool huge_pinned = false;  // The CUDA backend's pinned buffers are huge-page memory (as it decides).
  if (kind == "cuda" || (kind == "auto" && CudaAvailable())) {
    CudaBackendOptions cuda_options;
    cuda_options.pinned_huge_pages = absl::GetFlag(FLAGS_pinned_huge_pages);
    huge_pinned = cuda_options.pinned_huge_pages && TransparentHugePagesOn();
    auto cuda = CreateCudaBackend(0, cuda_options);
    if (!cuda.ok()) {
      std::cerr << cuda.status() << "\n";
      return 1;
    }
    backend = *std::move(cuda);
  } else {
    backend = CreateSimulatedBackend({});
  }
  if (!absl::GetFlag(FLAGS_widen_layout).empty() && !SetWideningLayout(absl::GetFlag(FLAGS_widen_layout))) {
    std::cerr << "--widen_layout=" << absl::GetFlag(FLAGS_widen_layout) << ": coalesced or strided\n";
    return 1;
  }
  const std::string priority = absl::GetFlag(FLAGS_compute_priority);
  if (priority != "default" && priority != "high") {
    std::cerr << "--compute_priority=" << priority << ": default or high\n";
    return 1;
  }

  // This thread runs every forward: it is the compute thread (as the server's device worker is).
  backend->EnterComputeThread(priority == "high");
  const at::ScalarType dtype = at::kBFloat16;
  const bool small = absl::GetFlag(FLAGS_config) == "small";
  const double bandwidth = MeasureBandwidth(*backend, small ? (int64_t{64} << 20) : (int64_t{1} << 30));
  // The process's own base: CUDA context, LibTorch and the bandwidth probe's device buffers, no weights.
  const absl::StatusOr<ProcessMemory> base_memory = ReadProcessMemory();
  const int64_t base_rss = base_memory.ok() ? base_memory->rss_bytes : 0;
  // And once the kernel libraries are loaded (a forward of a small stack, freed): the base of a
  // process that has served, still without weights.
  if (absl::Status warmed = WarmKernelLibraries(*backend, at::kBFloat16); !warmed.ok()) {
    std::cerr << "warming the kernel libraries: " << warmed << "\n";
    return 1;
  }
  ::malloc_trim(0);
  const absl::StatusOr<ProcessMemory> warm_memory = ReadProcessMemory();
  const int64_t base_rss_warm = warm_memory.ok() ? warm_memory->rss_bytes : 0;
  std::printf("process base RSS %.3f GB, %.3f GB with the kernel libraries loaded\n", base_rss / 1e9,
              base_rss_warm / 1e9);
  double page_cache_read_s = 0;
  if (!absl::GetFlag(FLAGS_model_dir).empty()) {
    absl::StatusOr<double> read = PageCacheReadSeconds(absl::GetFlag(FLAGS_model_dir) + "/transformer");
    if (!read.ok()) {
      std::cerr << read.status() << "\n";
      return 1;
    }
    page_cache_read_s = *read;
    std::printf("transformer weights read from the page cache in %.4f s (one thread)\n", page_cache_read_s);
  }
  std::vector<RowResult> results;
  double resident_step = absl::GetFlag(FLAGS_resident_step_s);
  std::printf("device %s, pinned host->device %.1f GB/s\n", backend->name().c_str(), bandwidth / 1e9);
  std::printf("%-14s %9s %9s %7s %7s %12s %12s %11s %9s\n", "row", "step_s", "floor_s", "x_floor",
              "x_res", "peak_dev_GB", "peak_rss_GB", "weights_GB", "h2d_GB/s");
  std::ofstream out;
  if (!absl::GetFlag(FLAGS_out).empty()) out.open(absl::GetFlag(FLAGS_out), std::ios::app);
  const std::vector<std::string> rows = absl::StrSplit(absl::GetFlag(FLAGS_rows), ',', absl::SkipEmpty());
  for (const std::string& row : rows) {
    if (row == "pin_probe") {
      const int64_t total = small ? (int64_t{64} << 20) : (int64_t{1} << 30);
      const PinRates rates = MeasurePinning(*backend, total);
      std::printf("pinning %lld MiB: pinned allocation %.2f GB/s, written and registered %.2f GB/s (4 KiB pages), "
                  "%.2f GB/s (huge pages)\n",
                  static_cast<long long>(total >> 20), rates.host_alloc / 1e9, rates.register_4k / 1e9,
                  rates.register_huge / 1e9);
      if (out.is_open()) {
        out << absl::StrFormat("{\"row\": \"pin_probe\", \"bytes\": %d, \"pinned_alloc_bytes_per_s\": %.0f, "
                               "\"register_4k_bytes_per_s\": %.0f, \"register_huge_bytes_per_s\": %.0f, "
                               "\"device\": \"%s\", \"machine\": \"%s\"}\n",
                               total, rates.host_alloc, rates.register_4k, rates.register_huge, backend->name(),
                               absl::GetFlag(FLAGS_machine));
      }
      continue;
    }
    if (row == "widen_probe") {
      // Z-Image's FFN shape on the full config (8 weights of [10240, 3840], 315 M values), a small
      // one otherwise; FP8 outputs where LibTorch has float8 and the device is CUDA (FP8 compute).
      const int64_t rows = small ? 512 : 10240, k = small ? 384 : 3840;
      constexpr int kWeights = 8;
      std::vector<std::pair<std::string, at::ScalarType>> outs = {{"bf16", at::kBFloat16}};
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 1)
      if (backend->torch_device().is_cuda()) outs.emplace_back("fp8_e4m3", at::kFloat8_e4m3fn);
#endif
      // What the device's memory does for plain copies of the same bytes: the widening's ceiling.
      for (const auto& [out_name, out_dtype] : outs) {
        const double copy = MeasureDeviceCopy(*backend, out_dtype, kWeights, rows, k);
        std::printf("device copy of %d [%lld, %lld] %s weights: %.1f GB/s (read and write)\n", kWeights,
                    static_cast<long long>(rows), static_cast<long long>(k), out_name.c_str(), copy / 1e9);
        if (out.is_open()) {
          out << absl::StrFormat("{\"row\": \"widen_probe\", \"format\": \"copy\", \"out\": \"%s\", "
                                 "\"weights\": %d, \"rows\": %d, \"k\": %d, \"bytes_per_s\": %.0f, "
                                 "\"device\": \"%s\", \"machine\": \"%s\"}\n",
                                 out_name, kWeights, rows, k, copy, backend->name(), absl::GetFlag(FLAGS_machine));
        }
      }
      const std::string chosen_layout = WideningLayoutName();
      for (const char* layout : {"coalesced", "strided"}) {
        SetWideningLayout(layout);
        for (const CompressFormat format : {CompressFormat::kInt8Grouped, CompressFormat::kInt4}) {
          for (const auto& [out_name, out_dtype] : outs) {
            for (const bool shared : {false, true}) {
              absl::StatusOr<WidenRate> rate;
              try {
                rate = MeasureWidening(*backend, format, out_dtype, shared, kWeights, rows, k);
              } catch (const c10::Error& e) {
                rate = absl::InternalError(e.what_without_backtrace());
              }
              if (!rate.ok()) {
                std::printf("widen_probe %s -> %s failed: %s\n", CompressFormatName(format), out_name.c_str(),
                            std::string(rate.status().message()).c_str());
                continue;
              }
              const double bytes_per_s = rate->bytes_per_pass / rate->seconds_per_pass;
              std::printf("widening %s -> %s, %s, %s layout: %.3f ms a pass of %.1f MB, %.1f GB/s\n",
                          CompressFormatName(format), out_name.c_str(), shared ? "shared launches" : "one launch a weight",
                          layout, rate->seconds_per_pass * 1e3, rate->bytes_per_pass / 1e6, bytes_per_s / 1e9);
              if (out.is_open()) {
                out << absl::StrFormat(
                    "{\"row\": \"widen_probe\", \"format\": \"%s\", \"out\": \"%s\", \"shared_launches\": %s, "
                    "\"layout\": \"%s\", \"weights\": %d, \"rows\": %d, \"k\": %d, \"seconds_per_pass\": %.6f, "
                    "\"bytes_per_pass\": %d, \"bytes_per_s\": %.0f, \"device\": \"%s\", \"machine\": \"%s\"}\n",
                    CompressFormatName(format), out_name, shared ? "true" : "false", layout, kWeights, rows, k,
                    rate->seconds_per_pass,
                    rate->bytes_per_pass, bytes_per_s, backend->name(), absl::GetFlag(FLAGS_machine));
              }
            }
          }
        }
      }
      SetWideningLayout(chosen_layout);
      continue;
    }
    if (row == "memcpy_probe") {
      for (int threads : {1, 4, 8, 16}) {
        const double rate = MeasureMemcpy(*backend, threads, small ? (int64_t{256} << 20) : (int64_t{2} << 30));
        std::printf("memcpy pageable->pinned, %2d threads: %.1f GB/s\n", threads, rate / 1e9);
        if (out.is_open()) {
          out << absl::StrFormat("{\"row\": \"memcpy_probe\", \"threads\": %d, \"memcpy_bytes_per_s\": %.0f, "
                                 "\"h2d_bandwidth_bytes_per_s\": %.0f, \"machine\": \"%s\"}\n",
                                 threads, rate, bandwidth, absl::GetFlag(FLAGS_machine));
        }
      }
      continue;
    }
    auto result = RunRow(row, shape, *backend, dtype);
    if (!result.ok()) {
      std::printf("%-14s failed: %s\n", row.c_str(), std::string(result.status().message()).c_str());
      continue;
    }
    // The process's base again, now that the row freed its weights, host copies and model (heap
    // handed back): what it holds beyond the base measured at start is what running a forward
    // loaded and kept (the CUDA libraries' kernels), not weights.
    ::malloc_trim(0);
    const absl::StatusOr<ProcessMemory> after_memory = ReadProcessMemory();
    const int64_t base_rss_after = after_memory.ok() ? after_memory->rss_bytes : 0;
    if (row == "resident") resident_step = result->step_s;
    const double floor_s = static_cast<double>(result->weight_bytes) / bandwidth;
    const double achieved = result->streamed_bytes > 0 ? result->streamed_bytes / result->step_s : 0;
    const double floor_8bit_s = result->compress != "none" ? result->streamed_bytes / bandwidth : 0.0;
    std::printf("%-14s %9.4f %9.4f %7.2f %7.2f %12.2f %12.2f %11.2f %9.1f", row.c_str(),
                result->step_s, floor_s, result->step_s / floor_s,
                resident_step > 0 ? result->step_s / resident_step : 0.0, result->peak_device / 1e9,
                result->peak_rss / 1e9, result->weight_bytes / 1e9, achieved / 1e9);
    if (result->compress != "none") {
      std::printf("  (%s: 8-bit floor %.4f s, x8bit %.2f, rel_l2 %.4f)", result->compress.c_str(), floor_8bit_s,
                  result->step_s / floor_8bit_s, result->rel_l2);
    }
    std::printf("\n");
    std::fflush(stdout);
    if (out.is_open()) {
      out << absl::StrFormat(
          "{\"row\": \"%s\", \"step_s\": %.6f, \"floor_s\": %.6f, \"resident_step_s\": %.6f, "
          "\"peak_device_bytes\": %d, \"peak_rss_bytes\": %d, \"weight_bytes\": %d, "
          "\"streamed_bytes\": %d, \"working_set_bytes\": %d, \"h2d_bandwidth_bytes_per_s\": %.0f, "
          "\"achieved_h2d_bytes_per_s\": %.0f, \"config\": \"%s\", \"device\": \"%s\", "
          "\"prefetch_depth\": %d, \"staging\": \"%dx%dMiB, %d threads\", \"pinned_in_place_bytes\": %d, "
          "\"pin_in_place_error\": \"%s\", \"model\": \"%s\", \"machine\": \"%s\", \"compress\": \"%s\", "
          "\"floor_8bit_s\": %.6f, \"rel_l2\": %.6f, \"prepare_s\": %.3f, \"batch\": %d, \"lora_adapters\": %d, "
          "\"lora_rank\": %d, \"base_rss_bytes\": %d, \"base_rss_warm_bytes\": %d, \"base_rss_after_bytes\": %d, "
          "\"compute_priority\": \"%s\", \"page_cache_read_s\": %.6f, \"prepare_fp8_s\": %.3f, "
          "\"prepare_pin_alloc_s\": %.3f, \"prepare_quantize_s\": %.3f, \"pinned_huge_pages\": %s, "
          "\"thp_mode\": \"%s\", \"widen_layout\": \"%s\", \"spilled_bytes\": %d, \"rss_after_prepare_bytes\": %d, \"resident_bytes\": %d, "
          "\"one_pass_fp8_weights\": %d, \"samples\": %d, \"back_to_back\": %s}\n",
          row, result->step_s, floor_s, resident_step, result->peak_device, result->peak_rss,
          result->weight_bytes, result->streamed_bytes, result->working_set, bandwidth, achieved,
          absl::GetFlag(FLAGS_config), backend->name(), result->prefetch_depth,
          absl::GetFlag(FLAGS_staging_buffers),
          absl::GetFlag(FLAGS_staging_mib), absl::GetFlag(FLAGS_staging_threads), result->pinned_in_place,
          absl::CHexEscape(result->pin_in_place_error),
          result->model,
          absl::GetFlag(FLAGS_machine), result->compress, floor_8bit_s, result->rel_l2, result->prepare_s,
          absl::GetFlag(FLAGS_batch), absl::GetFlag(FLAGS_lora_adapters), absl::GetFlag(FLAGS_lora_rank), base_rss,
          base_rss_warm, base_rss_after, priority, page_cache_read_s, result->prepare_fp8_s,
          result->prepare_pin_alloc_s, result->prepare_quantize_s,
          huge_pinned ? "true" : "false", thp_mode, WideningLayoutName(), result->spilled_bytes,
          result->rss_after_prepare, result->resident_bytes, result->one_pass_fp8_weights, result->samples,
          absl::GetFlag(FLAGS_back_to_back) ? "true" : "false");
      out.flush();
    }
  }
  return 0;
}

}  // namespace
}  // namespace stowage

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return stowage::Main();
}
