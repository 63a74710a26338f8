#include "models/tokenizers/bpe_tokenizer.h"

#include <fstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace stowage {
namespace {

// GPT-2's byte → unicode mapping, written out independently of the implementation.
std::string ByteSymbol(int b) {
  const bool direct = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
  int cp = b;
  if (!direct) {
    int n = 0;
    for (int i = 0; i < b; ++i) {
      if (!((i >= '!' && i <= '~') || (i >= 0xA1 && i <= 0xAC) || (i >= 0xAE))) ++n;
    }
    cp = 256 + n;
  }
  std::string out;
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return out;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out;
}

// A byte-level BPE with Qwen2's pre-tokenizer and NFC: byte b has id b; "he"=256, "the"=257,
// "Ġthe"=258; special tokens 300 and 301.
std::string WriteTokenizer(const std::string& extra_added = "") {
  std::string vocab;
  for (int b = 0; b < 256; ++b) vocab += "\"" + Escape(ByteSymbol(b)) + "\": " + std::to_string(b) + ", ";
  vocab += "\"he\": 256, \"the\": 257, \"" + ByteSymbol(' ') + "the\": 258";
  const std::string pattern =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+)";
  const std::string json = "{\"added_tokens\": [{\"id\": 300, \"content\": \"<|im_start|>\"}, "
                           "{\"id\": 301, \"content\": \"<|im_end|>\"}" + extra_added + "], "
                           "\"normalizer\": {\"type\": \"NFC\"}, "
                           "\"pre_tokenizer\": {\"type\": \"Sequence\", \"pretokenizers\": ["
                           "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"" + pattern + "\"}, \"behavior\": \"Isolated\"}, "
                           "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"use_regex\": false}]}, "
                           "\"model\": {\"type\": \"BPE\", \"vocab\": {" + vocab + "}, "
                           "\"merges\": [\"h e\", \"t he\", \"" + ByteSymbol(' ') + " the\"]}}";
  const std::string path = std::string(::testing::TempDir()) + "/tokenizer.json";
  std::ofstream(path) << json;
  return path;
}

TEST(BpeTokenizerTest, EncodesLikeByteLevelBpe) {
  auto tokenizer = BpeTokenizer::Load(WriteTokenizer());
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto encode = [&](const std::string& s) { return *(*tokenizer)->Encode(s); };
  EXPECT_EQ(encode("the the"), (std::vector<int64_t>{257, 258}));                 // merges by rank
  EXPECT_EQ(encode("<|im_start|>user\nthe<|im_end|>"),
            (std::vector<int64_t>{300, 'u', 's', 'e', 'r', '\n', 257, 301}));       // special tokens
  EXPECT_EQ(encode("\xe4\xb8\xad\xe6\x96\x87"), (std::vector<int64_t>{0xe4, 0xb8, 0xad, 0xe6, 0x96, 0x87}));  // CJK
  EXPECT_EQ(encode("\xf0\x9f\x91\x8d!"), (std::vector<int64_t>{0xf0, 0x9f, 0x91, 0x8d, '!'}));  // emoji
  EXPECT_EQ(encode("a   b"), (std::vector<int64_t>{'a', ' ', ' ', ' ', 'b'}));      // whitespace runs
  EXPECT_EQ(encode("e\xcc\x81"), (std::vector<int64_t>{0xc3, 0xa9}));             // NFC: e + U+0301 → é
  EXPECT_EQ(encode(""), (std::vector<int64_t>{}));
  EXPECT_EQ(*(*tokenizer)->TokenId("<|im_end|>"), 301);
  EXPECT_EQ((*tokenizer)->TokenId("<|nope|>").status().code(), absl::StatusCode::kNotFound);
}

TEST(BpeTokenizerTest, AddedTokensMatchLongestFirstWhateverTheirOrder) {
  // Overlapping added tokens, the shorter listed first; a duplicate content keeps its first id.
  auto tokenizer = BpeTokenizer::Load(WriteTokenizer(
      ", {\"id\": 310, \"content\": \"<a>\"}, {\"id\": 311, \"content\": \"<a><b>\"}, "
      "{\"id\": 312, \"content\": \"<a><b>\"}, {\"id\": 313, \"content\": \"<a><b><c>\"}"));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  auto encode = [&](const std::string& s) { return *(*tokenizer)->Encode(s); };
  EXPECT_EQ(encode("<a><b><c>"), (std::vector<int64_t>{313}));
  EXPECT_EQ(encode("<a><b><"), (std::vector<int64_t>{311, '<'}));
  EXPECT_EQ(encode("x<a><a><b>"), (std::vector<int64_t>{'x', 310, 311}));
  EXPECT_EQ(encode("<a<b>"), (std::vector<int64_t>{'<', 'a', '<', 'b', '>'}));
}

TEST(BpeTokenizerTest, RejectsWhatItCannotReproduce) {
  const std::string path = std::string(::testing::TempDir()) + "/wordpiece.json";
  std::ofstream(path) << R"({"model": {"type": "WordPiece", "vocab": {}}})";
  auto loaded = BpeTokenizer::Load(path);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(loaded.status().message()).find("model.type must be BPE"), std::string::npos);
  EXPECT_EQ(BpeTokenizer::Load("/nonexistent/tokenizer.json").status().code(), absl::StatusCode::kNotFound);
}

// Hostile tokenizer.json: INVALID_ARGUMENT (never a crash), without quoting the file.
TEST(BpeTokenizerTest, RejectsHostileTokenizersWithoutQuotingThem) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"{\"model\": " + std::string(100000, '['), "nests deeper than 32"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 1.5}}})", "model.vocab entry 'a'"},
      {R"({"model": {"type": "BPE", "vocab": {"a": -1}}})", "model.vocab entry 'a'"},
      {R"({"model": {"type": "BPE", "vocab": {"a": 1e300}}})", "model.vocab entry 'a'"},
      {R"({"model": {"type": "BPE", "vocab": {"a": "sk-SECRET"}}})", "model.vocab entry 'a'"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": ["sk-SECRET-no-space"]}})", "malformed merge at index 0"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": [["a", 5]]}})", "malformed merge at index 0"},
      {R"({"model": {"type": "BPE", "vocab": {}, "merges": 5}})", "model.merges is not a list"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "added_tokens": [{"content": "x"}]})", "added_tokens[0]"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "added_tokens": [5]})", "added_tokens[0]"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "added_tokens": [{"content": "", "id": 3}]})", "added_tokens[0]"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": {"type": "Sequence"}})", "without pretokenizers"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{}]}})",
       "unsupported pre-tokenizer ''"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": {"type": "Split", "pattern": 5}})",
       "without a Regex"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "pre_tokenizer": 5})", "pre_tokenizer is not an object"},
      {R"({"model": {"type": "BPE", "vocab": {}}, "normalizer": {"type": "Lowercase"}})", "unsupported normalizer 'Lowercase'"},
      {R"({"model": {"type": "BPE", "vocab": {}, "secret": "sk-SECRET",, }})", "not a valid JSON object"},
  };
  for (const auto& [json, needle] : cases) {
    auto t = BpeTokenizer::FromJsonText(json, "tok/tokenizer.json");
    ASSERT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << json.substr(0, 80) << ": " << t.status();
    const std::string message(t.status().message());
    EXPECT_NE(message.find("tok/tokenizer.json"), std::string::npos) << message;
    EXPECT_NE(message.find(needle), std::string::npos) << message;
    EXPECT_EQ(message.find("SECRET"), std::string::npos) << message;
    EXPECT_LT(message.size(), 300u) << message;
  }
  auto ok = BpeTokenizer::FromJsonText(R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 7}},
      "added_tokens": [{"content": "<x>", "id": 9}]})", "tok");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)->max_id(), 9);
}

}  // namespace
}  // namespace stowage
