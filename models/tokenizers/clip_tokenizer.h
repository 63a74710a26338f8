// CLIP's tokenizer as Flux's pipeline uses it (transformers' CLIPTokenizer on the folder
// tokenizer/: vocab.json and merges.txt): text cleaned and lower-cased, split into words, each word
// byte-level BPE-encoded with the end-of-word suffix "</w>", framed by <|startoftext|> and
// <|endoftext|>, cut and padded to a fixed length as diffusers calls it
// (padding="max_length", truncation=True).
//
// What is matched is transformers 5's CLIPTokenizer (a tokenizers-library pipeline, the same as
// CLIPTokenizerFast in 4.x): the exact texts <|startoftext|> and <|endoftext|> become their ids;
// the rest is normalised (NFC; every run of Unicode White_Space one space; lower case per code point
// with Unicode's full mapping, so U+0130 is "i" + U+0307 and Σ always σ), split with CLIP's pattern
// ('s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+, matches kept, spaces dropped), each word's
// UTF-8 bytes mapped to GPT-2's symbols, "</w>" appended to the last, merged by rank (lowest first,
// each rank's occurrences left to right), and looked up (a symbol missing from vocab.json is
// <|endoftext|>, the unknown token). merges.txt: an optional first line "#version..." is skipped;
// every other line is "a b"; a pair listed twice takes its last rank.
// Knowingly different from transformers 4.x's slow CLIPTokenizer without ftfy (BasicTokenizer): it
// made each CJK ideograph a word of its own, dropped control characters, U+FFFD and NUL, lower-cased
// a final Σ as ς, read at most 48,894 merges and always skipped the first line of merges.txt, and
// turned other spellings of the special tokens (<|ENDOFTEXT|>) into their ids; here those are text.
//
// Thread-safety: Encode is const and thread-safe after Load.
//
// Untrusted input: vocab.json and merges.txt are size-limited and parsed in linear time; errors name
// the file and the entry (line number or a Truncated() token), never more of the file. vocab.json: at
// most 64 MiB, one flat object (base/json_limits.h kVocabJsonLimits), at most 2^22 entries, ids whole
// numbers in [0, 2^31), <|startoftext|> and <|endoftext|> present; merges.txt: at most 64 MiB and
// 2^22 merges, each merge's two symbols and their concatenation in vocab.json (as the tokenizers
// library requires). Encode: max_length at most 65,536; text must be UTF-8; a word of n bytes is
// merged in O(n log n), and words past the cut are not encoded. tests/fuzz/clip_tokenizer_fuzzer
// fuzzes FromText and Encode.
#ifndef STOWAGE_MODELS_TOKENIZERS_CLIP_TOKENIZER_H_
#define STOWAGE_MODELS_TOKENIZERS_CLIP_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stowage {

class ClipTokenizer {
 public:
  // Reads <dir>/vocab.json and <dir>/merges.txt.
  static absl::StatusOr<std::unique_ptr<ClipTokenizer>> Load(const std::string& dir);
  // The same from the two files' contents (Load's parse and checks; the fuzz target's entry point):
  // `source` names the folder in errors ("<source>/vocab.json: ...", "<source>/merges.txt: ...").
  static absl::StatusOr<std::unique_ptr<ClipTokenizer>> FromText(const std::string& vocab_json,
                                                                 const std::string& merges_txt,
                                                                 const std::string& source);
  // No merges: every byte of a word one token ("x" or "x</w>" for a word's last byte), ids 0-511
  // (byte b is b, or 256 + b when it ends a word), <|startoftext|> 512, <|endoftext|> 513, with the
  // same normalisation and split: for built-in pipelines that run with nothing downloaded.
  static std::unique_ptr<ClipTokenizer> ByteLevel();
  ~ClipTokenizer();

  // Exactly max_length ids (2 <= max_length <= 65,536, else INVALID_ARGUMENT naming max_length):
  // <|startoftext|>, the text's tokens cut to max_length - 2, <|endoftext|>, then the pad token
  // (<|endoftext|>) up to max_length. INVALID_ARGUMENT when the text is not UTF-8.
  absl::StatusOr<std::vector<int64_t>> Encode(const std::string& text, int64_t max_length) const;
  int64_t bos_id() const;
  int64_t eos_id() const;
  // The largest id Encode can return.
  int64_t max_id() const;

 private:
  ClipTokenizer();
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_TOKENIZERS_CLIP_TOKENIZER_H_
