#include "models/tokenizers/clip_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/bounded_read.h"
#include "base/json_limits.h"
#include "base/status_macros.h"
#include "base/text.h"
#include "models/tokenizers/byte_level_bpe.h"
#include "models/core/diffusers_format.h"

namespace stowage {
namespace {

constexpr absl::string_view kStartOfText = "<|startoftext|>";
constexpr absl::string_view kEndOfText = "<|endoftext|>";
constexpr absl::string_view kEndOfWord = "</w>";
// Bounds on untrusted input (CLIP's vocab.json has 49,408 entries, merges.txt 48,894 lines in 525 kB).
constexpr int64_t kMaxVocab = int64_t{1} << 22;  // Entries of vocab.json, lines of merges.txt.
constexpr int64_t kMaxMergesBytes = int64_t{64} << 20;
constexpr int64_t kMaxLength = int64_t{1} << 16;  // Encode's max_length (Flux: 77).

// CLIP's pre-tokenizer pattern as the tokenizers library runs it after its normaliser (the text is
// lower case and every whitespace run is one space by then). The published pattern starts with the
// alternatives <\|startoftext\|>|<\|endoftext\|>; they are left out here because the ByteLevel
// pre-tokenizer that follows re-splits such a piece with GPT-2's pattern into "<|", "endoftext",
// "|>", which is what the remaining alternatives give. Every other piece of this pattern comes
// through GPT-2's pattern whole. (Exact special tokens are split out before, in Encode.)
constexpr char kPattern[] = R"('s|'t|'re|'ve|'m|'ll|'d|\p{L}+|\p{N}|[^\s\p{L}\p{N}]+)";

// Unicode's White_Space property: what the normaliser's Replace(\s+, " ") matches (Oniguruma's \s).
bool IsWhiteSpace(int32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F || cp == 0x205F ||
         cp == 0x3000;
}

void AppendUtf8(int32_t cp, std::string& out) {
  utf8proc_uint8_t buffer[4];
  const utf8proc_ssize_t n = utf8proc_encode_char(cp, buffer);
  out.append(reinterpret_cast<const char*>(buffer), static_cast<size_t>(n));
}

// CLIPTokenizer's normaliser (transformers 5; CLIPTokenizerFast in 4.x): NFC, every run of
// White_Space one space, then lower case per code point with Unicode's full mapping and no context
// (Rust's char::to_lowercase: U+0130 becomes "i" U+0307; Σ is always σ).
absl::StatusOr<std::string> Normalize(absl::string_view text) {
  if (text.empty()) return std::string();
  utf8proc_uint8_t* nfc = nullptr;
  const utf8proc_ssize_t n =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(text.data()), static_cast<utf8proc_ssize_t>(text.size()),
                   &nfc, static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  if (n < 0) return absl::InvalidArgumentError("text is not valid UTF-8");
  std::string out;
  out.reserve(static_cast<size_t>(n));
  bool in_space = false;
  for (utf8proc_ssize_t i = 0; i < n;) {
    utf8proc_int32_t cp = 0;
    const utf8proc_ssize_t len = utf8proc_iterate(nfc + i, n - i, &cp);
    if (len <= 0) break;  // Cannot happen: utf8proc wrote valid UTF-8.
    i += len;
    if (IsWhiteSpace(cp)) {
      if (!in_space) out += ' ';
      in_space = true;
      continue;
    }
    in_space = false;
    if (cp == 0x130) {
      out += "i\xcc\x87";
    } else {
      AppendUtf8(utf8proc_tolower(cp), out);
    }
  }
  std::free(nfc);
  return out;
}

}  // namespace

struct ClipTokenizer::State {
  absl::flat_hash_map<std::string, int64_t> vocab;
  BpeMerges merges;
  int64_t bos_id = 0;
  int64_t eos_id = 0;  // Also the unknown and the pad token.
  int64_t max_id = 0;
  std::unique_ptr<BoundedRegex> regex;

  // Appends the ids of one pre-tokenized word.
  void EncodeWord(absl::string_view word, std::vector<int64_t>& out) const {
    const std::array<std::string, 256>& table = ByteToUnicode();
    std::string mapped;
    for (unsigned char b : word) mapped += table[b];
    std::vector<std::string> symbols = SplitUtf8(mapped);
    if (symbols.empty()) return;
    symbols.back().append(kEndOfWord.data(), kEndOfWord.size());
    merges.Apply(symbols);
    for (const std::string& s : symbols) {
      auto it = vocab.find(s);
      out.push_back(it == vocab.end() ? eos_id : it->second);
    }
  }
};

ClipTokenizer::ClipTokenizer() : state_(std::make_unique<State>()) {}
ClipTokenizer::~ClipTokenizer() = default;

absl::StatusOr<std::unique_ptr<ClipTokenizer>> ClipTokenizer::Load(const std::string& dir) {
  // Each file is refused by its size before it is read; FromText checks the sizes again.
  ASSIGN_OR_RETURN(std::string vocab, ReadFileAtMost(dir + "/vocab.json", kVocabJsonLimits.max_bytes));
  ASSIGN_OR_RETURN(std::string merges, ReadFileAtMost(dir + "/merges.txt", kMaxMergesBytes));
  return FromText(vocab, merges, dir);
}

absl::StatusOr<std::unique_ptr<ClipTokenizer>> ClipTokenizer::FromText(const std::string& vocab_json,
                                                                        const std::string& merges_txt,
                                                                        const std::string& source) {
  const std::string vocab_path = source + "/vocab.json";
  const std::string merges_path = source + "/merges.txt";
  std::unique_ptr<ClipTokenizer> t(new ClipTokenizer());
  State& s = *t->state_;
  ASSIGN_OR_RETURN(google::protobuf::Struct json, ParseJsonObject(vocab_json, kVocabJsonLimits, vocab_path));
  if (json.fields_size() > kMaxVocab) {
    return absl::InvalidArgumentError(
        absl::StrCat(vocab_path, ": ", json.fields_size(), " entries; at most ", kMaxVocab));
  }
  s.vocab.reserve(static_cast<size_t>(json.fields_size()));
  for (const auto& [token, value] : json.fields()) {
    const double d = value.has_number_value() ? value.number_value() : -1.0;
    if (!(d >= 0.0 && d < 2147483648.0) || d != static_cast<double>(static_cast<int64_t>(d))) {
      return absl::InvalidArgumentError(
          absl::StrCat(vocab_path, ": entry '", Truncated(token), "' is not an id in [0, 2^31)"));
    }
    s.vocab[token] = static_cast<int64_t>(d);
    s.max_id = std::max(s.max_id, static_cast<int64_t>(d));
  }
  for (auto [token, id] : {std::make_pair(kStartOfText, &s.bos_id), std::make_pair(kEndOfText, &s.eos_id)}) {
    auto it = s.vocab.find(token);
    if (it == s.vocab.end()) return absl::InvalidArgumentError(absl::StrCat(vocab_path, ": no '", token, "'"));
    *id = it->second;
  }

  if (static_cast<int64_t>(merges_txt.size()) > kMaxMergesBytes) {
    return absl::InvalidArgumentError(absl::StrCat(merges_path, ": ", merges_txt.size(),
                                                   " bytes exceeds the limit of ", kMaxMergesBytes, " bytes"));
  }
  const std::string& merges = merges_txt;
  int64_t line_number = 0;
  int64_t rank = 0;
  for (size_t start = 0; start < merges.size();) {
    size_t end = merges.find('\n', start);
    if (end == std::string::npos) end = merges.size();
    absl::string_view line(merges.data() + start, end - start);
    start = end + 1;
    ++line_number;
    if (absl::EndsWith(line, "\r")) line.remove_suffix(1);
    if (line_number == 1 && absl::StartsWith(line, "#version")) continue;
    const size_t space = line.find(' ');
    if (space == absl::string_view::npos || space == 0 || space + 1 == line.size() ||
        line.find(' ', space + 1) != absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat(merges_path, ": line ", line_number, " is not two symbols separated by one space"));
    }
    const absl::string_view a = line.substr(0, space), b = line.substr(space + 1);
    for (const std::string& symbol : {std::string(a), std::string(b), absl::StrCat(a, b)}) {
      if (!s.vocab.contains(symbol)) {
        return absl::InvalidArgumentError(absl::StrCat(merges_path, ": line ", line_number, ": '", Truncated(symbol),
                                                       "' is not in vocab.json"));
      }
    }
    if (rank >= kMaxVocab) {
      return absl::InvalidArgumentError(absl::StrCat(merges_path, ": more than ", kMaxVocab, " merges"));
    }
    // A pair listed twice takes its last rank, as both transformers implementations do.
    s.merges.Add(std::string(a), std::string(b), rank++, BpeMerges::Repeat::kKeepLast);
  }
  ASSIGN_OR_RETURN(s.regex, BoundedRegex::Compile(kPattern));
  return t;
}

std::unique_ptr<ClipTokenizer> ClipTokenizer::ByteLevel() {
  std::unique_ptr<ClipTokenizer> t(new ClipTokenizer());
  State& s = *t->state_;
  const std::array<std::string, 256>& table = ByteToUnicode();
  for (int b = 0; b < 256; ++b) {
    s.vocab[table[b]] = b;
    s.vocab[absl::StrCat(table[b], kEndOfWord)] = 256 + b;
  }
  s.bos_id = 512;
  s.eos_id = 513;
  s.vocab[std::string(kStartOfText)] = s.bos_id;
  s.vocab[std::string(kEndOfText)] = s.eos_id;
  s.max_id = 513;
  auto regex = BoundedRegex::Compile(kPattern);
  if (!regex.ok()) return nullptr;  // Cannot happen: the pattern is fixed.
  s.regex = *std::move(regex);
  return t;
}

absl::StatusOr<std::vector<int64_t>> ClipTokenizer::Encode(const std::string& text, int64_t max_length) const {
  if (max_length < 2 || max_length > kMaxLength) {
    return absl::InvalidArgumentError(absl::StrCat("max_length ", max_length, " is outside [2, ", kMaxLength,
                                                   "] (CLIP's ids start with <|startoftext|> and end with "
                                                   "<|endoftext|>)"));
  }
  if (!IsValidUtf8(text)) return absl::InvalidArgumentError("text is not valid UTF-8");
  const State& s = *state_;
  const size_t budget = static_cast<size_t>(max_length - 2);
  std::vector<int64_t> tokens;
  auto encode_segment = [&](absl::string_view segment) -> absl::Status {
    if (segment.empty() || tokens.size() >= budget) return absl::OkStatus();
    ASSIGN_OR_RETURN(std::string normalized, Normalize(segment));
    return s.regex->Split(normalized, [&](absl::string_view piece, bool matched) {
      // Unmatched text is spaces (removed); words past the cut change nothing.
      if (matched && tokens.size() < budget) s.EncodeWord(piece, tokens);
      return absl::OkStatus();
    });
  };
  // The special tokens, written exactly, are split out first and normalised no further.
  size_t pos = 0;
  size_t next_start = text.find(kStartOfText.data(), 0, kStartOfText.size());
  size_t next_end = text.find(kEndOfText.data(), 0, kEndOfText.size());
  while (tokens.size() < budget) {
    if (next_start != std::string::npos && next_start < pos) {
      next_start = text.find(kStartOfText.data(), pos, kStartOfText.size());
    }
    if (next_end != std::string::npos && next_end < pos) next_end = text.find(kEndOfText.data(), pos, kEndOfText.size());
    const size_t at = std::min(next_start, next_end);
    RETURN_IF_ERROR(encode_segment(absl::string_view(text).substr(pos, at == std::string::npos ? at : at - pos)));
    if (at == std::string::npos) break;
    const bool start = at == next_start;
    if (tokens.size() < budget) tokens.push_back(start ? s.bos_id : s.eos_id);
    pos = at + (start ? kStartOfText.size() : kEndOfText.size());
  }
  if (tokens.size() > budget) tokens.resize(budget);
  std::vector<int64_t> ids;
  ids.reserve(static_cast<size_t>(max_length));
  ids.push_back(s.bos_id);
  ids.insert(ids.end(), tokens.begin(), tokens.end());
  ids.push_back(s.eos_id);
  ids.resize(static_cast<size_t>(max_length), s.eos_id);
  return ids;
}

int64_t ClipTokenizer::bos_id() const { return state_->bos_id; }
int64_t ClipTokenizer::eos_id() const { return state_->eos_id; }
int64_t ClipTokenizer::max_id() const { return state_->max_id; }

}  // namespace stowage
