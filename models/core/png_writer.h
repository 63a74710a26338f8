// An 8-bit RGB PNG written with zlib, its rows deflated in parallel (no LibTorch here: image.h's
// EncodePng calls it).
//
// The image's rows are cut into strips of kPngStripRows; each strip is filtered (Sub, the filter of
// EncodePng's level-1 setting) and deflated at level 1 on its own — a raw deflate stream ended with a
// sync flush (the last strip: the final block) — on up to `max_threads` threads, and the strips are
// joined into one zlib stream (one header, their Adler-32s combined) in one IDAT chunk. The strip
// boundaries, not the thread count, decide the bytes: the file is the same on every machine and for
// every `max_threads`. A strip starts without the previous strip's history, which costs a few bytes
// per 64 rows.
#ifndef STOWAGE_MODELS_CORE_PNG_WRITER_H_
#define STOWAGE_MODELS_CORE_PNG_WRITER_H_

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace stowage {

inline constexpr int kPngStripRows = 64;

// `rgb`: height rows of width × 3 bytes. `max_threads` ≤ 0: PngWriterThreads(0). INVALID_ARGUMENT
// for a size outside 1..2^31−1 or a buffer too large for one IDAT chunk.
absl::StatusOr<std::string> WriteRgbPng(const uint8_t* rgb, int width, int height, int max_threads = 0);

// The threads WriteRgbPng may use for `max_threads`: itself when positive, else up to 8, bounded by
// the machine's cores (fewer when the image has fewer strips).
int PngWriterThreads(int max_threads);

}  // namespace stowage

#endif  // STOWAGE_MODELS_CORE_PNG_WRITER_H_
