// T5's tokenizer as Flux's pipeline uses it (the folder tokenizer_2/: spiece.model, a SentencePiece
// Unigram model): the text's pieces, then </s>, cut and padded with <pad> to a fixed length as
// diffusers calls it (padding="max_length", truncation=True: the cut keeps </s> last).
//
// The encoder is SentencePiece's own algorithm, written here: the protobuf wire format of
// spiece.model read by hand (the fields the encoder uses), the normaliser (a user-defined symbol
// verbatim, else the longest rule of the precompiled character map, a Darts double array, else one
// UTF-8 character, a malformed byte becoming U+FFFD; leading, trailing and repeated spaces removed;
// the dummy-prefix space; spaces as U+2581), and the optimised Viterbi of unigram_model.cc with its
// float/double arithmetic, a run of unknown pieces being one <unk> (or, with byte_fallback, each byte
// a <0xXX> piece). tests/models/t5_tokenizer_test.cc compares it with libsentencepiece on trained
// models. Debian's libsentencepiece cannot be linked into the server: it bundles protobuf-lite 3.14
// and exports those symbols, which clash with the process's libprotobuf 3.21 (the first use aborts in
// protobuf's version check, or crashes, depending on link order).
//
// Differences from transformers: a prompt that contains the literal text of a special token (</s>,
// <pad>, <unk>, <extra_id_N>) is tokenised as text here, where transformers gives the special id.
// Only Unigram models are read (T5's), and <pad> and </s> must be ids 0 and 1 (T5's layout).
//
// Thread-safety: Encode is const and thread-safe after Load.
//
// Untrusted input: spiece.model is read only if at most 64 MiB, with at most 2^22 pieces of at most
// 256 bytes each; every index into it (pieces, character-map trie and strings) is bounds-checked;
// the normalised text is at most 64 times the text (plus 64 bytes; beyond that Encode is
// INVALID_ARGUMENT naming the file), so Encode is linear in the text (times the longest piece).
// Errors name the file. max_length is at most 65,536. tests/fuzz/t5_tokenizer_fuzzer fuzzes
// FromBytes and Encode.
#ifndef STOWAGE_MODELS_TOKENIZERS_T5_TOKENIZER_H_
#define STOWAGE_MODELS_TOKENIZERS_T5_TOKENIZER_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stowage {

class T5Tokenizer {
 public:
  static constexpr int64_t kPad = 0;
  static constexpr int64_t kEos = 1;

  // Reads <dir>/spiece.model.
  static absl::StatusOr<std::unique_ptr<T5Tokenizer>> Load(const std::string& dir);
  // The same from spiece.model's bytes (Load's parse and checks; the fuzz target's entry point);
  // `source` names the file in errors.
  static absl::StatusOr<std::unique_ptr<T5Tokenizer>> FromBytes(const std::string& model_bytes,
                                                                const std::string& source);
  // No model file: every byte of the text, as given (no normalisation), one token (id = byte + 3;
  // 0 <pad>, 1 </s>, 2 <unk>; max_id() 258), for built-in pipelines that run with nothing downloaded.
  static std::unique_ptr<T5Tokenizer> ByteLevel();
  ~T5Tokenizer();

  // Exactly max_length ids (1 <= max_length <= 65,536, else INVALID_ARGUMENT naming max_length): the
  // text's ids cut to max_length - 1, </s>, then <pad>. Any bytes are accepted (as SentencePiece does).
  absl::StatusOr<std::vector<int64_t>> Encode(const std::string& text, int64_t max_length) const;
  // The largest id Encode can return.
  int64_t max_id() const;

 private:
  T5Tokenizer();
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_TOKENIZERS_T5_TOKENIZER_H_
