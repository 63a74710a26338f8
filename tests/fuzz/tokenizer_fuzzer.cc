// libFuzzer target: tokenizer.json text through BpeTokenizer::FromJsonText (the loader's parse and
// checks), then one Encode of a fixed prompt with the file's regex, merges and added tokens. Any
// input must give OK or INVALID_ARGUMENT quickly, never a crash.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "models/tokenizers/bpe_tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto tokenizer = stowage::BpeTokenizer::FromJsonText(text, "tokenizer.json");
  if (!tokenizer.ok()) {
    if (tokenizer.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  auto ids = (*tokenizer)->Encode("<|im_start|>user\na red lantern, 2 cats\xe2\x80\x94 caf\xc3\xa9<|im_end|>\n");
  if (!ids.ok() && ids.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
  return 0;
}
