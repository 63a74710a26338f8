// LoRA adapters on Linear layers, applied unmerged: a layer with weight W computes
//   y = x·Wᵀ + b + Σ_active scale · factor · (x·Aᵀ)·Bᵀ
// (A: "down", [rank, in]; B: "up", [out, rank]; factor = alpha / rank), so the base weights stay
// untouched (resident, streamed or compressed alike) and adapters come and go without a reload.
//
// Which adapters a forward applies, and how strongly, is the running thread's LoraScales, installed
// for a run by ScopedLoras (the device worker around a pipeline run); a layer adds the deltas of
// the adapters it carries that are active. Files: ReadLoraFile parses the PEFT / diffusers layout.
//
// Mixed batches: requests with different adapters run in one batch. ScopedLoraRows installs one
// LoraScales per batch row (dim 0 of the activations a batched forward sees); a layer then adds to
// each row the deltas of that row's adapters: per adapter d = (x·Aᵀ)·Bᵀ over the whole batch, times
// a per-row factor (0 for rows without it) in float32, rounded to x's dtype as the uniform path
// rounds its scalar product — so a row with at most two adapters gets the bits it gets run alone.
// An input whose dim 0 is a multiple of the rows (flattened tokens) spreads each row's factor over
// its block; one of a single row computed once for the whole batch (e.g. a shared timestep
// embedding) becomes one row per batch row. Work a model does per sample inside a batched forward
// names its row with ScopedLoraRow. When every row has the same adapters, the rows act as
// ScopedLoras (the uniform path, bit-identical to an unmixed batch).
#ifndef STOWAGE_MODELS_CORE_LORA_H_
#define STOWAGE_MODELS_CORE_LORA_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include "absl/status/statusor.h"
#include "offload/module.h"

namespace stowage {

struct LoraWeights {
  at::Tensor down;  // A: [rank, in_features]
  at::Tensor up;    // B: [out_features, rank]
  float factor = 1.0f;  // alpha / rank
  // Set for the matrices of a placed adapter (MakeLoraAdapterModule): they are read from these slots
  // of its module, wherever placement keeps them (on the device while a run holds the adapter;
  // undefined while it is offloaded), and `down` / `up` stay empty.
  const TensorSlot* down_slot = nullptr;
  const TensorSlot* up_slot = nullptr;
  const at::Tensor& A() const { return down_slot != nullptr ? down_slot->value : down; }
  const at::Tensor& B() const { return up_slot != nullptr ? up_slot->value : up; }
  int64_t rank() const { return A().defined() ? A().size(0) : 0; }
  int64_t bytes() const { return (A().defined() ? A().nbytes() : 0) + (B().defined() ? B().nbytes() : 0); }
};

// The module kind of an adapter's placeable module.
inline constexpr char kLoraAdapterKind[] = "LoraAdapter";

// One adapter's matrices as a module of its own (kind kLoraAdapterKind), a parameter pair per adapted
// layer: what placement registers as the adapter's component and moves between host and device like
// any other (its bytes count in the device budget). `layers`: (key, weights with `down`/`up` as CPU
// tensors, cast to `dtype` here). Returns the module and, in `layers`' order, each layer's weights
// pointing at the module's slots (valid while the module lives).
struct LoraAdapterModule {
  std::unique_ptr<Module> module;
  std::vector<LoraWeights> weights;
};
LoraAdapterModule MakeLoraAdapterModule(const std::vector<std::pair<std::string, const LoraWeights*>>& layers,
                                        const std::vector<at::ScalarType>& dtypes);

// Adapter name → scale, for one run.
using LoraScales = std::vector<std::pair<std::string, float>>;

struct LoraPack;

// One LoraScales per batch row (each non-null).
using LoraRows = std::vector<const LoraScales*>;

// Installs `scales` as the running thread's active adapters until destroyed (restoring what was
// active before). `scales` must outlive the scope; null or empty: none.
class ScopedLoras {
 public:
  explicit ScopedLoras(const LoraScales* scales);
  ~ScopedLoras();
  ScopedLoras(const ScopedLoras&) = delete;
  ScopedLoras& operator=(const ScopedLoras&) = delete;

 private:
  const LoraScales* previous_;
  const LoraRows* previous_rows_;
};

// The running thread's active adapters when uniform (null when none or per row).
const LoraScales* ActiveLoras();

// Installs `rows` as the running thread's per-row adapters until destroyed (restoring what was
// active before); when every row has the same adapters and scales, as ScopedLoras(rows[0]).
// `rows` must outlive the scope; null or empty: no adapters.
class ScopedLoraRows {
 public:
  explicit ScopedLoraRows(const LoraRows* rows);
  ~ScopedLoraRows();
  ScopedLoraRows(const ScopedLoraRows&) = delete;
  ScopedLoraRows& operator=(const ScopedLoraRows&) = delete;

 private:
  const LoraScales* previous_uniform_;
  const LoraRows* previous_rows_;
  std::map<std::string, at::Tensor>* previous_scales_;
  // The per-row scales a forward's layers share, made once per scope on the device (no
  // host-to-device copy per layer): by adapters, their alpha/rank factors, device and row repeat.
  std::map<std::string, at::Tensor> scales_;
  // The outermost scope: the layers' packs built under it, emptied when it ends.
  bool owns_packs_ = false;
  std::vector<LoraPack*> packs_;
};

// Inside ScopedLoraRows: row `row`'s adapters, uniformly, until destroyed (a per-sample step of a
// batched forward). Without rows installed: no change. `row` must be one of the rows.
class ScopedLoraRow {
 public:
  explicit ScopedLoraRow(size_t row);
  ~ScopedLoraRow();
  ScopedLoraRow(const ScopedLoraRow&) = delete;
  ScopedLoraRow& operator=(const ScopedLoraRow&) = delete;

 private:
  const LoraScales* previous_uniform_;
  const LoraRows* previous_rows_;
};

// The running thread's per-row adapters (null when none or uniform).
const LoraRows* ActiveLoraRows();

// True when some adapter of `attached` is active (uniformly or in any row) with a non-zero scale.
bool AnyLoraActive(const std::map<std::string, LoraWeights>& attached);

// A layer's adapters concatenated for the packed per-row path: the down matrices stacked
// ([Σr, in]) and the up matrices side by side ([out, Σr]) of `names`, on one device and dtype.
// Rebuilt when the set of adapters a batch uses changes; owned by the layer, and emptied when the
// outermost ScopedLoraRows that used it ends (its copies are the batch's working memory, not a
// second resident copy of the adapters).
struct LoraPack {
  std::vector<std::string> names;
  c10::Device device = c10::Device(c10::kCPU);
  at::ScalarType dtype = at::kFloat;
  at::Tensor down, up;
  std::vector<int64_t> offsets;  // Column of each adapter in Σr (names' order), then Σr.
  std::string key;               // Names, factors and device: the prefix of its row scales' key.
};

// Σ scale · factor · (x·Aᵀ)·Bᵀ over the adapters of `attached` that are active with a non-zero
// scale, in x's dtype; undefined when none is. Per row when rows are installed (see above; the
// delta then has the batch's rows when x has one row); c10::Error when x's dim 0 neither equals,
// is a multiple of, nor is 1 against the rows.
// With `pack` (the fast path: Linear passes it on CUDA), rows run packed instead of one adapter at a
// time: h = x·[A₁;…;Aₖ]ᵀ (one product for every adapter the batch uses), each row's columns scaled
// by its scale · factor (0 for adapters it does not use) in float32 and rounded to x's dtype, then
// h·[B₁ … Bₖ]ᵀ — two products a layer whatever k. It scales before the up-projection where the
// per-adapter path scales after, so a row matches its image alone within rounding, not bit for bit.
at::Tensor LoraDelta(const std::map<std::string, LoraWeights>& attached, const at::Tensor& x,
                     LoraPack* pack = nullptr);

// y + LoraDelta(attached, x, pack) for a layer's output y (which the caller owns: it may be changed in
// place and returned). With `pack` (the fast path) the up-projection's GEMM accumulates into y — no
// delta tensor and no separate addition, two passes over the output fewer — and a uniform adapter's
// scale multiplies the float32 accumulator; within rounding of the path without `pack`, which this
// is, bit for bit, when `pack` is null.
at::Tensor AddLoraDelta(const std::map<std::string, LoraWeights>& attached, const at::Tensor& x, at::Tensor y,
                        LoraPack* pack = nullptr);

// A LoRA file's layers, by the dotted path of the Linear they adapt within a pipeline component
// ("transformer", "text_encoder", ...).
struct LoraFile {
  std::map<std::string, std::map<std::string, LoraWeights>> layers;  // component → path → weights
  int64_t rank = 0;   // The largest rank.
  int64_t bytes = 0;  // A and B of every layer as stored.
  // Kohya's layout names a layer by its path with every '.' written '_' ("layers_0_attention_to_q"),
  // which cannot be split back without the model: the paths in `layers` are then those names until
  // ResolveLayerPaths maps them onto the component's Linear layers.
  bool underscored_paths = false;
};

// For a file with underscored paths: each layer's name matched against the component's Linear paths
// (`linear_paths`: component → its Linear layers' dotted paths) written the same way, and replaced
// by the dotted path. INVALID_ARGUMENT naming the layer when no Linear matches it, or when two
// Linear paths of the component read the same underscored (then the name is ambiguous). A file with
// dotted paths is left as it is.
absl::Status ResolveLayerPaths(LoraFile& file, const std::map<std::string, std::vector<std::string>>& linear_paths);

// Reads a LoRA from a safetensors file, in either of the layouts trainers write:
//  - PEFT / diffusers: per adapted layer "<component>.<path>.lora_A.weight" ([rank, in]) and
//    "<component>.<path>.lora_B.weight" ([out, rank]) — "<component>." is "transformer.",
//    "text_encoder." (or "unet.") and may be absent (then `default_component`); PEFT's
//    "base_model.model." prefix and the original checkpoints' "diffusion_model." (the transformer)
//    are accepted;
//  - kohya (sd-scripts, ComfyUI): "lora_unet_<path with '_' for '.'>.lora_down.weight" (A) and
//    ".lora_up.weight" (B) for the transformer, "lora_te_" / "lora_te1_" for text_encoder,
//    "lora_te2_" for text_encoder_2 (underscored_paths; ResolveLayerPaths finds the layers);
// and optionally "<...>.alpha" per layer (a scalar: factor alpha / rank; else `alpha` when given
// (> 0), else factor 1). A file mixing the layouts is refused.
// Tensors are read to the CPU in float32. Errors name the file and the key: a lora_A without its
// lora_B, ranks that differ between A and B, rank 0 or above 1024, non-float dtypes, keys that are
// not LoRA tensors, non-finite values.
absl::StatusOr<LoraFile> ReadLoraFile(const std::string& path, const std::string& default_component = "transformer",
                                      float alpha = 0.0f);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_LORA_H_
