// A linear pre-scan of untrusted JSON, run before protobuf's JSON parser: protobuf's JSON → Struct
// parsing takes time quadratic in the nesting depth (and recursion proportional to it), so a
// 100 kB file of '[' can pin a core for minutes. CheckJsonLimits looks at each byte once, tracking
// strings (with escapes) and the depth of objects and arrays, and refuses input that is too large
// or nests too deep before any parser sees it. It does not validate JSON otherwise: the parser does.
//
// Messages name `what` (e.g. a file path) and a byte offset, never the content.
#ifndef STOWAGE_BASE_JSON_LIMITS_H_
#define STOWAGE_BASE_JSON_LIMITS_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace stowage {

struct JsonLimits {
  // Deepest nesting of objects and arrays; the top-level object is depth 1.
  int max_depth = 32;
  // Largest input in bytes.
  int64_t max_bytes = int64_t{16} << 20;
};

// Limits used for the project's JSON inputs (documented here so one place says what is accepted):
// config.json, model_index.json, scheduler_config.json, *.safetensors.index.json: depth 32, 16 MiB
// (real ones nest 3 deep and are a few kB; a large index's weight_map is well under 1 MiB).
inline constexpr JsonLimits kConfigJsonLimits{32, int64_t{16} << 20};
// tokenizer.json: depth 32, 128 MiB (Qwen2's is 7 MB; the largest common ones about 35 MB).
inline constexpr JsonLimits kTokenizerJsonLimits{32, int64_t{128} << 20};
// vocab.json (a BPE vocabulary: one flat object, token → id): depth 1, 64 MiB (CLIP's is 1.6 MB).
inline constexpr JsonLimits kVocabJsonLimits{1, int64_t{64} << 20};
// A safetensors header: depth 8 (real ones nest 3 deep: {name: {"shape": [...]}}), and at most
// 100,000,000 bytes as the reference implementation (MAX_HEADER_SIZE) allows.
inline constexpr JsonLimits kSafetensorsHeaderLimits{8, 100'000'000};

// OK, or INVALID_ARGUMENT "<what>: ..." when `json` is longer than limits.max_bytes or nests deeper
// than limits.max_depth (naming the byte offset where the limit was crossed).
absl::Status CheckJsonLimits(absl::string_view json, const JsonLimits& limits, absl::string_view what);

}  // namespace stowage

#endif  // STOWAGE_BASE_JSON_LIMITS_H_
