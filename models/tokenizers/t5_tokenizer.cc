#include "models/tokenizers/t5_tokenizer.h"

#include <algorithm>
#include <array>
#include <cfloat>
#include <cstring>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "base/bounded_read.h"
#include "base/status_macros.h"
#include "base/text.h"

namespace stowage {
namespace {

// Bounds on untrusted input (T5's spiece.model is 792 kB with 32,000 pieces).
constexpr int64_t kMaxModelBytes = int64_t{64} << 20;
constexpr int64_t kMaxPieces = int64_t{1} << 22;
constexpr int64_t kMaxLength = int64_t{1} << 16;  // Encode's max_length (Flux: 256 or 512).
// The Viterbi walks, from each byte, as deep into the pieces as the text matches: pieces are at
// most kMaxPieceBytes long (the trainer makes pieces of at most 16 characters by default).
constexpr int64_t kMaxPieceBytes = 256;
// The normalised text is at most kMaxExpansion times the text's bytes, plus kMaxExpansion: a
// replacement of the precompiled rules can be any string of the table (NFKC's largest expansion,
// U+FDFA to 18 characters, is 11-fold; 13-fold with its spaces escaped).
constexpr int64_t kMaxExpansion = 64;

constexpr absl::string_view kSpaceSymbol = "\xe2\x96\x81";  // U+2581, SentencePiece's escaped space.
constexpr absl::string_view kReplacementChar = "\xef\xbf\xbd";  // U+FFFD
constexpr float kUnkPenalty = 10.0f;                           // unigram_model.cc

// sentencepiece_model.proto's ModelProto.SentencePiece.Type.
enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };

// ---------------------------------------------------------------------------------------------
// The protobuf wire format, read by hand: the library that reads spiece.model must not be
// libprotobuf (the process has it at another version than the one libsentencepiece bundles; see
// t5_tokenizer.h). Only the fields the encoder uses are kept; the others are skipped as protobuf
// skips unknown fields.

class WireReader {
 public:
  explicit WireReader(absl::string_view data) : rest_(data) {}
  bool done() const { return rest_.empty(); }

  bool Varint(uint64_t* value) {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (rest_.empty()) return false;
      const uint8_t byte = static_cast<uint8_t>(rest_[0]);
      rest_.remove_prefix(1);
      v |= static_cast<uint64_t>(byte & 0x7F) << shift;
      if ((byte & 0x80) == 0) {
        *value = v;
        return true;
      }
    }
    return false;  // More than 10 bytes.
  }
  // A field key: number >= 1 and wire type.
  bool Key(uint32_t* field, uint32_t* wire_type) {
    uint64_t key = 0;
    if (!Varint(&key) || (key >> 3) == 0 || (key >> 3) > 0x1FFFFFFF) return false;
    *field = static_cast<uint32_t>(key >> 3);
    *wire_type = static_cast<uint32_t>(key & 7);
    return true;
  }
  bool Bytes(absl::string_view* out) {
    uint64_t length = 0;
    if (!Varint(&length) || length > rest_.size()) return false;
    *out = rest_.substr(0, static_cast<size_t>(length));
    rest_.remove_prefix(static_cast<size_t>(length));
    return true;
  }
  bool Fixed32(uint32_t* value) {
    if (rest_.size() < 4) return false;
    const auto* p = reinterpret_cast<const uint8_t*>(rest_.data());
    *value = static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
             static_cast<uint32_t>(p[3]) << 24;
    rest_.remove_prefix(4);
    return true;
  }
  // Skips a field's value; groups (wire types 3 and 4, unused by this format) are refused.
  bool Skip(uint32_t wire_type) {
    uint64_t v = 0;
    absl::string_view bytes;
    switch (wire_type) {
      case 0:
        return Varint(&v);
      case 1:
        if (rest_.size() < 8) return false;
        rest_.remove_prefix(8);
        return true;
      case 2:
        return Bytes(&bytes);
      case 5: {
        uint32_t bits = 0;
        return Fixed32(&bits);
      }
      default:
        return false;
    }
  }

 private:
  absl::string_view rest_;
};

struct Piece {
  std::string text;
  float score = 0.0f;
  int type = kNormal;
};

// The fields of ModelProto the encoder reads, with the .proto's defaults.
struct ModelFields {
  std::vector<Piece> pieces;
  int model_type = 1;  // UNIGRAM
  bool byte_fallback = false;
  bool treat_whitespace_as_suffix = false;
  std::string precompiled_charsmap;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
};

// Calls on_field(number, wire_type, reader) for each field. on_field returns 1 after reading the
// value, 0 for a malformed value, -1 for a field it does not read (skipped here).
template <typename OnField>
bool ParseMessage(absl::string_view data, OnField on_field) {
  WireReader in(data);
  while (!in.done()) {
    uint32_t field = 0, wire_type = 0;
    if (!in.Key(&field, &wire_type)) return false;
    const int handled = on_field(field, wire_type, in);  // 1 read, 0 malformed, -1 not a known field.
    if (handled == 0) return false;
    if (handled < 0 && !in.Skip(wire_type)) return false;
  }
  return true;
}

// A proto2 closed enum: values outside [lo, hi] leave the field as it was (protobuf keeps them as
// unknown fields).
int ReadEnum(WireReader& in, int lo, int hi, int* field) {
  uint64_t v = 0;
  if (!in.Varint(&v)) return 0;
  const int32_t value = static_cast<int32_t>(v);
  if (value >= lo && value <= hi) *field = value;
  return 1;
}

int ReadBool(WireReader& in, bool* field) {
  uint64_t v = 0;
  if (!in.Varint(&v)) return 0;
  *field = v != 0;
  return 1;
}

bool ParseModel(absl::string_view data, ModelFields* model) {
  return ParseMessage(data, [&](uint32_t field, uint32_t wire_type, WireReader& in) -> int {
    absl::string_view bytes;
    if (field == 1 && wire_type == 2) {  // pieces
      if (static_cast<int64_t>(model->pieces.size()) >= kMaxPieces) return 0;
      if (!in.Bytes(&bytes)) return 0;
      Piece piece;
      const bool ok = ParseMessage(bytes, [&](uint32_t f, uint32_t w, WireReader& p) -> int {
        absl::string_view text;
        uint32_t bits = 0;
        if (f == 1 && w == 2) {
          if (!p.Bytes(&text)) return 0;
          piece.text = std::string(text);
          return 1;
        }
        if (f == 2 && w == 5) {
          if (!p.Fixed32(&bits)) return 0;
          std::memcpy(&piece.score, &bits, sizeof(bits));
          return 1;
        }
        if (f == 3 && w == 0) return ReadEnum(p, kNormal, kByte, &piece.type);
        return -1;
      });
      if (!ok) return 0;
      model->pieces.push_back(std::move(piece));
      return 1;
    }
    if (field == 2 && wire_type == 2) {  // trainer_spec (occurrences merge, as protobuf merges them)
      if (!in.Bytes(&bytes)) return 0;
      return ParseMessage(bytes, [&](uint32_t f, uint32_t w, WireReader& p) -> int {
        if (f == 3 && w == 0) return ReadEnum(p, 1, 4, &model->model_type);
        if (f == 24 && w == 0) return ReadBool(p, &model->treat_whitespace_as_suffix);
        if (f == 35 && w == 0) return ReadBool(p, &model->byte_fallback);
        return -1;
      }) ? 1 : 0;
    }
    if (field == 3 && wire_type == 2) {  // normalizer_spec
      if (!in.Bytes(&bytes)) return 0;
      return ParseMessage(bytes, [&](uint32_t f, uint32_t w, WireReader& p) -> int {
        absl::string_view map;
        if (f == 2 && w == 2) {
          if (!p.Bytes(&map)) return 0;
          model->precompiled_charsmap = std::string(map);
          return 1;
        }
        if (f == 3 && w == 0) return ReadBool(p, &model->add_dummy_prefix);
        if (f == 4 && w == 0) return ReadBool(p, &model->remove_extra_whitespaces);
        if (f == 5 && w == 0) return ReadBool(p, &model->escape_whitespaces);
        return -1;
      }) ? 1 : 0;
    }
    return -1;
  });
}

// A byte trie over hash-map edges: node << 8 | byte → child; node 0 is the root.
class ByteTrie {
 public:
  ByteTrie() : value_(1, -1) {}
  bool empty() const { return edges_.empty(); }
  // False when `key` is there already.
  bool Insert(absl::string_view key, int32_t value) {
    int32_t node = 0;
    for (unsigned char byte : key) {
      auto [it, added] = edges_.try_emplace(Edge(node, byte), static_cast<int32_t>(value_.size()));
      if (added) value_.push_back(-1);
      node = it->second;
    }
    if (value_[node] >= 0) return false;
    value_[node] = value;
    return true;
  }
  // The child of `node` by `byte`, or -1.
  int32_t Child(int32_t node, unsigned char byte) const {
    auto it = edges_.find(Edge(node, byte));
    return it == edges_.end() ? -1 : it->second;
  }
  int32_t value(int32_t node) const { return value_[node]; }
  // Length of the longest key that is a prefix of `text` (0: none).
  size_t LongestPrefix(absl::string_view text) const {
    size_t longest = 0;
    int32_t node = 0;
    for (size_t i = 0; i < text.size() && (node = Child(node, static_cast<unsigned char>(text[i]))) >= 0; ++i) {
      if (value_[node] >= 0) longest = i + 1;
    }
    return longest;
  }

 private:
  static uint64_t Edge(int32_t node, unsigned char byte) { return static_cast<uint64_t>(node) << 8 | byte; }
  absl::flat_hash_map<uint64_t, int32_t> edges_;
  std::vector<int32_t> value_;  // Per node: the value of the key ending there, or -1.
};

// The precompiled normalisation rules of a NormalizerSpec: a Darts-clone double array whose keys
// are the source strings and whose values are offsets into NUL-separated replacement strings. Read
// with bounds checks on every index (the file is untrusted; Darts itself checks none).
class CharsMap {
 public:
  // INVALID_ARGUMENT reason, or OK; an empty blob means no rules.
  absl::Status Init(absl::string_view blob) {
    if (blob.empty()) return absl::OkStatus();
    if (blob.size() <= 4) return absl::InvalidArgumentError("the normalisation rules are truncated");
    const auto* p = reinterpret_cast<const uint8_t*>(blob.data());
    const uint64_t trie_bytes = static_cast<uint64_t>(p[0]) | static_cast<uint64_t>(p[1]) << 8 |
                                static_cast<uint64_t>(p[2]) << 16 | static_cast<uint64_t>(p[3]) << 24;
    if (trie_bytes > blob.size() - 4) return absl::InvalidArgumentError("the normalisation rules are truncated");
    units_.resize(static_cast<size_t>(trie_bytes / 4));
    for (size_t i = 0; i < units_.size(); ++i) {
      const uint8_t* u = p + 4 + 4 * i;
      units_[i] = static_cast<uint32_t>(u[0]) | static_cast<uint32_t>(u[1]) << 8 | static_cast<uint32_t>(u[2]) << 16 |
                  static_cast<uint32_t>(u[3]) << 24;
    }
    strings_ = std::string(blob.substr(static_cast<size_t>(4 + trie_bytes)));
    return absl::OkStatus();
  }
  bool empty() const { return units_.empty(); }

  // The longest rule whose source is a prefix of `text`: its length (0: none) and replacement.
  // False when the table points outside itself.
  bool Longest(absl::string_view text, size_t* length, absl::string_view* replacement) const {
    *length = 0;
    size_t node = Offset(units_[0]);
    int64_t value = -1;
    for (size_t i = 0; i < text.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(text[i]);
      node ^= c;
      if (node >= units_.size()) break;
      const uint32_t unit = units_[node];
      if ((unit & ((1U << 31) | 0xFF)) != c) break;  // Label mismatch (leaf units never match).
      node ^= Offset(unit);
      if ((unit >> 8) & 1) {  // Has a leaf: the value of the key text[0, i].
        if (node >= units_.size()) return false;
        value = units_[node] & ((1U << 31) - 1);
        *length = i + 1;
      }
    }
    if (*length == 0) return true;
    if (static_cast<uint64_t>(value) >= strings_.size()) return false;
    const size_t end = strings_.find('\0', static_cast<size_t>(value));
    *replacement = absl::string_view(strings_).substr(static_cast<size_t>(value),
                                                       end == std::string::npos ? std::string::npos : end - value);
    return true;
  }

 private:
  static size_t Offset(uint32_t unit) { return (unit >> 10) << ((unit & (1U << 9)) >> 6); }
  std::vector<uint32_t> units_;
  std::string strings_;
};

// SentencePiece's UTF-8 decoding (util.cc DecodeUTF8 + IsValidDecodeUTF8): the length of the
// well-formed character at the start of `s`, or false (then one byte).
bool DecodeOneChar(absl::string_view s, size_t* length) {
  const auto* b = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  auto trail = [](uint8_t x) { return (x & 0xC0) == 0x80; };
  auto valid = [](uint32_t c) { return c < 0xD800 || (c >= 0xE000 && c <= 0x10FFFF); };
  *length = 1;
  if (b[0] < 0x80) return true;
  if (n >= 2 && (b[0] & 0xE0) == 0xC0) {
    const uint32_t c = (b[0] & 0x1Fu) << 6 | (b[1] & 0x3Fu);
    if (trail(b[1]) && c >= 0x80 && valid(c)) { *length = 2; return true; }
  } else if (n >= 3 && (b[0] & 0xF0) == 0xE0) {
    const uint32_t c = (b[0] & 0x0Fu) << 12 | (b[1] & 0x3Fu) << 6 | (b[2] & 0x3Fu);
    if (trail(b[1]) && trail(b[2]) && c >= 0x800 && valid(c)) { *length = 3; return true; }
  } else if (n >= 4 && (b[0] & 0xF8) == 0xF0) {
    const uint32_t c = (b[0] & 0x07u) << 18 | (b[1] & 0x3Fu) << 12 | (b[2] & 0x3Fu) << 6 | (b[3] & 0x3Fu);
    if (trail(b[1]) && trail(b[2]) && trail(b[3]) && c >= 0x10000 && valid(c)) { *length = 4; return true; }
  }
  return false;
}

// util.h OneCharLen: the length a lead byte announces, not checked.
size_t OneCharLen(unsigned char lead) { return "\1\1\1\1\1\1\1\1\1\1\1\1\2\2\3\4"[lead >> 4]; }

std::string BytePiece(int byte) { return absl::StrFormat("<0x%02X>", byte); }

}  // namespace

struct T5Tokenizer::State {
  bool byte_level = false;
  std::string source;  // Names the file in errors.
  std::vector<float> scores;
  std::vector<int> types;
  ByteTrie pieces;         // NORMAL, USER_DEFINED and UNUSED pieces → id.
  ByteTrie user_defined;   // USER_DEFINED pieces (never normalised).
  float min_score = FLT_MAX;
  float max_score = FLT_MIN;  // As unigram_model.cc starts it (so never below FLT_MIN).
  int32_t unk_id = -1;
  bool byte_fallback = false;
  std::array<int32_t, 256> byte_ids{};
  CharsMap charsmap;
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
  bool escape_whitespaces = true;
  bool treat_whitespace_as_suffix = false;
  int64_t max_id = 0;

  // normalizer.cc NormalizePrefix: what the start of `input` becomes, and how many bytes it takes.
  absl::Status NormalizePrefix(absl::string_view input, absl::string_view* out, size_t* consumed) const {
    if (!user_defined.empty()) {
      if (const size_t n = user_defined.LongestPrefix(input); n > 0) {
        *out = input.substr(0, n);
        *consumed = n;
        return absl::OkStatus();
      }
    }
    if (!charsmap.empty()) {
      size_t n = 0;
      if (!charsmap.Longest(input, &n, out)) {
        return absl::InvalidArgumentError(
            absl::StrCat(source, ": the normalisation rules point outside themselves"));
      }
      if (n > 0) {
        *consumed = n;
        return absl::OkStatus();
      }
    }
    size_t n = 0;
    if (DecodeOneChar(input, &n)) {
      *out = input.substr(0, n);
    } else {
      *out = kReplacementChar;  // A malformed byte becomes U+FFFD, one byte consumed.
    }
    *consumed = n;
    return absl::OkStatus();
  }

  // normalizer.cc Normalize.
  absl::Status Normalize(absl::string_view input, std::string* normalized) const {
    normalized->clear();
    absl::string_view piece;
    size_t consumed = 0;
    if (remove_extra_whitespaces) {  // Leading whitespace.
      while (!input.empty()) {
        RETURN_IF_ERROR(NormalizePrefix(input, &piece, &consumed));
        if (piece != " ") break;
        input.remove_prefix(consumed);
      }
    }
    if (input.empty()) return absl::OkStatus();
    normalized->reserve(input.size() * 3);
    const size_t max_normalized = static_cast<size_t>(kMaxExpansion) * (input.size() + 1);
    const absl::string_view space = escape_whitespaces ? kSpaceSymbol : " ";
    auto add_space = [&] { normalized->append(space.data(), space.size()); };
    if (!treat_whitespace_as_suffix && add_dummy_prefix) add_space();
    bool is_prev_space = remove_extra_whitespaces;
    while (!input.empty()) {
      RETURN_IF_ERROR(NormalizePrefix(input, &piece, &consumed));
      while (is_prev_space && absl::ConsumePrefix(&piece, " ")) {
      }
      if (!piece.empty()) {
        for (char c : piece) {
          if (escape_whitespaces && c == ' ') {
            normalized->append(kSpaceSymbol.data(), kSpaceSymbol.size());
          } else {
            *normalized += c;
          }
        }
        is_prev_space = absl::EndsWith(piece, " ");
        if (normalized->size() > max_normalized) {
          return absl::InvalidArgumentError(absl::StrCat(source, ": the normalisation rules expand the text more than ",
                                                         kMaxExpansion, "-fold"));
        }
      }
      input.remove_prefix(consumed);
      if (!remove_extra_whitespaces) is_prev_space = false;
    }
    if (remove_extra_whitespaces) {  // Trailing whitespace.
      while (absl::EndsWith(*normalized, space)) normalized->resize(normalized->size() - space.size());
    }
    if (treat_whitespace_as_suffix && add_dummy_prefix) add_space();
    return absl::OkStatus();
  }

  // unigram_model.cc EncodeOptimized (Viterbi over byte positions), then
  // sentencepiece_processor.cc's rules for unknown pieces: a run of them is one <unk>, or with
  // byte fallback each of their bytes a <0xXX> piece. Scores are summed in the same float/double
  // types as there, so ties fall the same way.
  absl::Status EncodeNormalized(absl::string_view text, std::vector<int64_t>& ids) const {
    if (text.empty()) return absl::OkStatus();
    struct BestPathNode {
      int32_t id = -1;
      float best_path_score = 0.0f;
      int64_t starts_at = -1;
    };
    const int64_t size = static_cast<int64_t>(text.size());
    const float unk_score = min_score - kUnkPenalty;
    std::vector<BestPathNode> best(static_cast<size_t>(size + 1));
    for (int64_t starts_at = 0; starts_at < size;) {
      const float best_path_score_till_here = best[starts_at].best_path_score;
      bool has_single_node = false;
      const int64_t mblen =
          std::min<int64_t>(static_cast<int64_t>(OneCharLen(static_cast<unsigned char>(text[starts_at]))),
                            size - starts_at);
      int32_t node = 0;
      for (int64_t key_pos = starts_at; key_pos < size;) {
        node = pieces.Child(node, static_cast<unsigned char>(text[key_pos]));
        if (node < 0) break;
        ++key_pos;
        const int32_t id = pieces.value(node);
        if (id < 0 || types[id] == kUnused) continue;
        BestPathNode& target = best[key_pos];
        const size_t length = static_cast<size_t>(key_pos - starts_at);
        const double score =
            types[id] == kUserDefined ? static_cast<float>(length) * max_score - 0.1 : static_cast<double>(scores[id]);
        const double candidate = score + best_path_score_till_here;
        if (target.starts_at == -1 || candidate > target.best_path_score) {
          target.best_path_score = static_cast<float>(candidate);
          target.starts_at = starts_at;
          target.id = id;
        }
        if (!has_single_node && static_cast<int64_t>(length) == mblen) has_single_node = true;
      }
      if (!has_single_node) {
        BestPathNode& target = best[starts_at + mblen];
        const float candidate = unk_score + best_path_score_till_here;
        if (target.starts_at == -1 || candidate > target.best_path_score) {
          target.best_path_score = candidate;
          target.starts_at = starts_at;
          target.id = unk_id;
        }
      }
      starts_at += mblen;
    }
    std::vector<std::pair<absl::string_view, int32_t>> path;
    for (int64_t ends_at = size; ends_at > 0;) {
      const BestPathNode& node = best[ends_at];
      if (node.starts_at < 0) return absl::InternalError("unigram lattice has no path");
      path.emplace_back(text.substr(node.starts_at, ends_at - node.starts_at), node.id);
      ends_at = node.starts_at;
    }
    std::reverse(path.begin(), path.end());
    bool is_prev_unk = false;
    for (const auto& [piece, id] : path) {
      const bool is_unk = id == unk_id;
      if (is_unk && byte_fallback) {
        for (unsigned char b : piece) ids.push_back(byte_ids[b]);
      } else if (!(is_unk && is_prev_unk)) {
        ids.push_back(id);
      }
      is_prev_unk = is_unk;
    }
    return absl::OkStatus();
  }
};

T5Tokenizer::T5Tokenizer() : state_(std::make_unique<State>()) {}
T5Tokenizer::~T5Tokenizer() = default;

absl::StatusOr<std::unique_ptr<T5Tokenizer>> T5Tokenizer::Load(const std::string& dir) {
  const std::string path = dir + "/spiece.model";
  ASSIGN_OR_RETURN(std::string bytes, ReadFileAtMost(path, kMaxModelBytes));
  return FromBytes(bytes, path);
}

absl::StatusOr<std::unique_ptr<T5Tokenizer>> T5Tokenizer::FromBytes(const std::string& bytes,
                                                                   const std::string& source) {
  const std::string& path = source;
  auto bad = [&](const std::string& why) { return absl::InvalidArgumentError(absl::StrCat(path, ": ", why)); };
  if (static_cast<int64_t>(bytes.size()) > kMaxModelBytes) {
    return bad(absl::StrCat(bytes.size(), " bytes exceeds the limit of ", kMaxModelBytes, " bytes"));
  }
  ModelFields model;
  if (!ParseModel(bytes, &model)) {
    return bad(absl::StrCat("not a SentencePiece model (malformed protobuf, or more than ", kMaxPieces, " pieces)"));
  }
  if (model.model_type != 1) {
    return bad(absl::StrCat("model_type ", model.model_type, " is not supported (Unigram, 1, only)"));
  }
  if (model.pieces.empty()) return bad("no pieces");
  std::unique_ptr<T5Tokenizer> t(new T5Tokenizer());
  State& s = *t->state_;
  s.source = path;
  s.byte_fallback = model.byte_fallback;
  s.treat_whitespace_as_suffix = model.treat_whitespace_as_suffix;
  s.add_dummy_prefix = model.add_dummy_prefix;
  s.remove_extra_whitespaces = model.remove_extra_whitespaces;
  s.escape_whitespaces = model.escape_whitespaces;
  if (absl::Status status = s.charsmap.Init(model.precompiled_charsmap); !status.ok()) return bad(std::string(status.message()));
  // model_interface.cc InitializePieces: NORMAL, USER_DEFINED and UNUSED pieces are looked up by
  // text, the others (CONTROL, UNKNOWN, BYTE) are reserved; each set has no repeats.
  absl::flat_hash_map<std::string, int32_t> reserved;
  absl::flat_hash_map<std::string, int> byte_of_piece;
  for (int b = 0; b < 256; ++b) byte_of_piece[BytePiece(b)] = b;
  std::array<bool, 256> byte_found{};
  bool has_lookup_piece = false;
  s.scores.reserve(model.pieces.size());
  s.types.reserve(model.pieces.size());
  for (size_t i = 0; i < model.pieces.size(); ++i) {
    const Piece& piece = model.pieces[i];
    const int32_t id = static_cast<int32_t>(i);
    s.scores.push_back(piece.score);
    s.types.push_back(piece.type);
    if (piece.text.empty() || piece.text.find('\0') != std::string::npos) {
      return bad(absl::StrCat("piece ", id, " is empty or holds a NUL byte"));
    }
    if (static_cast<int64_t>(piece.text.size()) > kMaxPieceBytes) {
      return bad(absl::StrCat("piece ", id, " is longer than ", kMaxPieceBytes, " bytes"));
    }
    const bool lookup = piece.type == kNormal || piece.type == kUserDefined || piece.type == kUnused;
    if (lookup ? !s.pieces.Insert(piece.text, id) : !reserved.emplace(piece.text, id).second) {
      return bad(absl::StrCat("piece '", Truncated(piece.text), "' (", id, ") is defined twice"));
    }
    has_lookup_piece |= lookup;
    if (piece.type == kUserDefined) s.user_defined.Insert(piece.text, id);
    if (piece.type == kNormal) {
      s.min_score = std::min(s.min_score, piece.score);
      s.max_score = std::max(s.max_score, piece.score);
    }
    if (piece.type == kUnknown) {
      if (s.unk_id >= 0) return bad("more than one unknown piece");
      s.unk_id = id;
    }
    if (piece.type == kByte) {
      auto it = byte_of_piece.find(piece.text);
      if (!model.byte_fallback || it == byte_of_piece.end()) {
        return bad(absl::StrCat("byte piece '", Truncated(piece.text), "' without byte_fallback, or not <0xXX>"));
      }
      byte_found[it->second] = true;
      s.byte_ids[it->second] = id;
    }
    if (piece.type != kUnused && piece.type != kControl) s.max_id = std::max<int64_t>(s.max_id, id);
  }
  if (s.unk_id < 0) return bad("no unknown piece");
  if (!has_lookup_piece) return bad("no normal pieces");
  if (model.byte_fallback && std::find(byte_found.begin(), byte_found.end(), false) != byte_found.end()) {
    return bad("byte_fallback without all 256 byte pieces");
  }
  // transformers looks the special tokens up by text (SentencePieceProcessor::PieceToId: reserved
  // pieces first, then the others, else <unk>): they must be the ids this class promises.
  auto piece_to_id = [&](const std::string& text) -> int64_t {
    if (auto it = reserved.find(text); it != reserved.end()) return it->second;
    int32_t node = 0;
    for (unsigned char b : text) {
      if ((node = s.pieces.Child(node, b)) < 0) return s.unk_id;
    }
    return s.pieces.value(node) >= 0 ? s.pieces.value(node) : s.unk_id;
  };
  if (piece_to_id("<pad>") != kPad || piece_to_id("</s>") != kEos) {
    return bad(absl::StrCat("<pad> must be id ", kPad, " and </s> id ", kEos, " (T5's layout); they are ",
                            piece_to_id("<pad>"), " and ", piece_to_id("</s>")));
  }
  s.max_id = std::max<int64_t>(s.max_id, kEos);
  return t;
}

std::unique_ptr<T5Tokenizer> T5Tokenizer::ByteLevel() {
  std::unique_ptr<T5Tokenizer> t(new T5Tokenizer());
  t->state_->byte_level = true;
  t->state_->max_id = 255 + 3;
  return t;
}

absl::StatusOr<std::vector<int64_t>> T5Tokenizer::Encode(const std::string& text, int64_t max_length) const {
  if (max_length < 1 || max_length > kMaxLength) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_length ", max_length, " is outside [1, ", kMaxLength, "] (T5's ids end with </s>)"));
  }
  const State& s = *state_;
  std::vector<int64_t> ids;
  if (s.byte_level) {
    for (unsigned char b : text) ids.push_back(int64_t{b} + 3);
  } else {
    std::string normalized;
    RETURN_IF_ERROR(s.Normalize(text, &normalized));
    RETURN_IF_ERROR(s.EncodeNormalized(normalized, ids));
  }
  if (static_cast<int64_t>(ids.size()) > max_length - 1) ids.resize(static_cast<size_t>(max_length - 1));
  ids.push_back(kEos);
  ids.resize(static_cast<size_t>(max_length), kPad);
  return ids;
}

int64_t T5Tokenizer::max_id() const { return state_->max_id; }

}  // namespace stowage
