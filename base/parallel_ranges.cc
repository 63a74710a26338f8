#include "base/parallel_ranges.h"

#include <sched.h>

#include <algorithm>
#include <exception>
#include <system_error>
#include <thread>
#include <vector>

namespace stowage {

int64_t AllowedCpus() {
  cpu_set_t allowed;
  if (::sched_getaffinity(0, sizeof(allowed), &allowed) == 0) return std::max(1, CPU_COUNT(&allowed));
  return std::max<int64_t>(1, std::thread::hardware_concurrency());
}

void ParallelRanges(int64_t n, int64_t min_per_thread, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  const int64_t threads = std::clamp<int64_t>(n / std::max<int64_t>(min_per_thread, 1), 1, AllowedCpus());
  const int64_t per = (n + threads - 1) / threads;
  // Each range keeps its own error: no lock, and the first range's is the one rethrown.
  std::vector<std::exception_ptr> failures(static_cast<size_t>(threads));
  auto run = [&](int64_t t) {
    const int64_t begin = std::min(n, t * per), end = std::min(n, (t + 1) * per);
    if (begin >= end) return;
    try {
      fn(begin, end);
    } catch (...) {
      failures[static_cast<size_t>(t)] = std::current_exception();
    }
  };
  std::vector<std::thread> workers;
  workers.reserve(static_cast<size_t>(threads - 1));
  for (int64_t t = 1; t < threads; ++t) {
    try {
      workers.emplace_back(run, t);
    } catch (const std::system_error&) {  // No thread to be had: this range on this one.
      run(t);
    }
  }
  run(0);
  for (std::thread& worker : workers) worker.join();
  for (const std::exception_ptr& failed : failures) {
    if (failed) std::rethrow_exception(failed);
  }
}

}  // namespace stowage
