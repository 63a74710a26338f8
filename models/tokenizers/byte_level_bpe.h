// Pieces shared by the byte-level BPE tokenizers (BpeTokenizer: a tokenizer.json such as Qwen2's;
// ClipTokenizer: CLIP's vocab.json and merges.txt): GPT-2's byte-to-unicode table, splitting UTF-8
// into code points, merge ranks with the merge loop, and a PCRE2 pattern run over text with bounded
// work per match.
//
// Thread-safety: every const method is thread-safe.
#ifndef STOWAGE_MODELS_TOKENIZERS_BYTE_LEVEL_BPE_H_
#define STOWAGE_MODELS_TOKENIZERS_BYTE_LEVEL_BPE_H_

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace stowage {

// GPT-2's reversible table: byte b → the UTF-8 of a printable code point (b itself for '!'..'~',
// 0xA1..0xAC and 0xAE..0xFF; 256, 257, ... in byte order for the others).
const std::array<std::string, 256>& ByteToUnicode();

// One string per code point of `s`; a lead byte takes as many bytes as it announces, clipped at the
// end of `s` (byte-mapped text is always well-formed).
std::vector<std::string> SplitUtf8(absl::string_view s);

// BPE merges by rank (lower first).
class BpeMerges {
 public:
  // How a pair listed twice is ranked.
  enum class Repeat { kKeepFirst, kKeepLast };

  // Records the merge of `a` and `b` at `rank`.
  void Add(std::string a, std::string b, int64_t rank, Repeat repeat);
  int64_t size() const { return static_cast<int64_t>(rank_.size()); }
  bool empty() const { return rank_.empty(); }

  // Merges `symbols` in place: the adjacent pair of lowest rank first, every occurrence of it left
  // to right (an occurrence overlapping one just merged is skipped), until no adjacent pair has a
  // rank. The same result as transformers' bpe() loop and the tokenizers library's BPE, in
  // O(n log n) for n symbols (a heap of candidate pairs over a linked list).
  void Apply(std::vector<std::string>& symbols) const;

 private:
  // Rank of (a, b), or -1.
  int64_t Rank(const std::string& a, const std::string& b) const;

  absl::flat_hash_map<std::pair<std::string, std::string>, int64_t> rank_;
};

// A PCRE2 pattern (UTF, Unicode properties) whose matching is bounded per match (match and depth
// limits), so a pattern read from a file cannot backtrack without end.
class BoundedRegex {
 public:
  // INVALID_ARGUMENT "regex does not compile at offset N" when PCRE2 refuses the pattern.
  static absl::StatusOr<std::unique_ptr<BoundedRegex>> Compile(const std::string& pattern);
  ~BoundedRegex();

  // Walks `text` from the start: calls on_piece(piece, true) for each match and on_piece(piece,
  // false) for each stretch of text between matches and after the last one (none are empty), in
  // order. Stops at the first error on_piece returns, and returns it. An empty match skips one code
  // point (which then belongs to the next unmatched stretch). Text PCRE2 rejects (not UTF-8) ends
  // the matching: the rest is one unmatched stretch. INVALID_ARGUMENT when a match exceeds the
  // limits.
  absl::Status Split(absl::string_view text,
                     const std::function<absl::Status(absl::string_view, bool)>& on_piece) const;

 private:
  BoundedRegex() = default;
  void* code_ = nullptr;  // pcre2_code*
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_TOKENIZERS_BYTE_LEVEL_BPE_H_
