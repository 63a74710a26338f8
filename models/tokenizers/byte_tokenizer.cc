#include "models/tokenizers/byte_tokenizer.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace stowage {

absl::StatusOr<TokenBatch> ByteTokenizer::Encode(const std::vector<std::string>& texts) const {
  TokenBatch batch;
  for (const std::string& text : texts) {
    if (static_cast<int>(text.size()) > max_text_bytes()) {
      return absl::InvalidArgumentError(absl::StrCat("text of ", text.size(),
                                                     " bytes exceeds the tokenizer's limit of ",
                                                     max_text_bytes(), " bytes"));
    }
    std::vector<int64_t> ids;
    ids.reserve(text.size() + 2);
    ids.push_back(kBos);
    for (unsigned char c : text) ids.push_back(static_cast<int64_t>(c) + 3);
    ids.push_back(kEos);
    batch.length = std::max(batch.length, static_cast<int>(ids.size()));
    batch.ids.push_back(std::move(ids));
  }
  for (std::vector<int64_t>& ids : batch.ids) {
    std::vector<bool> mask(ids.size(), true);
    mask.resize(static_cast<size_t>(batch.length), false);
    ids.resize(static_cast<size_t>(batch.length), kPad);
    batch.mask.push_back(std::move(mask));
  }
  return batch;
}

}  // namespace stowage
