#include "models/tokenizers/byte_level_bpe.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <queue>

#include "absl/strings/str_cat.h"

namespace stowage {
namespace {

// UTF-8 of a code point below 0x800 (the table's code points are below 0x144).
std::string SmallCodePointToUtf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

std::array<std::string, 256> BuildByteTable() {
  bool direct[256] = {};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  std::array<std::string, 256> table;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = SmallCodePointToUtf8(direct[b] ? static_cast<uint32_t>(b) : next++);
  return table;
}

}  // namespace

const std::array<std::string, 256>& ByteToUnicode() {
  static const std::array<std::string, 256>* const table = new std::array<std::string, 256>(BuildByteTable());
  return *table;
}

std::vector<std::string> SplitUtf8(absl::string_view s) {
  std::vector<std::string> chars;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : 4;
    chars.emplace_back(s.substr(i, n));
    i += n;
  }
  return chars;
}

void BpeMerges::Add(std::string a, std::string b, int64_t rank, Repeat repeat) {
  auto key = std::make_pair(std::move(a), std::move(b));
  if (repeat == Repeat::kKeepFirst) {
    rank_.emplace(std::move(key), rank);
  } else {
    rank_[std::move(key)] = rank;
  }
}

int64_t BpeMerges::Rank(const std::string& a, const std::string& b) const {
  auto it = rank_.find(std::make_pair(a, b));
  return it == rank_.end() ? -1 : it->second;
}

void BpeMerges::Apply(std::vector<std::string>& symbols) const {
  const int64_t n = static_cast<int64_t>(symbols.size());
  if (n < 2 || rank_.empty()) return;
  // Symbols form a linked list; a merge keeps the left one (its index) and empties the right one.
  std::vector<int64_t> prev(n), next(n);
  for (int64_t i = 0; i < n; ++i) {
    prev[i] = i - 1;
    next[i] = i + 1 < n ? i + 1 : -1;
  }
  std::vector<bool> alive(n, true);
  // Candidates (rank, index of the pair's left symbol), lowest rank first, then leftmost: all
  // occurrences of one pair are merged left to right before any pair of a higher rank, as
  // transformers' loop does. Merging (a, b) never forms (a, b) again, so a rank's occurrences are
  // exactly those present when its turn comes. An entry whose pair changed since is skipped.
  using Candidate = std::pair<int64_t, int64_t>;
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  auto push = [&](int64_t left) {
    if (left < 0 || next[left] < 0) return;
    const int64_t rank = Rank(symbols[left], symbols[next[left]]);
    if (rank >= 0) heap.emplace(rank, left);
  };
  for (int64_t i = 0; i + 1 < n; ++i) push(i);
  while (!heap.empty()) {
    const auto [rank, left] = heap.top();
    heap.pop();
    if (!alive[left] || next[left] < 0) continue;
    const int64_t right = next[left];
    if (Rank(symbols[left], symbols[right]) != rank) continue;
    symbols[left] += symbols[right];
    symbols[right].clear();
    alive[right] = false;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    push(prev[left]);
    push(left);
  }
  std::vector<std::string> merged;
  for (int64_t i = 0; i >= 0; i = next[i]) merged.push_back(std::move(symbols[i]));
  symbols.swap(merged);
}

BoundedRegex::~BoundedRegex() {
  if (code_ != nullptr) pcre2_code_free(static_cast<pcre2_code*>(code_));
}

absl::StatusOr<std::unique_ptr<BoundedRegex>> BoundedRegex::Compile(const std::string& pattern) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) return absl::InvalidArgumentError(absl::StrCat("regex does not compile at offset ", offset));
  std::unique_ptr<BoundedRegex> regex(new BoundedRegex());
  regex->code_ = code;
  return regex;
}

absl::Status BoundedRegex::Split(absl::string_view text,
                                 const std::function<absl::Status(absl::string_view, bool)>& on_piece) const {
  auto* code = static_cast<pcre2_code*>(code_);
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code, nullptr);
  pcre2_match_context* limits = pcre2_match_context_create(nullptr);
  pcre2_set_match_limit(limits, 1'000'000);
  pcre2_set_depth_limit(limits, 10'000);
  absl::Status status;
  size_t pending = 0;  // Start of the text not handed out yet.
  size_t search = 0;
  // PCRE2 checks the whole subject's UTF-8 on each call unless told not to: once is enough (else
  // splitting is quadratic in the text's length).
  uint32_t options = 0;
  while (search < text.size()) {
    const int rc =
        pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), search, options, match, limits);
    options = PCRE2_NO_UTF_CHECK;
    if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT) {
      status = absl::InvalidArgumentError("the pre-tokenizer regex exceeded its match limit on this text");
      break;
    }
    if (rc < 0) break;  // No match, or text PCRE2 rejects: the rest is one unmatched stretch.
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match);
    if (ov[1] == ov[0]) {  // Empty match: skip one code point.
      search = ov[0] + 1;
      while (search < text.size() && (static_cast<unsigned char>(text[search]) & 0xC0) == 0x80) ++search;
      continue;
    }
    if (ov[0] > pending) status = on_piece(text.substr(pending, ov[0] - pending), false);
    if (status.ok()) status = on_piece(text.substr(ov[0], ov[1] - ov[0]), true);
    if (!status.ok()) break;
    pending = search = ov[1];
  }
  if (status.ok() && pending < text.size()) status = on_piece(text.substr(pending), false);
  pcre2_match_data_free(match);
  pcre2_match_context_free(limits);
  return status;
}

}  // namespace stowage
