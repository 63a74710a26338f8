// SpillHeapTensors: moves a module tree's host tensors that live in the process's anonymous memory
// (weights drawn at random, or converted at load — FP8 compute's e4m3 copies) into a file, mapped
// read-only in their place, so that they stop counting in the process's RSS the way weights read
// from a safetensors file do: the page cache holds them (the kernel writes them back and may reclaim
// them), a read maps them again, and ReleaseMappedPages drops them from RSS once copied elsewhere
// (a group-offload store's pinned or compressed copy). Without it such tensors stay in RAM as the
// source of truth beside every other copy: FP8 compute streamed from an int4 copy held its FP8 host
// copies (half the bf16 bytes) beside the int4 copy — 0.84x the bf16 weights above the base.
//
// The file is created under `dir` (a directory on a disk: a tmpfs or ramfs is refused, it would hold
// the file in RAM) with a name of its own and removed at once, then written through its descriptor
// and synced (a full disk shows as an error here, not as a fault later) and mapped: the mapping keeps
// its blocks until the last tensor viewing it is freed, and nothing is left behind whatever ends the
// process. The values are the same bytes (views of the mapping, same dtypes and shapes, contiguous).
//
// Thread-safety: none; for the thread that builds the module, before its HostWeights are captured.
#ifndef STOWAGE_OFFLOAD_HOST_SPILL_H_
#define STOWAGE_OFFLOAD_HOST_SPILL_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "offload/module.h"

namespace stowage {

struct SpillStats {
  int64_t tensors = 0;  // Slots now viewing the mapping.
  int64_t bytes = 0;    // Their bytes (tensors sharing memory counted once).
};

// Every defined CPU tensor in a slot of `root`'s tree whose memory is not in a live safetensors
// mapping and is at least `min_bytes` long is written to one file under `dir` and its slot pointed at
// the mapped copy. Slots viewing the same memory keep sharing it. `label` names the file (letters,
// digits, '-', '_', '.'; others become '_'). Nothing to spill: OK with zero stats, no file.
// Errors, with nothing changed: INVALID_ARGUMENT for an empty `dir`; FAILED_PRECONDITION when `dir`
// is not a writable directory, is on a tmpfs or ramfs, or refuses a new file; RESOURCE_EXHAUSTED when
// the file cannot be written whole and synced (disk full, I/O error); each names the directory or file.
absl::StatusOr<SpillStats> SpillHeapTensors(Module& root, const std::string& dir, absl::string_view label,
                                            int64_t min_bytes = 4096);

// True when `dir` is on a tmpfs or ramfs (its files live in RAM: spilling there saves nothing); false
// for a disk, or when it cannot be asked.
bool OnRamFilesystem(const std::string& dir);

}  // namespace stowage

#endif  // STOWAGE_OFFLOAD_HOST_SPILL_H_
