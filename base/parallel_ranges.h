// ParallelRanges: [0, n) split into contiguous ranges run on threads of our own, one per CPU this
// process may use (its affinity, not the machine's), for host loops over weights at load. Not
// at::parallel_for: compiled into our objects without OpenMP, that one never forks.
//
// `min_per_thread` (>= 1): units below which another thread costs more than it saves. Where the host
// refuses a thread, the calling thread runs that range too. An exception thrown by `fn` in any range
// is rethrown on the calling thread once every thread has stopped (the first range's first).
// Thread-safety: `fn` runs concurrently on disjoint ranges.
//
//   ParallelRanges(rows, 64, [&](int64_t begin, int64_t end) { Convert(begin, end); });
#ifndef STOWAGE_BASE_PARALLEL_RANGES_H_
#define STOWAGE_BASE_PARALLEL_RANGES_H_

#include <cstdint>
#include <functional>

namespace stowage {

// CPUs this process may run on (sched_getaffinity; the hardware's count where it cannot be asked).
int64_t AllowedCpus();

void ParallelRanges(int64_t n, int64_t min_per_thread, const std::function<void(int64_t begin, int64_t end)>& fn);

}  // namespace stowage

#endif  // STOWAGE_BASE_PARALLEL_RANGES_H_
