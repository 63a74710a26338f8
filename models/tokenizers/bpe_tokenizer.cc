#include "models/tokenizers/bpe_tokenizer.h"

#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "models/core/diffusers_format.h"
#include "base/json_limits.h"
#include "base/status_macros.h"
#include "base/text.h"

namespace stowage {
namespace {

const google::protobuf::Value* Field(const google::protobuf::Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

}  // namespace

BpeTokenizer::~BpeTokenizer() = default;

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
  const std::array<std::string, 256>& table = ByteToUnicode();
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
      // A repeated pair keeps its first (best) rank.
      t->merges_.Add(std::move(pair.first), std::move(pair.second), rank++, BpeMerges::Repeat::kKeepFirst);
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
  auto regex = BoundedRegex::Compile(pattern);
  if (!regex.ok()) return bad(absl::StrCat("pre-tokenizer ", regex.status().message()));
  t->regex_ = *std::move(regex);
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
  const std::array<std::string, 256>& table = ByteToUnicode();
  std::string mapped;
  for (unsigned char b : word) mapped += table[b];
  std::vector<std::string> symbols = SplitUtf8(mapped);
  merges_.Apply(symbols);
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
    // Text the regex skips (none for these patterns, which cover everything) is still encoded.
    status = regex_->Split(text, [&](absl::string_view word, bool) { return EncodeWord(std::string(word), ids); });
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
  if (!status.ok()) return status;
  return ids;
}

}  // namespace stowage
