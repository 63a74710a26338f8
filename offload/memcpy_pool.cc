#include "offload/memcpy_pool.h"

#include <algorithm>
#include <cstring>

namespace stowage {

MemcpyPool::MemcpyPool(int threads) {
  for (int i = 0; i < threads; ++i) workers_.emplace_back([this, i] { Loop(i); });
}

MemcpyPool::~MemcpyPool() {
  {
    absl::MutexLock lock(&mu_);
    stop_ = true;
    ++generation_;
  }
  work_cv_.SignalAll();
  for (std::thread& t : workers_) t.join();
}

void MemcpyPool::Copy(uint8_t* dst, const uint8_t* src, int64_t n) {
  constexpr int64_t kMinSlice = int64_t{1} << 20;
  const int parts = static_cast<int>(
      std::min<int64_t>(static_cast<int64_t>(workers_.size()) + 1, std::max<int64_t>(1, n / kMinSlice)));
  if (parts <= 1) {
    std::memcpy(dst, src, static_cast<size_t>(n));
    return;
  }
  const int64_t slice = (n + parts - 1) / parts;
  {
    absl::MutexLock lock(&mu_);
    dst_ = dst;
    src_ = src;
    n_ = n;
    slice_ = slice;
    active_ = parts - 1;  // Workers 0..parts-2 take slices 1..parts-1; the caller takes slice 0.
    pending_ = parts - 1;
    ++generation_;
  }
  work_cv_.SignalAll();
  std::memcpy(dst, src, static_cast<size_t>(std::min(slice, n)));
  absl::MutexLock lock(&mu_);
  while (pending_ != 0) done_cv_.Wait(&mu_);
}

void MemcpyPool::Loop(int index) {
  uint64_t seen = 0;
  for (;;) {
    uint8_t* dst;
    const uint8_t* src;
    int64_t begin, end;
    {
      absl::MutexLock lock(&mu_);
      while (generation_ == seen) work_cv_.Wait(&mu_);
      seen = generation_;
      if (stop_) return;
      if (index >= active_) continue;
      begin = (index + 1) * slice_;
      end = std::min(n_, begin + slice_);
      dst = dst_;
      src = src_;
    }
    if (begin < end) std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin));
    absl::MutexLock lock(&mu_);
    if (--pending_ == 0) done_cv_.SignalAll();
  }
}

}  // namespace stowage
