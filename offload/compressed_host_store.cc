#include "offload/compressed_host_store.h"

#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "offload/load_quantizer.h"
#include "offload/safetensors.h"

namespace stowage {
namespace {

int DtypeSlot(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 1 : dtype == at::kHalf ? 2 : 0; }

struct FixedLayout {
  bool has[3] = {false, false, false};
  int64_t max_numel = 0;
};

FixedLayout ScanCompressible(CompressFormat format, HostWeights& weights) {
  FixedLayout layout;
  for (const HostWeights::Entry& e : weights.entries()) {
    if (!IsCompressible(format, e.host.scalar_type(), e.host.sizes())) continue;
    layout.has[DtypeSlot(e.host.scalar_type())] = true;
    layout.max_numel = std::max(layout.max_numel, e.host.numel());
  }
  return layout;
}

absl::StatusOr<QuantizedTensor> CheckPrequantized(const std::string& name, const QuantizedTensor& given,
                                                  const at::Tensor& host, CompressFormat format) {
  const QuantLayout layout = LayoutOf(format, host.sizes());
  if (!given.q.defined() || given.q.scalar_type() != layout.q_dtype ||
      given.q.numel() != layout.q_bytes || !given.scale.defined() || given.scale.numel() != layout.scale_count) {
    return absl::InvalidArgumentError(absl::StrCat(
        "compressed weight '", name, "' does not match its tensor: want ", CompressFormatName(format), " of ",
        layout.q_bytes, " values and ", layout.scale_count, " scales"));
  }
  return QuantizedTensor{given.q.contiguous(), given.scale.to(layout.scale_dtype).contiguous()};
}

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Zeroes the bytes of [0, size) outside `spans` ({offset, bytes}, disjoint): a packed group's
// alignment padding, so the device sees deterministic bytes without the whole buffer being written
// twice.
void ZeroGaps(uint8_t* base, int64_t size, std::vector<std::pair<int64_t, int64_t>> spans) {
  std::sort(spans.begin(), spans.end());
  int64_t at = 0;
  for (const auto& [offset, bytes] : spans) {
    if (offset > at) std::memset(base + at, 0, static_cast<size_t>(offset - at));
    at = std::max(at, offset + bytes);
  }
  if (size > at) std::memset(base + at, 0, static_cast<size_t>(size - at));
}

}  // namespace

StoreScratch CompressedHostStore::PlanScratch(CompressFormat format, HostWeights& weights) {
  StoreScratch scratch;
  for (const HostWeights::Entry& e : weights.entries()) {
    // A compressed tensor's q and scale; another tensor lands there too in a group with compressed ones.
    const int64_t compressed = TensorScratchBytes(format, e.host.scalar_type(), e.host.sizes());
    scratch.tensor_bytes.push_back(compressed);
    scratch.carried_bytes.push_back(compressed > 0 ? 0 : AlignScratch(static_cast<int64_t>(e.host.nbytes())));
  }
  const FixedLayout layout = ScanCompressible(format, weights);
  scratch.fixed_bytes = FixedScratchBytes(format, layout.has[0], layout.has[1], layout.has[2], layout.max_numel);
  return scratch;
}

absl::StatusOr<std::unique_ptr<HostStore>> CompressedHostStore::Create(const HostStoreOptions& options,
                                                                       const std::vector<PlannedGroup>& groups,
                                                                       HostWeights& weights,
                                                                       DeviceBackend& backend) {
  const CompressFormat format = options.compress;
  if (format == CompressFormat::kNone) return absl::InvalidArgumentError("compressed store without a format");
  if (options.scratch_buffers != 1 && options.scratch_buffers != 2) {
    return absl::InvalidArgumentError(
        absl::StrCat("compressed store: scratch_buffers must be 1 or 2, not ", options.scratch_buffers));
  }
  RETURN_IF_ERROR(weights.CheckSourceFiles());
  std::unique_ptr<CompressedHostStore> store(
      new CompressedHostStore(backend, format, ResolveGroups(groups, weights)));
  store->areas_ = options.scratch_buffers;
  store->widen_per_group_ = options.widen_per_group;

  // The fixed part of the scratch: fp8 tables per compute dtype present, then the index chunk; or
  // int4's nibble buffer, then the fp32 table of its scale codes (both the portable path's; CUDA's
  // kernel reads neither).
  const FixedLayout fixed = ScanCompressible(format, weights);
  store->fixed_bytes_ = FixedScratchBytes(format, fixed.has[0], fixed.has[1], fixed.has[2], fixed.max_numel);
  if (format == CompressFormat::kInt4 && store->fixed_bytes_ > 0) {
    store->nibble_bytes_ = Int4TableOffset(fixed.max_numel);
    store->table_offset_[0] = store->nibble_bytes_;
    store->tables_at_ = store->nibble_bytes_;
    const at::Tensor table = Fp8E4M3Table(at::kFloat);
    ASSIGN_OR_RETURN(store->tables_, backend.AllocatePinnedHost(static_cast<int64_t>(table.nbytes())));
    store->tables_.copy_(BytesOf(table));
  }
  if (store->fixed_bytes_ > 0 && format == CompressFormat::kFp8E4M3) {
    int64_t offset = 0;
    const at::ScalarType dtypes[3] = {at::kFloat, at::kBFloat16, at::kHalf};
    std::vector<at::Tensor> tables;
    for (int d = 0; d < 3; ++d) {
      if (!fixed.has[d]) continue;
      store->table_offset_[d] = offset;
      at::Tensor table = Fp8E4M3Table(dtypes[d]);
      const auto bytes = static_cast<int64_t>(table.nbytes());
      tables.push_back(at::cat({BytesOf(table), at::zeros({AlignScratch(bytes) - bytes}, at::kByte)}));
      offset += AlignScratch(bytes);
    }
    store->index_offset_ = offset;
    store->index_elements_ = std::min(fixed.max_numel, kFp8DecodeChunkElements);
    ASSIGN_OR_RETURN(store->tables_, backend.AllocatePinnedHost(offset));
    store->tables_.copy_(at::cat(tables));
  }

  // Deferred FP8 weights (HostWeights::deferred): a compressed weight whose FP8 scales are carried in
  // the same packed group is made from its source in one pass (LoadQuantizer::QuantizeFp8Into: the
  // codes' compressed copy and the scales' bytes), its host copy never written. Every other unwritten
  // host copy this store reads (resident groups, carried or prequantized weights) is written first.
  std::map<const HostWeights::Entry*, const HostWeights::Entry*> one_pass;  // Codes -> scales.
  for (const StoreGroup& g : store->groups_) {
    for (const StoreTensor& t : g.tensors) {
      const HostWeights::Entry& e = *t.entry;
      if (!weights.unwritten(e) || g.resident || options.compress != CompressFormat::kInt4) continue;
      const HostWeights::Deferred& d = weights.deferred()[static_cast<size_t>(e.deferred)];
      const HostWeights::Entry* codes = &weights.entries()[d.codes];
      const HostWeights::Entry* scales = &weights.entries()[d.scales];
      if (&e != codes || !IsCompressible(format, e.host.scalar_type(), e.host.sizes())) continue;
      const std::string name = e.module->SlotPath(*e.slot);
      if (options.prequantized != nullptr && options.prequantized->count(name) > 0) continue;
      const bool scales_here = std::any_of(g.tensors.begin(), g.tensors.end(), [&](const StoreTensor& other) {
        return other.entry == scales;
      });
      if (scales_here && !IsCompressible(format, scales->host.scalar_type(), scales->host.sizes())) {
        one_pass.emplace(codes, scales);
      }
    }
  }
  std::set<const HostWeights::Entry*> made_by_quantizer;  // The scales of one_pass.
  for (const auto& [codes, scales] : one_pass) made_by_quantizer.insert(scales);
  for (const StoreGroup& g : store->groups_) {
    for (const StoreTensor& t : g.tensors) {
      if (one_pass.count(t.entry) == 0 && made_by_quantizer.count(t.entry) == 0) weights.Materialize(*t.entry);
    }
  }

  // Pass 1, the layouts: per group the compressed part first (the scratch's image), then the other
  // tensors.
  int64_t largest = 0;
  std::vector<size_t> packed_groups;  // The groups that get a pinned buffer, in order.
  for (size_t gi = 0; gi < store->groups_.size(); ++gi) {
    StoreGroup& g = store->groups_[gi];
    if (g.resident) continue;
    Group8& g8 = store->groups8_[gi];
    int64_t compressed = 0;
    for (const StoreTensor& t : g.tensors) {
      const at::Tensor& host = t.entry->host;
      Tensor8 t8;
      t8.slot_offset = t.offset;
      t8.bytes = static_cast<int64_t>(host.nbytes());
      t8.dtype = host.scalar_type();
      t8.sizes = host.sizes().vec();
      t8.compressed = IsCompressible(format, host.scalar_type(), host.sizes());
      if (t8.compressed) {
        t8.layout = LayoutOf(format, host.sizes());
        t8.q_offset = compressed;
        compressed += AlignScratch(t8.layout.q_bytes);
        t8.scale_offset = compressed;
        compressed += AlignScratch(t8.layout.scale_bytes());
      }
      g8.tensors.push_back(std::move(t8));
    }
    g8.compressed_bytes = compressed;
    g8.packed_bytes = compressed;
    // The other tensors: as one run when the slot holds them one after another with no compressed
    // tensor among them (the planner puts them after the compressed ones, CompressedFirst), laid out
    // as in the slot, so that one DMA and one device copy carry them all; else each on its own.
    int64_t run_begin = -1, run_end = -1;
    for (const Tensor8& t8 : g8.tensors) {
      if (t8.compressed) continue;
      run_begin = run_begin < 0 ? t8.slot_offset : std::min(run_begin, t8.slot_offset);
      run_end = std::max(run_end, t8.slot_offset + t8.bytes);
    }
    const bool run = run_begin >= 0 && std::none_of(g8.tensors.begin(), g8.tensors.end(), [&](const Tensor8& t8) {
      return t8.compressed && t8.slot_offset < run_end && t8.slot_offset + t8.bytes > run_begin;
    });
    if (run) {
      g8.others_slot_offset = run_begin;
      g8.others_bytes = run_end - run_begin;
      for (Tensor8& t8 : g8.tensors) {
        if (!t8.compressed) t8.host_offset = compressed + (t8.slot_offset - run_begin);
      }
      g8.packed_bytes += AlignScratch(g8.others_bytes);
      g8.link_bytes = compressed + g8.others_bytes;
    } else {
      g8.link_bytes = compressed;
      for (Tensor8& t8 : g8.tensors) {
        if (t8.compressed) continue;
        t8.host_offset = g8.packed_bytes;
        g8.packed_bytes += AlignScratch(t8.bytes);
        g8.link_bytes += t8.bytes;
      }
    }
    // A group with compressed weights lands whole in a scratch area; one without is copied straight
    // into its slot and needs none.
    if (compressed > 0) largest = std::max(largest, g8.packed_bytes);
    store->stats_.bytes_per_forward += g8.link_bytes;
    packed_groups.push_back(gi);
  }

  // Pass 2, the bytes: each group's pinned buffer filled (quantized on the GPU when there is one),
  // the next group's buffer allocated meanwhile on a thread of its own (pinning goes page by page).
  std::unique_ptr<LoadQuantizer> quantizer;  // Made when the first weight needs quantizing.
  constexpr int64_t kTrimEvery = int64_t{64} << 20;
  int64_t temporaries = 0;  // Bytes of quantized copies freed since the last malloc_trim.
  std::future<TimedAllocation> next;
  if (!packed_groups.empty()) next = AllocatePinnedAhead(backend, store->groups8_[packed_groups[0]].packed_bytes);
  for (size_t n = 0; n < packed_groups.size(); ++n) {
    const size_t gi = packed_groups[n];
    StoreGroup& g = store->groups_[gi];
    Group8& g8 = store->groups8_[gi];
    TimedAllocation allocated = next.get();
    store->stats_.prepare_pin_alloc_s += allocated.seconds;
    if (n + 1 < packed_groups.size()) {
      next = AllocatePinnedAhead(backend, store->groups8_[packed_groups[n + 1]].packed_bytes);
    }
    RETURN_IF_ERROR(allocated.buffer.status());
    g8.packed = *std::move(allocated.buffer);
    store->stats_.compressed_host_bytes += g8.packed_bytes;
    store->stats_.pinned_host_bytes += g8.packed_bytes;
    uint8_t* base = g8.packed.data_ptr<uint8_t>();
    std::vector<std::pair<int64_t, int64_t>> written;
    for (size_t i = 0; i < g.tensors.size(); ++i) {
      const at::Tensor& host = g.tensors[i].entry->host;
      const Tensor8& t8 = g8.tensors[i];
      if (t8.compressed) {
        written.emplace_back(t8.q_offset, t8.layout.q_bytes);
        written.emplace_back(t8.scale_offset, t8.layout.scale_bytes());
        const std::string name = g.tensors[i].entry->module->SlotPath(*g.tensors[i].entry->slot);
        const auto given = options.prequantized != nullptr ? options.prequantized->find(name)
                                                           : PrequantizedWeights::const_iterator();
        if (options.prequantized != nullptr && given != options.prequantized->end()) {
          ASSIGN_OR_RETURN(const QuantizedTensor q, CheckPrequantized(name, given->second, host, format));
          std::memcpy(base + t8.q_offset, q.q.data_ptr(), q.q.nbytes());
          std::memcpy(base + t8.scale_offset, q.scale.data_ptr(), q.scale.nbytes());
          temporaries += t8.layout.q_bytes + t8.layout.scale_bytes();
        } else {
          if (quantizer == nullptr) {
            ASSIGN_OR_RETURN(quantizer, LoadQuantizer::Create(backend, fixed.max_numel, options.staging_threads,
                                                              options.quantize_chunk_elements));
          }
          // On the GPU when there is one, straight into the pinned group; in flight until Finish().
          const auto start = std::chrono::steady_clock::now();
          const at::Tensor q_out = g8.packed.narrow(0, t8.q_offset, t8.layout.q_bytes);
          const at::Tensor scale_out = g8.packed.narrow(0, t8.scale_offset, t8.layout.scale_bytes());
          bool on_host = false;
          const auto deferred = one_pass.find(g.tensors[i].entry);
          if (deferred != one_pass.end()) {
            // The FP8 scales' place in this group (carried: their Tensor8 is in the same group).
            int64_t fp8_scales_at = -1;
            for (size_t j = 0; j < g.tensors.size(); ++j) {
              if (g.tensors[j].entry == deferred->second) fp8_scales_at = g8.tensors[j].host_offset;
            }
            const HostWeights::Deferred& d = weights.deferred()[static_cast<size_t>(g.tensors[i].entry->deferred)];
            on_host = quantizer->QuantizeFp8Into(
                d.source, format, q_out, scale_out,
                g8.packed.narrow(0, fp8_scales_at, static_cast<int64_t>(deferred->second->host.nbytes())));
            ++store->stats_.one_pass_fp8_weights;
          } else {
            on_host = quantizer->QuantizeInto(host, format, q_out, scale_out);
          }
          store->stats_.prepare_quantize_s += SecondsSince(start);
          // Only the host path leaves heap temporaries to trim (malloc_trim walks the whole heap).
          if (on_host) temporaries += t8.layout.q_bytes + t8.layout.scale_bytes();
        }
      } else {
        written.emplace_back(t8.host_offset, t8.bytes);
        // A deferred weight's FP8 scales are written by the quantizer with its codes (above: they
        // come first in the group).
        if (made_by_quantizer.count(g.tensors[i].entry) == 0) {
          std::memcpy(base + t8.host_offset, host.data_ptr(), host.nbytes());
        }
      }
      // The source has been read (the quantizer's writes may still be in flight, its reads are not).
      store->stats_.mapped_bytes_released +=
          ReleaseMappedPages(host.data_ptr(), static_cast<int64_t>(host.nbytes()));
    }
    ZeroGaps(base, g8.packed_bytes, std::move(written));  // Padding: deterministic bytes on the device.
    if (temporaries >= kTrimEvery) {  // Give the quantization temporaries' heap pages back as they go.
      ::malloc_trim(0);
      temporaries = 0;
    }
  }
  if (quantizer != nullptr) {
    const auto start = std::chrono::steady_clock::now();
    quantizer->Finish();
    store->stats_.prepare_quantize_s += SecondsSince(start);
    store->stats_.host_quantized_fallbacks = quantizer->host_fallbacks();
  }
  store->area_bytes_ = largest;
  store->scratch_bytes_ = largest > 0 ? store->fixed_bytes_ + store->areas_ * largest : 0;
  ::malloc_trim(0);  // Quantization temporaries.
  return std::unique_ptr<HostStore>(std::move(store));
}

CompressedHostStore::~CompressedHostStore() { backend_->Synchronize(); }

void CompressedHostStore::InitScratch(const at::Tensor& scratch) {
  if (!tables_.defined() || scratch_bytes_ == 0) return;
  backend_->CopyToDeviceAsync(scratch.narrow(0, tables_at_, tables_.numel()), tables_);
}

WidenScratch CompressedHostStore::WidenViews(const at::Tensor& scratch) const {
  WidenScratch views;
  if (nibble_bytes_ > 0) {
    views.nibbles = scratch.narrow(0, 0, nibble_bytes_);
    views.table_f32 = scratch.narrow(0, table_offset_[0], 256 * 4).view(at::kFloat);
  }
  if (fixed_bytes_ == 0 || format_ != CompressFormat::kFp8E4M3) return views;
  at::Tensor* tables[3] = {&views.table_f32, &views.table_bf16, &views.table_f16};
  const at::ScalarType dtypes[3] = {at::kFloat, at::kBFloat16, at::kHalf};
  const int64_t sizes[3] = {4, 2, 2};
  for (int d = 0; d < 3; ++d) {
    if (table_offset_[d] < 0) continue;
    *tables[d] = scratch.narrow(0, table_offset_[d], 256 * sizes[d]).view(dtypes[d]);
  }
  views.index = scratch.narrow(0, index_offset_, index_elements_ * 4).view(at::kInt);
  return views;
}

namespace {
// A view of `bytes` at `offset` in `buffer` as `dtype` of `sizes` that does not keep the buffer's memory
// alive (the caller guarantees it is used only while a buffer at that address holds that layout).
at::Tensor Unowned(const at::Tensor& buffer, int64_t offset, at::ScalarType dtype, at::IntArrayRef sizes) {
  return at::from_blob(static_cast<uint8_t*>(buffer.data_ptr()) + offset, sizes,
                       at::TensorOptions().dtype(dtype).device(buffer.device()));
}
}  // namespace

const CompressedHostStore::Group8::ViewSet& CompressedHostStore::ViewsOf(int group, const at::Tensor& slot,
                                                                         const at::Tensor& source) const {
  // The views do not own the memory: a set describes group `group`'s layout at two addresses, which
  // any slot and source buffer at those addresses share (the engine's slots, areas, always-on buffers
  // and device copies of this group are all laid out so), and it is used only with buffers the caller
  // holds. So a set kept past its buffers' release holds no device memory and stays correct.
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  for (const Group8::ViewSet& set : g8.view_sets) {
    if (set.slot == slot.data_ptr() && set.source == source.data_ptr()) return set;
  }
  if (g8.view_sets.size() >= kViewSets) g8.view_sets.clear();
  Group8::ViewSet set;
  set.slot = slot.data_ptr();
  set.source = source.data_ptr();
  set.targets.resize(g8.tensors.size());
  for (size_t i = 0; i < g8.tensors.size(); ++i) {
    const Tensor8& t = g8.tensors[i];
    if (!t.compressed) continue;
    WidenTarget& target = set.targets[i];
    target.out = Unowned(slot, t.slot_offset, t.dtype, t.sizes);
    target.q = Unowned(source, t.q_offset, t.layout.q_dtype, t.layout.q_shape);
    target.scale = Unowned(source, t.scale_offset, t.layout.scale_dtype, {t.layout.scale_count});
  }
  if (g8.others_bytes > 0) {
    set.others_to = Unowned(slot, g8.others_slot_offset, at::kByte, {g8.others_bytes});
    set.others_from = Unowned(source, g8.compressed_bytes, at::kByte, {g8.others_bytes});
  }
  g8.view_sets.push_back(std::move(set));
  return g8.view_sets.back();
}

void CompressedHostStore::Widen(int group, const at::Tensor& slot, const at::Tensor& scratch,
                                const at::Tensor& area) const {
  // On the transform stream's thread: no autograd, and the scratch may be an inference tensor.
  c10::InferenceMode inference;
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  const WidenScratch views = WidenViews(scratch);
  const Group8::ViewSet& set = ViewsOf(group, slot, area);
  if (g8.others_bytes > 0) {  // One run, laid out as in the slot.
    set.others_to.copy_(set.others_from);
  } else {
    for (const Tensor8& t : g8.tensors) {
      if (!t.compressed) slot.narrow(0, t.slot_offset, t.bytes).copy_(area.narrow(0, t.host_offset, t.bytes));
    }
  }
  std::vector<WidenTarget> targets;
  for (size_t i = 0; i < g8.tensors.size(); ++i) {
    if (!g8.tensors[i].compressed) continue;
    if (widen_per_group_) {
      targets.push_back(set.targets[i]);
    } else {
      WidenInto(set.targets[i].out, set.targets[i].q, set.targets[i].scale, format_, views);
    }
  }
  if (!targets.empty()) WidenAllInto(targets, format_, views);  // The group's weights in shared launches.
}

void CompressedHostStore::CopyOthers(int group, const at::Tensor& to) {
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  if (g8.others_bytes > 0) {
    backend_->CopyToDeviceAsync(to.narrow(0, g8.compressed_bytes, g8.others_bytes),
                                g8.packed.narrow(0, g8.compressed_bytes, g8.others_bytes));
    return;
  }
  for (const Tensor8& t : g8.tensors) {  // Each at its offset: the link carries no padding.
    if (t.compressed) continue;
    backend_->CopyToDeviceAsync(to.narrow(0, t.host_offset, t.bytes), g8.packed.narrow(0, t.host_offset, t.bytes));
  }
}

void CompressedHostStore::CopyAndWiden(int group, const at::Tensor& slot, const at::Tensor& scratch,
                                       const at::Tensor& to) {
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  backend_->CopyToDeviceAsync(to.narrow(0, 0, g8.compressed_bytes), g8.packed.narrow(0, 0, g8.compressed_bytes));
  CopyOthers(group, to);
  std::unique_ptr<DeviceEvent> landed = backend_->RecordOnCopyStream();
  backend_->TransformStreamWait(*landed);
  // The tensors are captured by value: the scratch, slot and area stay referenced (and their memory
  // alive) until the work has run.
  backend_->EnqueueOnTransformStream([this, group, slot, scratch, to] { Widen(group, slot, scratch, to); });
}

std::unique_ptr<DeviceEvent> CompressedHostStore::CopyGroupToSlot(int group, const at::Tensor& slot,
                                                                  const at::Tensor& scratch) {
  const auto index = static_cast<size_t>(group);
  const Group8& g8 = groups8_[index];
  if (!g8.packed.defined()) return CopyTensorsDirect(*backend_, groups_[index], slot);  // Resident, exact.
  if (g8.compressed_bytes == 0) {
    // Nothing to widen: the tensors straight into the slot on the copy stream, which the engine made
    // wait for the slot's release (WritesSlotOnTransformStream is false for this group).
    if (g8.others_bytes > 0) {
      backend_->CopyToDeviceAsync(slot.narrow(0, g8.others_slot_offset, g8.others_bytes),
                                  g8.packed.narrow(0, 0, g8.others_bytes));
    } else {
      for (const Tensor8& t : g8.tensors) {
        backend_->CopyToDeviceAsync(slot.narrow(0, t.slot_offset, t.bytes), g8.packed.narrow(0, t.host_offset, t.bytes));
      }
    }
    return backend_->RecordOnCopyStream();
  }
  const int a = next_area_;
  next_area_ = (next_area_ + 1) % areas_;
  // The area's last widening has read it (with one area: the last widening of any group). The copy
  // stream writes only the area: the slot is written on the transform stream, which the engine made
  // wait for the slot's release.
  if (area_free_[a]) backend_->CopyStreamWait(*area_free_[a]);
  const at::Tensor area = scratch.narrow(0, fixed_bytes_ + a * area_bytes_, g8.packed_bytes);
  CopyAndWiden(group, slot, scratch, area);
  area_free_[a] = backend_->RecordOnTransformStream();
  return backend_->RecordOnTransformStream();
}

bool CompressedHostStore::WritesSlotOnTransformStream(int group) const {
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  return g8.packed.defined() && g8.compressed_bytes > 0;
}

int64_t CompressedHostStore::device_copy_bytes(int group) const {
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  return g8.packed.defined() ? static_cast<int64_t>(g8.packed.nbytes()) : 0;
}

int64_t CompressedHostStore::link_bytes(int group) const {
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  return g8.packed.defined() ? g8.link_bytes : 0;
}

std::unique_ptr<DeviceEvent> CompressedHostStore::CopyGroupToSlotVia(int group, const at::Tensor& slot,
                                                                     const at::Tensor& scratch, const at::Tensor& copy,
                                                                     bool fill) {
  const Group8& g8 = groups8_[static_cast<size_t>(group)];
  TORCH_CHECK(g8.packed.defined() && copy.defined() && copy.nbytes() == g8.packed.nbytes(),
              "CopyGroupToSlotVia: group ", group, " has no device copy of ", copy.defined() ? copy.nbytes() : 0,
              " bytes");
  // With `fill` the packed buffer crosses the link once, into the copy; either way the widening waits
  // for the copy stream's order here and for the slot's release (the engine made the transform stream
  // wait for it, or, for a group with nothing compressed, the copy stream before this).
  if (fill && g8.compressed_bytes > 0) {
    CopyAndWiden(group, slot, scratch, copy);  // As CopyGroupToSlot, into the copy.
    return backend_->RecordOnTransformStream();
  }
  if (fill) CopyOthers(group, copy);  // Nothing compressed: the tensors into the copy, then into the slot.
  std::unique_ptr<DeviceEvent> landed = backend_->RecordOnCopyStream();
  backend_->TransformStreamWait(*landed);
  backend_->EnqueueOnTransformStream([this, group, slot, scratch, copy] { Widen(group, slot, scratch, copy); });
  return backend_->RecordOnTransformStream();
}

}  // namespace stowage
