#include "models/core/lora.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <ATen/ATen.h>

#include "absl/base/casts.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "models/core/device_copy.h"
#include "offload/safetensors.h"

namespace stowage {
namespace {

thread_local const LoraScales* active_loras = nullptr;
thread_local const LoraRows* active_rows = nullptr;
// The row-scale cache of the innermost ScopedLoraRows (null outside one).
thread_local std::map<std::string, at::Tensor>* active_scales = nullptr;
// The packs built under the outermost ScopedLoraRows, emptied when it ends.
thread_local std::vector<LoraPack*>* active_packs = nullptr;

bool SameScales(const LoraScales& a, const LoraScales& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].first != b[i].first || absl::bit_cast<uint32_t>(a[i].second) != absl::bit_cast<uint32_t>(b[i].second)) {
      return false;
    }
  }
  return true;
}

// The adapters of `attached` active with a non-zero scale in `scales`, in its order.
void CollectActive(const std::map<std::string, LoraWeights>& attached, const LoraScales& scales,
                   std::vector<std::string>* names) {
  for (const auto& [name, scale] : scales) {
    if (scale == 0.0f || attached.count(name) == 0) continue;
    if (std::find(names->begin(), names->end(), name) == names->end()) names->push_back(name);
  }
}

// The per-row scales under `key` in the scope's cache, made by `make` (on the host) and moved to
// `device` once; `repeat` > 1 repeats each row that many times (flattened tokens).
template <typename Make>
at::Tensor RowScales(const std::string& key, c10::Device device, int64_t repeat, Make make) {
  if (active_scales != nullptr) {
    auto it = active_scales->find(key);
    if (it != active_scales->end()) return it->second;
  }
  // float32: the product rounds once, as x * scalar. Without waiting for the device (device_copy.h):
  // a scope opens every denoising step in a batch that mixes adapters.
  at::Tensor scales = ToDeviceWithoutWaiting(make(), device);
  if (repeat > 1) scales = scales.repeat_interleave(repeat, 0);
  if (active_scales != nullptr) active_scales->emplace(key, scales);
  return scales;
}

// Row i's scale · factor of adapter `name` (0 when the row does not use it).
float RowScale(const LoraScales& row, const std::string& name, float factor) {
  for (const auto& [row_name, scale] : row) {
    if (row_name == name) return scale * factor;
  }
  return 0.0f;
}

at::Tensor Delta(const LoraWeights& w, const at::Tensor& x) {
  const at::Tensor down = w.A().to(x.device(), x.scalar_type());
  const at::Tensor up = w.B().to(x.device(), x.scalar_type());
  return at::linear(at::linear(x, down), up);
}

// The packed path of RowsDelta (see LoraDelta) up to the up-projection: x·[A₁;…;Aₖ]ᵀ with each row's
// columns scaled, in x's dtype ([..., Σr]); the caller multiplies by pack.up.
at::Tensor PackedRowsHidden(const std::map<std::string, LoraWeights>& attached, const LoraRows& rows,
                            const std::vector<std::string>& names, const at::Tensor& x, int64_t repeat,
                            LoraPack& pack) {
  if (pack.names != names || pack.device != x.device() || pack.dtype != x.scalar_type()) {
    std::vector<at::Tensor> downs, ups;
    pack.offsets.clear();
    int64_t columns = 0;
    for (const std::string& name : names) {
      const LoraWeights& w = attached.at(name);
      downs.push_back(w.A().to(x.device(), x.scalar_type()));
      ups.push_back(w.B().to(x.device(), x.scalar_type()));
      pack.offsets.push_back(columns);
      columns += w.rank();
    }
    pack.offsets.push_back(columns);
    pack.down = at::cat(downs, 0).contiguous();
    pack.up = at::cat(ups, 1).contiguous();
    pack.names = names;
    pack.device = x.device();
    pack.dtype = x.scalar_type();
    pack.key = absl::StrCat("packed|", x.device().str());
    for (const std::string& name : names) {
      absl::StrAppend(&pack.key, "|", name, "=", absl::bit_cast<uint32_t>(attached.at(name).factor));
    }
    if (active_packs != nullptr) active_packs->push_back(&pack);
  }
  const int64_t columns = pack.offsets.back();
  const auto r = static_cast<int64_t>(rows.size());
  const at::Tensor scales = RowScales(absl::StrCat(pack.key, "|", repeat), x.device(), repeat, [&] {
    std::vector<float> host(static_cast<size_t>(r * columns), 0.0f);
    for (int64_t i = 0; i < r; ++i) {
      for (size_t j = 0; j < names.size(); ++j) {
        const float value = RowScale(*rows[static_cast<size_t>(i)], names[j], attached.at(names[j]).factor);
        for (int64_t c = pack.offsets[j]; c < pack.offsets[j + 1]; ++c) host[static_cast<size_t>(i * columns + c)] = value;
      }
    }
    return at::tensor(host).view({r, columns});
  });
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape.front() = scales.size(0);
  shape.back() = columns;
  return (at::linear(x, pack.down).to(at::kFloat) * scales.view(shape)).to(x.scalar_type());
}

// The adapters the rows use (each once, in first-use order).
std::vector<std::string> RowsActive(const std::map<std::string, LoraWeights>& attached, const LoraRows& rows) {
  std::vector<std::string> names;
  for (const LoraScales* row : rows) CollectActive(attached, *row, &names);
  return names;
}

// x's rows against the batch's: how many input rows each request row spans (checked).
int64_t RowRepeat(const LoraRows& rows, const at::Tensor& x) {
  const auto r = static_cast<int64_t>(rows.size());
  const int64_t n = x.size(0);
  TORCH_CHECK(n == r || n == 1 || n % r == 0, "LoRA: an input of ", n, " rows in a batch of ", r,
              " requests with different adapters");
  return n > r ? n / r : 1;
}

at::Tensor RowsDelta(const std::map<std::string, LoraWeights>& attached, const LoraRows& rows, const at::Tensor& x,
                     LoraPack* pack) {
  const std::vector<std::string> names = RowsActive(attached, rows);
  if (names.empty()) return at::Tensor();
  const auto r = static_cast<int64_t>(rows.size());
  const int64_t repeat = RowRepeat(rows, x);
  if (pack != nullptr) return at::linear(PackedRowsHidden(attached, rows, names, x, repeat, *pack), pack->up);
  at::Tensor delta;
  for (const std::string& name : names) {
    const LoraWeights& w = attached.at(name);
    const std::string key = absl::StrCat("adapter|", x.device().str(), "|", repeat, "|", name, "=",
                                         absl::bit_cast<uint32_t>(w.factor));
    const at::Tensor f = RowScales(key, x.device(), repeat, [&] {
      std::vector<float> factors(static_cast<size_t>(r));
      for (int64_t i = 0; i < r; ++i) factors[static_cast<size_t>(i)] = RowScale(*rows[static_cast<size_t>(i)], name, w.factor);
      return at::tensor(factors);
    });
    std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
    shape[0] = f.size(0);
    const at::Tensor d = (Delta(w, x).to(at::kFloat) * f.view(shape)).to(x.scalar_type());
    delta = delta.defined() ? delta + d : d;
  }
  return delta;
}

constexpr int64_t kMaxLoraRank = 1024;

}  // namespace

ScopedLoras::ScopedLoras(const LoraScales* scales) : previous_(active_loras), previous_rows_(active_rows) {
  active_loras = scales != nullptr && !scales->empty() ? scales : nullptr;
  active_rows = nullptr;
}

ScopedLoras::~ScopedLoras() {
  active_loras = previous_;
  active_rows = previous_rows_;
}

const LoraScales* ActiveLoras() { return active_loras; }
const LoraRows* ActiveLoraRows() { return active_rows; }

ScopedLoraRows::ScopedLoraRows(const LoraRows* rows)
    : previous_uniform_(active_loras), previous_rows_(active_rows), previous_scales_(active_scales) {
  active_scales = &scales_;
  if (active_packs == nullptr) {
    active_packs = &packs_;
    owns_packs_ = true;
  }
  active_loras = nullptr;
  active_rows = nullptr;
  if (rows == nullptr || rows->empty()) return;
  bool same = true;
  for (const LoraScales* row : *rows) same = same && SameScales(*row, *rows->front());
  if (same) {
    active_loras = rows->front()->empty() ? nullptr : rows->front();
  } else {
    active_rows = rows;
  }
}

ScopedLoraRows::~ScopedLoraRows() {
  if (owns_packs_) {
    for (LoraPack* pack : packs_) *pack = LoraPack();
    active_packs = nullptr;
  }
  active_loras = previous_uniform_;
  active_rows = previous_rows_;
  active_scales = previous_scales_;
}

ScopedLoraRow::ScopedLoraRow(size_t row) : previous_uniform_(active_loras), previous_rows_(active_rows) {
  if (active_rows == nullptr) return;
  TORCH_CHECK(row < active_rows->size(), "LoRA: row ", row, " of a batch of ", active_rows->size());
  const LoraScales* scales = (*active_rows)[row];
  active_loras = scales->empty() ? nullptr : scales;
  active_rows = nullptr;
}

ScopedLoraRow::~ScopedLoraRow() {
  active_loras = previous_uniform_;
  active_rows = previous_rows_;
}

bool AnyLoraActive(const std::map<std::string, LoraWeights>& attached) {
  if (attached.empty()) return false;
  std::vector<std::string> names;
  if (active_loras != nullptr) CollectActive(attached, *active_loras, &names);
  if (active_rows != nullptr) {
    for (const LoraScales* row : *active_rows) CollectActive(attached, *row, &names);
  }
  return !names.empty();
}

at::Tensor LoraDelta(const std::map<std::string, LoraWeights>& attached, const at::Tensor& x, LoraPack* pack) {
  if (attached.empty()) return at::Tensor();
  if (active_rows != nullptr) return RowsDelta(attached, *active_rows, x, pack);
  const LoraScales* active = active_loras;
  if (active == nullptr) return at::Tensor();
  at::Tensor delta;
  for (const auto& [name, scale] : *active) {
    if (scale == 0.0f) continue;
    auto it = attached.find(name);
    if (it == attached.end()) continue;
    const LoraWeights& w = it->second;
    const at::Tensor d = Delta(w, x) * static_cast<double>(scale * w.factor);
    delta = delta.defined() ? delta + d : d;
  }
  return delta;
}

at::Tensor AddLoraDelta(const std::map<std::string, LoraWeights>& attached, const at::Tensor& x, at::Tensor y,
                        LoraPack* pack) {
  if (pack == nullptr || attached.empty() || y.dim() < 1 || y.size(0) != x.size(0)) {
    const at::Tensor delta = LoraDelta(attached, x, pack);
    return delta.defined() ? y + delta : y;
  }
  // Into y: the up-projection's GEMM adds to y itself (beta 1), no delta tensor. y viewed as
  // [tokens, out] (a view when y's strides allow, e.g. a column slice of a shared GEMM's output).
  const int64_t out = y.size(-1);
  at::Tensor y2d = y.reshape({-1, out});
  const bool aliased = y2d.is_alias_of(y);
  auto flat = [](const at::Tensor& t) { return t.reshape({-1, t.size(-1)}); };
  bool added = false;
  if (active_rows != nullptr) {
    const std::vector<std::string> names = RowsActive(attached, *active_rows);
    if (names.empty()) return y;
    const int64_t repeat = RowRepeat(*active_rows, x);
    // (The hidden product first: it builds the pack the up-projection reads.)
    const at::Tensor hidden = PackedRowsHidden(attached, *active_rows, names, x, repeat, *pack);
    if (x.size(0) == 1 && active_rows->size() > 1) {
      // One input row for the whole batch: the delta has a row per request; y broadcasts to it.
      return y + at::linear(hidden, pack->up);
    }
    y2d.addmm_(flat(hidden), pack->up.t());
    added = true;
  } else if (active_loras != nullptr) {
    for (const auto& [name, scale] : *active_loras) {
      if (scale == 0.0f) continue;
      auto it = attached.find(name);
      if (it == attached.end()) continue;
      const LoraWeights& w = it->second;
      const at::Tensor h = at::linear(x, w.A().to(x.device(), x.scalar_type()));
      // The scale multiplies the float32 accumulator (alpha), not a rounded delta.
      y2d.addmm_(flat(h), w.B().to(x.device(), x.scalar_type()).t(), 1, static_cast<double>(scale * w.factor));
      added = true;
    }
  }
  if (!added || aliased) return y;
  return y2d.view(y.sizes());
}

LoraAdapterModule MakeLoraAdapterModule(const std::vector<std::pair<std::string, const LoraWeights*>>& layers,
                                        const std::vector<at::ScalarType>& dtypes) {
  TORCH_CHECK(layers.size() == dtypes.size(), "LoRA adapter module: a dtype per layer");
  LoraAdapterModule out;
  out.module = std::make_unique<Module>(kLoraAdapterKind);
  std::vector<std::pair<int, int>> indices;
  for (size_t i = 0; i < layers.size(); ++i) {
    const LoraWeights& w = *layers[i].second;
    const int a = out.module->AddParameter(absl::StrCat(layers[i].first, ".lora_A"),
                                           w.A().to(at::kCPU, dtypes[i]).contiguous());
    const int b = out.module->AddParameter(absl::StrCat(layers[i].first, ".lora_B"),
                                           w.B().to(at::kCPU, dtypes[i]).contiguous());
    indices.emplace_back(a, b);
  }
  // Slot addresses only once every slot exists (the vector no longer grows).
  for (size_t i = 0; i < layers.size(); ++i) {
    LoraWeights placed;
    placed.factor = layers[i].second->factor;
    placed.down_slot = &out.module->slots()[static_cast<size_t>(indices[i].first)];
    placed.up_slot = &out.module->slots()[static_cast<size_t>(indices[i].second)];
    out.weights.push_back(placed);
  }
  return out;
}

absl::StatusOr<LoraFile> ReadLoraFile(const std::string& path, const std::string& default_component, float alpha) {
  ASSIGN_OR_RETURN(std::shared_ptr<SafetensorsFile> file, SafetensorsFile::Open(path));
  const std::string where = absl::StrCat("LoRA file '", Truncated(path, 200), "'");
  // (component, layer path) → the layer's A, B and alpha.
  struct Parts {
    at::Tensor a, b;
    float alpha = 0.0f;
  };
  std::map<std::pair<std::string, std::string>, Parts> parts;
  int kohya_keys = 0, dotted_keys = 0;
  for (const auto& [key, info] : file->tensors()) {
    absl::string_view rest = key;
    std::string component = default_component;
    bool kohya = false;
    // Kohya's prefixes name the component; the path after them is underscored.
    for (const auto& [prefix, name] : std::vector<std::pair<const char*, const char*>>{
             {"lora_unet_", "transformer"}, {"lora_te1_", "text_encoder"}, {"lora_te2_", "text_encoder_2"},
             {"lora_te_", "text_encoder"}}) {
      if (absl::ConsumePrefix(&rest, prefix)) {
        component = name;
        kohya = true;
        break;
      }
    }
    if (!kohya) {
      absl::ConsumePrefix(&rest, "base_model.model.");
      for (const char* prefix : {"transformer.", "text_encoder.", "text_encoder_2.", "unet.", "diffusion_model."}) {
        if (absl::ConsumePrefix(&rest, prefix)) {
          component = std::string(prefix, std::strlen(prefix) - 1);
          if (component == "unet" || component == "diffusion_model") component = "transformer";
          break;
        }
      }
    }
    enum { kA, kB, kAlpha } kind;
    if (absl::ConsumeSuffix(&rest, ".lora_A.weight") || absl::ConsumeSuffix(&rest, ".lora_A.default.weight") ||
        absl::ConsumeSuffix(&rest, ".lora_down.weight")) {
      kind = kA;
    } else if (absl::ConsumeSuffix(&rest, ".lora_B.weight") || absl::ConsumeSuffix(&rest, ".lora_B.default.weight") ||
               absl::ConsumeSuffix(&rest, ".lora_up.weight")) {
      kind = kB;
    } else if (absl::ConsumeSuffix(&rest, ".alpha")) {
      kind = kAlpha;
    } else {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", Truncated(key),
                                                     "' is not a LoRA tensor (<layer>.lora_A.weight, "
                                                     "<layer>.lora_B.weight, kohya's <layer>.lora_down.weight / "
                                                     ".lora_up.weight, or <layer>.alpha)"));
    }
    (kohya ? kohya_keys : dotted_keys) += 1;
    if (kohya_keys > 0 && dotted_keys > 0) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": mixes kohya keys (lora_unet_..., lora_te_...) with "
                                                     "PEFT / diffusers keys (at '", Truncated(key), "')"));
    }
    if (rest.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", Truncated(key), "' names no layer"));
    ASSIGN_OR_RETURN(at::Tensor t, file->Get(key));
    if (!at::isFloatingType(t.scalar_type())) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", Truncated(key), "' is ",
                                                     c10::toString(t.scalar_type()), "; LoRA tensors are floating point"));
    }
    t = t.to(at::kFloat).clone();
    if (!at::isfinite(t).all().item<bool>()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", Truncated(key), "' holds NaN or infinity"));
    }
    Parts& p = parts[{component, std::string(rest)}];
    if (kind == kAlpha) {
      if (t.numel() != 1) return absl::InvalidArgumentError(absl::StrCat(where, ": '", Truncated(key), "' is not a scalar"));
      p.alpha = t.item<float>();
    } else {
      if (t.dim() != 2) {
        return absl::InvalidArgumentError(absl::StrCat(where, ": tensor '", Truncated(key), "' has ", t.dim(),
                                                       " dimensions; LoRA matrices have 2"));
      }
      (kind == kA ? p.a : p.b) = t;
    }
  }
  LoraFile out;
  out.underscored_paths = kohya_keys > 0;
  for (auto& [id, p] : parts) {
    const std::string layer = absl::StrCat(id.first, ".", id.second);
    if (!p.a.defined() || !p.b.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": layer '", Truncated(layer, 120), "' has lora_",
                                                     p.a.defined() ? "A but no lora_B" : "B but no lora_A"));
    }
    const int64_t rank = p.a.size(0);
    if (p.b.size(1) != rank) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": layer '", Truncated(layer, 120), "': lora_A has rank ",
                                                     rank, ", lora_B ", p.b.size(1)));
    }
    if (rank < 1 || rank > kMaxLoraRank) {
      return absl::InvalidArgumentError(absl::StrCat(where, ": layer '", Truncated(layer, 120), "': rank ", rank,
                                                     " is out of range; allowed: 1..", kMaxLoraRank));
    }
    LoraWeights w;
    w.down = std::move(p.a);
    w.up = std::move(p.b);
    const float a = p.alpha > 0 ? p.alpha : alpha;
    w.factor = a > 0 ? a / static_cast<float>(rank) : 1.0f;
    out.rank = std::max(out.rank, rank);
    out.bytes += w.bytes();
    out.layers[id.first][id.second] = std::move(w);
  }
  if (out.layers.empty()) return absl::InvalidArgumentError(absl::StrCat(where, ": holds no LoRA layers"));
  return out;
}

absl::Status ResolveLayerPaths(LoraFile& file, const std::map<std::string, std::vector<std::string>>& linear_paths) {
  if (!file.underscored_paths) return absl::OkStatus();
  std::map<std::string, std::map<std::string, LoraWeights>> resolved;
  for (auto& [component, layers] : file.layers) {
    std::map<std::string, std::string> by_underscored;  // "layers_0_attention_to_q" → "layers.0.attention.to_q"
    std::map<std::string, std::string> clashes;
    auto it = linear_paths.find(component);
    if (it != linear_paths.end()) {
      for (const std::string& path : it->second) {
        std::string flat = path;
        std::replace(flat.begin(), flat.end(), '.', '_');
        auto [existing, inserted] = by_underscored.emplace(flat, path);
        if (!inserted) clashes[flat] = existing->second + "' and '" + path;
      }
    }
    for (auto& [name, weights] : layers) {
      if (auto clash = clashes.find(name); clash != clashes.end()) {
        return absl::InvalidArgumentError(absl::StrCat("the adapter's kohya layer '", component, ".", Truncated(name, 160),
                                                       "' could be '", clash->second, "'"));
      }
      auto found = by_underscored.find(name);
      if (found == by_underscored.end()) {
        return absl::InvalidArgumentError(absl::StrCat("the adapter's kohya layer '", component, ".", Truncated(name, 160),
                                                       "' matches no Linear layer of the pipeline's ", component));
      }
      resolved[component][found->second] = std::move(weights);
    }
  }
  file.layers = std::move(resolved);
  file.underscored_paths = false;
  return absl::OkStatus();
}

}  // namespace stowage
