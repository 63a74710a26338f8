// Progress of a pipeline load, for the operator while it runs (ListPipelines' LOADING entries and
// the log): the bytes of weights the load will bring into its components, and those brought so far
// (read from the model's files, converted, or drawn for random weights), then the host copies
// page-locked on the device's worker (placement's pin_host, when it pins). The loader's code adds to
// the running thread's LoadProgress (ScopedLoadProgress); readers read the atomics at any time.
#ifndef STOWAGE_BASE_LOAD_PROGRESS_H_
#define STOWAGE_BASE_LOAD_PROGRESS_H_

#include <atomic>
#include <cstdint>

namespace stowage {

struct LoadProgress {
  std::atomic<int64_t> bytes_total{0};
  std::atomic<int64_t> bytes_read{0};
  std::atomic<int64_t> bytes_pinned{0};
};

// Makes `progress` the running thread's load until destroyed (restoring the one before).
class ScopedLoadProgress {
 public:
  explicit ScopedLoadProgress(LoadProgress* progress);
  ~ScopedLoadProgress();
  ScopedLoadProgress(const ScopedLoadProgress&) = delete;
  ScopedLoadProgress& operator=(const ScopedLoadProgress&) = delete;

 private:
  LoadProgress* previous_;
};

// The running thread's load, or null.
LoadProgress* CurrentLoadProgress();

// Adds to the running thread's load, if any.
void AddLoadBytesTotal(int64_t bytes);
void AddLoadBytesRead(int64_t bytes);
void AddLoadBytesPinned(int64_t bytes);

}  // namespace stowage

#endif  // STOWAGE_BASE_LOAD_PROGRESS_H_
