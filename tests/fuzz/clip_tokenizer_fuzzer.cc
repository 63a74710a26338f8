// libFuzzer target: CLIP's vocab.json and merges.txt through ClipTokenizer::FromText (Load's parse
// and checks). The input is vocab.json's text, one NUL byte, then merges.txt's text (an input
// without NUL is all vocab.json, with an empty merges.txt). When it loads, a few texts are encoded
// with small max_length values: a fixed prompt (both special tokens, case, whitespace runs, an
// apostrophe suffix, digits, punctuation, non-ASCII), the start of merges.txt and the start of
// vocab.json (whose symbols the merges and the vocabulary hold), and the start of merges.txt
// without its spaces repeated to 4,096 bytes (Flux's prompt limit; one long word for the merge
// loop). Any input must give OK or INVALID_ARGUMENT quickly, never a crash; every OK encoding must
// be max_length ids in [0, max_id()], starting with <|startoftext|> and ending with <|endoftext|>.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "models/tokenizers/clip_tokenizer.h"

namespace {

void Check(const stowage::ClipTokenizer& tokenizer, const std::string& text, int64_t max_length) {
  auto ids = tokenizer.Encode(text, max_length);
  if (!ids.ok()) {
    if (ids.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return;
  }
  if (static_cast<int64_t>(ids->size()) != max_length) std::abort();
  if (ids->front() != tokenizer.bos_id() || ids->back() != tokenizer.eos_id()) std::abort();
  for (int64_t id : *ids) {
    if (id < 0 || id > tokenizer.max_id()) std::abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string vocab = input.substr(0, nul);
  const std::string merges = nul == std::string::npos ? std::string() : input.substr(nul + 1);
  auto tokenizer = stowage::ClipTokenizer::FromText(vocab, merges, "fuzz");
  if (!tokenizer.ok()) {
    if (tokenizer.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  const int64_t short_length = 2 + static_cast<int64_t>(size % 15);
  Check(**tokenizer,
        "A <|startoftext|>Photo of  TWO cats\t\xc2\xa0it's 42 caf\xc3\xa9 \xc4\xb0 hello!!? "
        "\xe6\x97\xa5\xe6\x9c\xac<|endoftext|> the end",
        short_length);
  Check(**tokenizer, "hello the cat, aaaa", 77);
  Check(**tokenizer, merges.substr(0, 256), short_length);
  Check(**tokenizer, vocab.substr(0, 256), 77);
  std::string unit;
  for (char c : merges.substr(0, 64)) {
    if (c != ' ' && c != '\n') unit += c;
  }
  // Whole characters only (a cut one would make every copy invalid UTF-8): drop the last non-ASCII
  // character, complete or not.
  while (!unit.empty() && static_cast<unsigned char>(unit.back()) >= 0x80) {
    const bool lead = static_cast<unsigned char>(unit.back()) >= 0xC0;
    unit.pop_back();
    if (lead) break;
  }
  if (!unit.empty()) {
    std::string long_text;
    while (long_text.size() + unit.size() <= 4096) long_text += unit;
    Check(**tokenizer, long_text, 77);
  }
  return 0;
}
