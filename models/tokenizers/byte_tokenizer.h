// ByteTokenizer: the built-in pipeline's tokenizer. Every UTF-8 byte is one token (id = byte + 3),
// framed by BOS and EOS and padded to a common length. Needs no vocabulary file, so the default
// pipeline runs with nothing downloaded.
#ifndef STOWAGE_MODELS_TOKENIZERS_BYTE_TOKENIZER_H_
#define STOWAGE_MODELS_TOKENIZERS_BYTE_TOKENIZER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace stowage {

struct TokenBatch {
  std::vector<std::vector<int64_t>> ids;  // [batch][length], padded with kPad.
  std::vector<std::vector<bool>> mask;    // true for real tokens (BOS, bytes, EOS).
  int length = 0;
};

class ByteTokenizer {
 public:
  static constexpr int64_t kPad = 0;
  static constexpr int64_t kBos = 1;
  static constexpr int64_t kEos = 2;
  static constexpr int64_t kVocabSize = 256 + 3;

  explicit ByteTokenizer(int max_tokens) : max_tokens_(max_tokens) {}
  int max_tokens() const { return max_tokens_; }
  // Longest text that fits: max_tokens minus BOS and EOS.
  int max_text_bytes() const { return max_tokens_ - 2; }

  // Fails with INVALID_ARGUMENT when a text is longer than max_text_bytes().
  absl::StatusOr<TokenBatch> Encode(const std::vector<std::string>& texts) const;

 private:
  int max_tokens_;
};

}  // namespace stowage

#endif  // STOWAGE_MODELS_TOKENIZERS_BYTE_TOKENIZER_H_
