#include "base/load_progress.h"

namespace stowage {
namespace {
thread_local LoadProgress* current = nullptr;
}  // namespace

ScopedLoadProgress::ScopedLoadProgress(LoadProgress* progress) : previous_(current) { current = progress; }
ScopedLoadProgress::~ScopedLoadProgress() { current = previous_; }

LoadProgress* CurrentLoadProgress() { return current; }

void AddLoadBytesTotal(int64_t bytes) {
  if (current != nullptr) current->bytes_total.fetch_add(bytes);
}

void AddLoadBytesRead(int64_t bytes) {
  if (current != nullptr) current->bytes_read.fetch_add(bytes);
}

void AddLoadBytesPinned(int64_t bytes) {
  if (current != nullptr) current->bytes_pinned.fetch_add(bytes);
}

}  // namespace stowage
