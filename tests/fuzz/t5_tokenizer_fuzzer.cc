// libFuzzer target: spiece.model bytes through T5Tokenizer::FromBytes (Load's hand-written protobuf
// reader and its checks: pieces, trainer and normaliser specs, the precompiled normalisation
// table). When it loads, a few texts are encoded with small max_length values: a fixed prompt
// (leading, trailing and repeated whitespace, NFKC-mapped and CJK characters, an emoji, malformed
// UTF-8, SentencePiece's own U+2581, a special token's text), the start of the input (whose bytes
// the pieces are made of), and that start repeated to 4,096 bytes (Flux's prompt limit: what a
// normalisation rule that expands, or a long piece, would make slow). Any input must give OK or
// INVALID_ARGUMENT quickly, never a crash; every OK encoding must be max_length ids in
// [0, max_id()] holding </s>.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "models/tokenizers/t5_tokenizer.h"

namespace {

void Check(const stowage::T5Tokenizer& tokenizer, const std::string& text, int64_t max_length) {
  auto ids = tokenizer.Encode(text, max_length);
  if (!ids.ok()) {
    if (ids.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return;
  }
  if (static_cast<int64_t>(ids->size()) != max_length) std::abort();
  if (std::find(ids->begin(), ids->end(), stowage::T5Tokenizer::kEos) == ids->end()) std::abort();
  for (int64_t id : *ids) {
    if (id < 0 || id > tokenizer.max_id()) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  auto tokenizer = stowage::T5Tokenizer::FromBytes(input, "spiece.model");
  if (!tokenizer.ok()) {
    if (tokenizer.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  const int64_t short_length = 1 + static_cast<int64_t>(size % 16);
  Check(**tokenizer,
        "  A photo of  TWO cats\t\n\xef\xbc\xa6\xef\xbc\xb5\xef\xbc\xac\xef\xbc\xac \xef\xac\x81 "
        "caf\xc3\xa9 e\xcc\x81 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 \xff\xc3 \xe2\x96\x81x </s>  ",
        short_length);
  Check(**tokenizer, "a red lantern hanging in a dark alley at night", 64);
  Check(**tokenizer, input.substr(0, 256), short_length);
  std::string long_text;
  const std::string unit = input.substr(0, 64);
  while (long_text.size() < 4096) long_text += unit;
  Check(**tokenizer, long_text.substr(0, 4096), 64);
  return 0;
}
