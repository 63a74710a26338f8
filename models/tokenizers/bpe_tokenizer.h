// Byte-level BPE tokenizer read from a Hugging Face tokenizer.json (the Qwen2 tokenizer Z-Image's
// pipeline uses): added/special tokens split out first, NFC normalisation (utf8proc), the Split
// pre-tokenizer's regex (PCRE2, Unicode properties and lookahead as the tokenizers library uses them),
// GPT-2 byte-to-unicode mapping, then merges by rank. JSON is parsed by protobuf.
//
// Thread-safety: Encode is const and thread-safe after Load.
//
// Untrusted input: tokenizer.json is read under kTokenizerJsonLimits (base/json_limits.h: 128 MiB,
// nesting depth 32) and loaded in time linear in its size (hash-map vocabulary and merges; a word of n
// symbols is merged in O(n log n), models/tokenizers/byte_level_bpe.h). Bounds: at most kMaxVocab vocabulary entries and merges, at
// most kMaxAddedTokens added tokens of at most 256 bytes each (Encode scans them at every position);
// ids are integers in [0, 2^31). Messages name the file and the entry's index or a Truncated()
// name, never more of the file. Encode's regex matching is bounded by PCRE2 match and depth limits.
#ifndef STOWAGE_MODELS_TOKENIZERS_BPE_TOKENIZER_H_
#define STOWAGE_MODELS_TOKENIZERS_BPE_TOKENIZER_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "absl/status/statusor.h"
#include "google/protobuf/struct.pb.h"
#include "models/tokenizers/byte_level_bpe.h"

namespace stowage {

class BpeTokenizer {
 public:
  // Errors name the file and what is missing or unsupported.
  static constexpr int64_t kMaxVocab = int64_t{1} << 22;
  static constexpr int64_t kMaxAddedTokens = 4096;
  static constexpr int64_t kMaxAddedTokenBytes = 256;

  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> Load(const std::string& tokenizer_json);
  // Parses tokenizer.json text (the fuzz target's entry point); `source` names it in errors.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromJsonText(const std::string& text, const std::string& source);
  // The same from a parsed tokenizer.json; `source` names it in errors.
  static absl::StatusOr<std::unique_ptr<BpeTokenizer>> FromJson(const google::protobuf::Struct& json,
                                                                const std::string& source);
  // A byte-level tokenizer with no merges (each UTF-8 byte one token, ids 0-255) and the given
  // special tokens (ids from 256), with Qwen2's pre-tokenizer: for built-in pipelines that must run
  // with nothing downloaded.
  static std::unique_ptr<BpeTokenizer> ByteLevel(const std::vector<std::string>& special_tokens);
  ~BpeTokenizer();

  absl::StatusOr<std::vector<int64_t>> Encode(const std::string& text) const;
  // Id of an added or vocabulary token, e.g. "<|im_end|>".
  absl::StatusOr<int64_t> TokenId(const std::string& token) const;
  size_t vocab_size() const { return vocab_.size(); }
  // The largest id any token (vocabulary or added) maps to; -1 when there are none.
  int64_t max_id() const { return max_id_; }

 private:
  BpeTokenizer() = default;
  absl::Status EncodeWord(const std::string& word, std::vector<int64_t>& out) const;

  std::unordered_map<std::string, int64_t> vocab_;
  BpeMerges merges_;
  std::vector<std::pair<std::string, int64_t>> added_;  // Longest first.
  // The added tokens as a byte trie, so matching them at a position costs at most the longest
  // token's length whatever their number: edge (node << 8 | byte) → child; added_terminal_[node] is
  // the id of the token ending there, or -1. Node 0 is the root.
  std::unordered_map<uint64_t, int32_t> added_edges_;
  std::vector<int64_t> added_terminal_;
  bool nfc_ = false;
  int64_t max_id_ = -1;
  std::unique_ptr<BoundedRegex> regex_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_TOKENIZERS_BPE_TOKENIZER_H_
