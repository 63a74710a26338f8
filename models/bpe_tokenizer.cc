#include "models/bpe_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "models/diffusers_format.h"
#include "base/json_limits.h"
#include "base/status_macros.h"
#include "base/text.h"

namespace stowage {
namespace {

// GPT-2's reversible byte → printable unicode code point table.
std::string CodePointToUtf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

void BuildByteTable(std::string table[256]) {
  bool direct[256] = {};
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) table[b] = CodePointToUtf8(direct[b] ? static_cast<uint32_t>(b) : next++);
}

const google::protobuf::Value* Field(const google::protobuf::Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

// Splits a UTF-8 string into code-point strings.
std::vector<std::string> Utf8Chars(const std::string& s) {
  std::vector<std::string> chars;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    const size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : 4;
    chars.push_back(s.substr(i, n));
    i += n;
  }
  return chars;
}

}  // namespace

BpeTokenizer::~BpeTokenizer() {
  if (regex_ != nullptr) pcre2_code_free(static_cast<pcre2_code*>(regex_));
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Load(const std::string& path) {
  ASSIGN_OR_RETURN(google::protobuf::Struct json, ReadJsonFile(path, kTokenizerJsonLimits));
  return FromJson(json, path);
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJsonText(const std::string& text,
                                                                        const std::string& source) {
  ASSIGN_OR_RETURN(google::protobuf::Struct json, ParseJsonObject(text, kTokenizerJsonLimits, source));
  return FromJson(json, source);
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::ByteLevel(const std::vector<std::string>& special_tokens) {
  google::protobuf::Struct json;
  std::string table[256];
  BuildByteTable(table);
  auto* model = (*json.mutable_fields())["model"].mutable_struct_value();
  (*model->mutable_fields())["type"].set_string_value("BPE");
  auto* vocab = (*model->mutable_fields())["vocab"].mutable_struct_value();
  for (int b = 0; b < 256; ++b) (*vocab->mutable_fields())[table[b]].set_number_value(b);
  auto* added = (*json.mutable_fields())["added_tokens"].mutable_list_value();
  for (size_t i = 0; i < special_tokens.size(); ++i) {
    auto* token = added->add_values()->mutable_struct_value();
    (*token->mutable_fields())["content"].set_string_value(special_tokens[i]);
    (*token->mutable_fields())["id"].set_number_value(static_cast<double>(256 + i));
  }
  auto* pre = (*json.mutable_fields())["pre_tokenizer"].mutable_struct_value();
  (*pre->mutable_fields())["type"].set_string_value("Split");
  (*(*pre->mutable_fields())["pattern"].mutable_struct_value()->mutable_fields())["Regex"].set_string_value(
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+");
  auto made = FromJson(json, "built-in byte-level tokenizer");
  return made.ok() ? *std::move(made) : nullptr;
}

absl::StatusOr<std::unique_ptr<BpeTokenizer>> BpeTokenizer::FromJson(const google::protobuf::Struct& json,
                                                                    const std::string& path) {
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  BuildByteTable(t->byte_to_unicode_);
  auto bad = [&](const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer '", path, "': ", why));
  };
  const google::protobuf::Value* model = Field(json, "model");
  if (model == nullptr || !model->has_struct_value()) return bad("no model");
  const google::protobuf::Value* type = Field(model->struct_value(), "type");
  if (type == nullptr || type->string_value() != "BPE") return bad("model.type must be BPE");
  // An id: a whole JSON number in [0, 2^31).
  auto as_id = [&](const google::protobuf::Value& v, int64_t* id) {
    if (!v.has_number_value()) return false;
    const double d = v.number_value();
    if (!(d >= 0.0 && d < 2147483648.0) || d != static_cast<double>(static_cast<int64_t>(d))) return false;
    *id = static_cast<int64_t>(d);
    t->max_id_ = std::max(t->max_id_, *id);
    return true;
  };
  const google::protobuf::Value* vocab = Field(model->struct_value(), "vocab");
  if (vocab == nullptr || !vocab->has_struct_value()) return bad("no model.vocab");
  if (vocab->struct_value().fields_size() > kMaxVocab) {
    return bad(absl::StrCat("model.vocab has ", vocab->struct_value().fields_size(), " entries; at most ", kMaxVocab));
  }
  t->vocab_.reserve(static_cast<size_t>(vocab->struct_value().fields_size()));
  for (const auto& [token, id] : vocab->struct_value().fields()) {
    int64_t value = 0;
    if (!as_id(id, &value)) {
      return bad(absl::StrCat("model.vocab entry '", Truncated(token), "' is not an id in [0, 2^31)"));
    }
    t->vocab_[token] = value;
  }
  const google::protobuf::Value* merges = Field(model->struct_value(), "merges");
  if (merges != nullptr && !merges->has_null_value()) {
    if (!merges->has_list_value()) return bad("model.merges is not a list");
    if (merges->list_value().values_size() > kMaxVocab) {
      return bad(absl::StrCat("model.merges has ", merges->list_value().values_size(), " entries; at most ", kMaxVocab));
    }
    int64_t rank = 0;
    for (const auto& m : merges->list_value().values()) {
      std::pair<std::string, std::string> pair;
      if (m.has_string_value()) {
        std::vector<std::string> parts = absl::StrSplit(m.string_value(), absl::MaxSplits(' ', 1));
        if (parts.size() != 2) return bad(absl::StrCat("malformed merge at index ", rank));
        pair = {parts[0], parts[1]};
      } else if (m.has_list_value() && m.list_value().values_size() == 2 &&
                 m.list_value().values(0).has_string_value() && m.list_value().values(1).has_string_value()) {
        pair = {m.list_value().values(0).string_value(), m.list_value().values(1).string_value()};
      } else {
        return bad(absl::StrCat("malformed merge at index ", rank));
      }
      t->merge_rank_.emplace(std::move(pair), rank++);  // A repeated pair keeps its first (best) rank.
    }
  }
  if (const google::protobuf::Value* added = Field(json, "added_tokens"); added != nullptr && !added->has_null_value()) {
    if (!added->has_list_value()) return bad("added_tokens is not a list");
    if (added->list_value().values_size() > kMaxAddedTokens) {
      return bad(absl::StrCat("added_tokens has ", added->list_value().values_size(), " entries; at most ",
                              kMaxAddedTokens));
    }
    int index = 0;
    for (const auto& a : added->list_value().values()) {
      const auto* content = a.has_struct_value() ? Field(a.struct_value(), "content") : nullptr;
      const auto* id = a.has_struct_value() ? Field(a.struct_value(), "id") : nullptr;
      int64_t value = 0;
      if (content == nullptr || id == nullptr || !content->has_string_value() || content->string_value().empty() ||
          static_cast<int64_t>(content->string_value().size()) > kMaxAddedTokenBytes || !as_id(*id, &value)) {
        return bad(absl::StrCat("added_tokens[", index, "] needs a content of 1 to ", kMaxAddedTokenBytes,
                                " bytes and an id in [0, 2^31)"));
      }
      t->added_.emplace_back(content->string_value(), value);
      ++index;
    }
    std::stable_sort(t->added_.begin(), t->added_.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    t->added_terminal_.assign(1, -1);
    for (const auto& [content, id] : t->added_) {
      int32_t node = 0;
      for (unsigned char byte : content) {
        const uint64_t edge = (static_cast<uint64_t>(node) << 8) | byte;
        auto it = t->added_edges_.find(edge);
        if (it == t->added_edges_.end()) {
          it = t->added_edges_.emplace(edge, static_cast<int32_t>(t->added_terminal_.size())).first;
          t->added_terminal_.push_back(-1);
        }
        node = it->second;
      }
      if (t->added_terminal_[node] < 0) t->added_terminal_[node] = id;  // The first of equal contents wins.
    }
  }
  if (const google::protobuf::Value* normalizer = Field(json, "normalizer")) {
    if (normalizer->has_struct_value()) {
      const auto* ntype = Field(normalizer->struct_value(), "type");
      if (ntype == nullptr || ntype->string_value() != "NFC") {
        return bad(absl::StrCat("unsupported normalizer '", ntype ? Truncated(ntype->string_value()) : "",
                                "' (NFC only)"));
      }
      t->nfc_ = true;
    }
  }
  // Pre-tokenizer: a Sequence holding a Split on a regex and a ByteLevel without its own regex, or a
  // bare ByteLevel (GPT-2's pattern).
  std::string pattern =
      "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
  if (const google::protobuf::Value* pre = Field(json, "pre_tokenizer"); pre != nullptr && !pre->has_null_value()) {
    if (!pre->has_struct_value()) return bad("pre_tokenizer is not an object");
    std::vector<const google::protobuf::Struct*> steps;
    const auto* ptype = Field(pre->struct_value(), "type");
    if (ptype != nullptr && ptype->string_value() == "Sequence") {
      const auto* list = Field(pre->struct_value(), "pretokenizers");
      if (list == nullptr || !list->has_list_value()) return bad("Sequence pre-tokenizer without pretokenizers");
      for (const auto& p : list->list_value().values()) {
        if (!p.has_struct_value()) return bad("a pre-tokenizer of the Sequence is not an object");
        steps.push_back(&p.struct_value());
      }
    } else {
      steps.push_back(&pre->struct_value());
    }
    for (const google::protobuf::Struct* step : steps) {
      const auto* stype_value = Field(*step, "type");
      const std::string stype = stype_value == nullptr ? "" : stype_value->string_value();
      if (stype == "Split") {
        const auto* p = Field(*step, "pattern");
        const auto* regex = p != nullptr && p->has_struct_value() ? Field(p->struct_value(), "Regex") : nullptr;
        if (regex == nullptr || !regex->has_string_value()) return bad("Split pre-tokenizer without a Regex pattern");
        pattern = regex->string_value();
      } else if (stype != "ByteLevel") {
        return bad(absl::StrCat("unsupported pre-tokenizer '", Truncated(stype), "'"));
      }
    }
  }
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.c_str()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) return bad(absl::StrCat("pre-tokenizer regex does not compile at offset ", offset));
  t->regex_ = code;
  return t;
}

absl::StatusOr<int64_t> BpeTokenizer::TokenId(const std::string& token) const {
  for (const auto& [content, id] : added_) {
    if (content == token) return id;
  }
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return absl::NotFoundError(absl::StrCat("no token '", Truncated(token), "'"));
  return it->second;
}

absl::Status BpeTokenizer::EncodeWord(const std::string& word, std::vector<int64_t>& out) const {
  std::string mapped;
  for (unsigned char b : word) mapped += byte_to_unicode_[b];
  std::vector<std::string> symbols = Utf8Chars(mapped);
  while (symbols.size() > 1) {
    int64_t best = std::numeric_limits<int64_t>::max();
    size_t at = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      auto it = merge_rank_.find({symbols[i], symbols[i + 1]});
      if (it != merge_rank_.end() && it->second < best) {
        best = it->second;
        at = i;
      }
    }
    if (best == std::numeric_limits<int64_t>::max()) break;
    // Merge every occurrence of the best pair, left to right.
    const std::string a = symbols[at], b = symbols[at + 1];
    std::vector<std::string> merged;
    for (size_t i = 0; i < symbols.size();) {
      if (i + 1 < symbols.size() && symbols[i] == a && symbols[i + 1] == b) {
        merged.push_back(a + b);
        i += 2;
      } else {
        merged.push_back(symbols[i++]);
      }
    }
    symbols.swap(merged);
  }
  for (const std::string& s : symbols) {
    auto it = vocab_.find(s);
    if (it == vocab_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("symbol '", Truncated(s), "' is not in the vocabulary"));
    }
    out.push_back(it->second);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> BpeTokenizer::Encode(const std::string& raw) const {
  std::vector<int64_t> ids;
  auto* code = static_cast<pcre2_code*>(regex_);
  pcre2_match_data* match = pcre2_match_data_create_from_pattern(code, nullptr);
  // A regex from the file may backtrack catastrophically: bound the work per match.
  pcre2_match_context* limits = pcre2_match_context_create(nullptr);
  pcre2_set_match_limit(limits, 1'000'000);
  pcre2_set_depth_limit(limits, 10'000);
  absl::Status status;
  auto encode_segment = [&](const std::string& segment) {
    std::string text = segment;
    if (nfc_ && !text.empty()) {
      utf8proc_uint8_t* normalized = utf8proc_NFC(reinterpret_cast<const utf8proc_uint8_t*>(text.c_str()));
      if (normalized == nullptr) {
        status = absl::InvalidArgumentError("text is not valid UTF-8");
        return;
      }
      text = reinterpret_cast<char*>(normalized);
      std::free(normalized);
    }
    PCRE2_SIZE start = 0;
    while (start < text.size() && status.ok()) {
      const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), start, 0, match, limits);
      if (rc == PCRE2_ERROR_MATCHLIMIT || rc == PCRE2_ERROR_DEPTHLIMIT || rc == PCRE2_ERROR_HEAPLIMIT) {
        status = absl::InvalidArgumentError("the pre-tokenizer regex exceeded its match limit on this text");
        break;
      }
      if (rc < 0) break;  // No match (or text PCRE2 rejects): the rest is encoded as one word below.
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(match);
      if (ov[1] == ov[0]) {  // Empty match: advance one code point.
        ++start;
        continue;
      }
      // Text the regex skipped (none for these patterns, which cover everything) is still encoded.
      if (ov[0] > start) status = EncodeWord(text.substr(start, ov[0] - start), ids);
      if (status.ok()) status = EncodeWord(text.substr(ov[0], ov[1] - ov[0]), ids);
      start = ov[1];
    }
    if (status.ok() && start < text.size()) status = EncodeWord(text.substr(start), ids);
  };
  // Added (special) tokens are matched verbatim, longest first, before anything else.
  size_t pos = 0;
  std::string pending;
  while (pos < raw.size() && status.ok()) {
    // The longest added token starting at `pos`: one walk down the trie.
    int64_t match_id = -1;
    size_t match_len = 0;
    int32_t node = 0;
    for (size_t i = pos; i < raw.size() && !added_edges_.empty(); ++i) {
      auto it = added_edges_.find((static_cast<uint64_t>(node) << 8) | static_cast<unsigned char>(raw[i]));
      if (it == added_edges_.end()) break;
      node = it->second;
      if (added_terminal_[node] >= 0) {
        match_id = added_terminal_[node];
        match_len = i + 1 - pos;
      }
    }
    if (match_len > 0) {
      encode_segment(pending);
      pending.clear();
      ids.push_back(match_id);
      pos += match_len;
    } else {
      pending += raw[pos++];
    }
  }
  if (status.ok()) encode_segment(pending);
  pcre2_match_data_free(match);
  pcre2_match_context_free(limits);
  if (!status.ok()) return status;
  return ids;
}

}  // namespace stowage
