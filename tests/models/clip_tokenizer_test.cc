// ClipTokenizer on a small hand-written vocab.json / merges.txt: every expected id below is worked
// out by hand from the algorithm (normalise: NFC, whitespace runs to one space, lower case; split
// with CLIP's pattern; bytes to GPT-2's symbols; "</w>" on a word's last symbol; merges by rank;
// frame with <|startoftext|> ... <|endoftext|>, cut, pad with <|endoftext|>).
#include "models/tokenizers/clip_tokenizer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace stowage {
namespace {

using ::testing::HasSubstr;

// GPT-2's byte → unicode symbol, written out independently of the implementation.
std::string ByteSymbol(int b) {
  auto direct = [](int x) { return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE; };
  int cp = b;
  if (!direct(b)) {
    cp = 256;
    for (int i = 0; i < b; ++i) cp += !direct(i);
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

std::string JsonString(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += c;
  }
  return out + "\"";
}

std::string NewDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

// The vocabulary, in CLIP's layout: byte b is id b, byte b ending a word ("</w>") is 256 + b —
// except "z</w>", left out so that a word ending in z has an unknown symbol — then the merges'
// results from 512, then the two special tokens.
constexpr int64_t kHe = 512, kLoEnd = 513, kLl = 514, kHell = 515, kHelloEnd = 516, kTh = 517, kTheEnd = 518,
                  kAa = 519, kCa = 520, kCatEnd = 521, kApostropheSEnd = 522, kBos = 523, kEos = 524;
constexpr int64_t End(char c) { return 256 + static_cast<unsigned char>(c); }

const char kMerges[] =
    "#version: 0.2\n"
    "h e\n"          // rank 0: he
    "l o</w>\n"      // rank 1: lo</w>
    "l l\n"          // rank 2: ll
    "he ll\n"        // rank 3: hell
    "hell o</w>\n"   // rank 4: hello</w>
    "t h\n"          // rank 5: th
    "th e</w>\n"     // rank 6: the</w>
    "a a\n"          // rank 7: aa
    "c a\n"          // rank 8: ca
    "ca t</w>\n"     // rank 9: cat</w>
    "' s</w>\n";     // rank 10: 's</w>

std::string VocabJson(bool with_bos = true) {
  std::string json = "{";
  for (int b = 0; b < 256; ++b) {
    json += JsonString(ByteSymbol(b)) + ": " + std::to_string(b) + ", ";
    if (b != 'z') json += JsonString(ByteSymbol(b) + "</w>") + ": " + std::to_string(256 + b) + ", ";
  }
  const char* merged[] = {"he", "lo</w>", "ll", "hell", "hello</w>", "th", "the</w>", "aa", "ca", "cat</w>", "'s</w>"};
  for (int i = 0; i < 11; ++i) json += JsonString(merged[i]) + ": " + std::to_string(512 + i) + ", ";
  if (with_bos) json += "\"<|startoftext|>\": 523, ";
  return json + "\"<|endoftext|>\": 524}";
}

std::string WriteTokenizer(const std::string& name, const std::string& vocab, const std::string& merges) {
  const std::string dir = NewDir(name);
  std::ofstream(dir + "/vocab.json") << vocab;
  std::ofstream(dir + "/merges.txt") << merges;
  return dir;
}

class ClipTokenizerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto loaded = ClipTokenizer::Load(WriteTokenizer("clip", VocabJson(), kMerges));
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    tokenizer_ = *std::move(loaded);
  }
  // The text's tokens: Encode with room to spare, without the frame and the padding.
  std::vector<int64_t> Tokens(const std::string& text) {
    auto ids = tokenizer_->Encode(text, 77);
    EXPECT_TRUE(ids.ok()) << ids.status();
    if (!ids.ok()) return {};
    EXPECT_EQ(ids->front(), kBos);
    auto end = std::find(ids->begin() + 1, ids->end(), kEos);
    EXPECT_NE(end, ids->end());
    return std::vector<int64_t>(ids->begin() + 1, end);
  }
  std::unique_ptr<ClipTokenizer> tokenizer_;
};

TEST_F(ClipTokenizerTest, MergesByRankNotLeftToRight) {
  // h e l l o</w>: "h e" (rank 0), then "l o</w>" (rank 1) before "l l" (rank 2) could apply; then
  // nothing merges "he", "l", "lo</w>".
  EXPECT_EQ(Tokens("hello"), (std::vector<int64_t>{kHe, 'l', kLoEnd}));
  EXPECT_EQ(Tokens("the"), (std::vector<int64_t>{kTheEnd}));                   // t h → th, th e</w> → the</w>
  EXPECT_EQ(Tokens("cat"), (std::vector<int64_t>{kCatEnd}));                   // c a → ca, ca t</w> → cat</w>
  EXPECT_EQ(Tokens("cats"), (std::vector<int64_t>{kCa, 't', End('s')}));       // "ca t" is no merge
  // a a a a</w>: the occurrences of "a a" merge left to right without overlap: aa, then (a, a</w>)
  // is no merge.
  EXPECT_EQ(Tokens("aaaa"), (std::vector<int64_t>{kAa, 'a', End('a')}));
  EXPECT_EQ(Tokens("aaa"), (std::vector<int64_t>{kAa, End('a')}));
  EXPECT_EQ(Tokens("x"), (std::vector<int64_t>{End('x')}));
}

TEST_F(ClipTokenizerTest, NormalisesLikeTransformers) {
  // Lower case, whitespace runs (tabs, newlines, U+00A0, U+3000, U+0085) are word breaks.
  EXPECT_EQ(Tokens("  HELLO\t\n The  "), (std::vector<int64_t>{kHe, 'l', kLoEnd, kTheEnd}));
  EXPECT_EQ(Tokens("cat\xc2\xa0" "cat\xe3\x80\x80" "cat\xc2\x85" "cat"),
            (std::vector<int64_t>{kCatEnd, kCatEnd, kCatEnd, kCatEnd}));
  // U+200B is no whitespace: a piece of its own (bytes E2 80 8B).
  EXPECT_EQ(Tokens("cat\xe2\x80\x8b" "cat"), (std::vector<int64_t>{kCatEnd, 0xE2, 0x80, End('\x8b'), kCatEnd}));
  // NFC: e + U+0301 is é (C3 A9); É lower-cased is é too.
  const std::vector<int64_t> e_acute = {0xC3, End('\xa9')};
  EXPECT_EQ(Tokens("e\xcc\x81"), e_acute);
  EXPECT_EQ(Tokens("\xc3\xa9"), e_acute);
  EXPECT_EQ(Tokens("\xc3\x89"), e_acute);
  // U+0130 lower-cases to i + U+0307 (Unicode's full mapping); U+0307 is no letter: its own piece.
  EXPECT_EQ(Tokens("\xc4\xb0"), (std::vector<int64_t>{End('i'), 0xCC, End('\x87')}));
  // A run of CJK letters is one word (transformers 5 / the tokenizers library; the 4.x slow
  // tokenizer without ftfy made each ideograph a word).
  EXPECT_EQ(Tokens("\xe6\x97\xa5\xe6\x9c\xac"), (std::vector<int64_t>{0xE6, 0x97, 0xA5, 0xE6, 0x9C, End('\xac')}));
  // Control characters stay (as punctuation).
  EXPECT_EQ(Tokens("a\x07" "b"), (std::vector<int64_t>{End('a'), End('\x07'), End('b')}));
}

TEST_F(ClipTokenizerTest, SplitsWithClipsPattern) {
  EXPECT_EQ(Tokens("it's"), (std::vector<int64_t>{'i', End('t'), kApostropheSEnd}));  // "'s" is its own word
  EXPECT_EQ(Tokens("IT'S"), (std::vector<int64_t>{'i', End('t'), kApostropheSEnd}));
  EXPECT_EQ(Tokens("a 42"), (std::vector<int64_t>{End('a'), End('4'), End('2')}));   // one digit a word
  EXPECT_EQ(Tokens("hi!!?"), (std::vector<int64_t>{'h', End('i'), '!', '!', End('?')}));  // punctuation runs
  // "z</w>" is not in the vocabulary: <unk>, which is <|endoftext|>.
  EXPECT_EQ(*tokenizer_->Encode("zz a", 6), (std::vector<int64_t>{kBos, 'z', kEos, End('a'), kEos, kEos}));
  EXPECT_EQ(Tokens(""), (std::vector<int64_t>{}));
  EXPECT_EQ(Tokens(" \t "), (std::vector<int64_t>{}));
}

TEST_F(ClipTokenizerTest, SpecialTokensWrittenExactlyAreTheirIds) {
  auto ids = tokenizer_->Encode("a <|endoftext|> cat<|startoftext|>", 8);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int64_t>{kBos, End('a'), kEos, kCatEnd, kBos, kEos, kEos, kEos}));
  // Other spellings are text: lower-cased, then "<|", "endoftext", "|>" (as the tokenizers
  // library's ByteLevel step re-splits the pattern's special alternatives).
  EXPECT_EQ(Tokens("<|ENDOFTEXT|>"), (std::vector<int64_t>{'<', End('|'), 'e', 'n', 'd', 'o', 'f', 't', 'e', 'x',
                                                           End('t'), '|', End('>')}));
}

TEST_F(ClipTokenizerTest, FramesCutsAndPadsAsDiffusersCallsIt) {
  EXPECT_EQ(*tokenizer_->Encode("hello", 8), (std::vector<int64_t>{kBos, kHe, 'l', kLoEnd, kEos, kEos, kEos, kEos}));
  // Cut to max_length - 2 tokens, <|endoftext|> kept last.
  EXPECT_EQ(*tokenizer_->Encode("the the the the", 5), (std::vector<int64_t>{kBos, kTheEnd, kTheEnd, kTheEnd, kEos}));
  EXPECT_EQ(*tokenizer_->Encode("hello", 4), (std::vector<int64_t>{kBos, kHe, 'l', kEos}));
  EXPECT_EQ(*tokenizer_->Encode("hello", 2), (std::vector<int64_t>{kBos, kEos}));
  auto ids = tokenizer_->Encode("the cat", 77);
  ASSERT_TRUE(ids.ok());
  ASSERT_EQ(ids->size(), 77u);
  EXPECT_EQ(std::count(ids->begin(), ids->end(), kEos), 77 - 3);
  EXPECT_EQ(tokenizer_->bos_id(), kBos);
  EXPECT_EQ(tokenizer_->eos_id(), kEos);
  EXPECT_EQ(tokenizer_->max_id(), kEos);
}

TEST_F(ClipTokenizerTest, LongInputIsLinear) {
  // One 400,000-byte word and 1 MB of short words: well within the test's time (a quadratic merge
  // loop would take minutes on the first).
  auto word = tokenizer_->Encode(std::string(400'000, 'a'), 77);
  ASSERT_TRUE(word.ok());
  EXPECT_EQ((*word)[1], kAa);
  std::string text;
  while (text.size() < 1'000'000) text += "hello the cat, ";
  auto words = tokenizer_->Encode(text, 77);
  ASSERT_TRUE(words.ok());
  EXPECT_EQ(words->back(), kEos);
}

TEST(ClipTokenizerByteLevelTest, EveryByteOneTokenWithTheWordEndMarked) {
  auto tokenizer = ClipTokenizer::ByteLevel();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->bos_id(), 512);
  EXPECT_EQ(tokenizer->eos_id(), 513);
  EXPECT_EQ(tokenizer->max_id(), 513);
  // "Hi, \xc3\xa9!" → "hi" "," "é" "!": a word's last byte is 256 + byte.
  EXPECT_EQ(*tokenizer->Encode("Hi, \xc3\xa9!", 10),
            (std::vector<int64_t>{512, 'h', 256 + 'i', 256 + ',', 0xC3, 256 + 0xA9, 256 + '!', 513, 513, 513}));
  // Properties on random text: framed, every id in range, padding with <|endoftext|>.
  std::mt19937 rng(3);
  const std::vector<std::string> alphabet = {"a", "B", " ", "\t", "1", "!", "'s", "\xc3\xa9", "\xe6\x97\xa5",
                                             "\xf0\x9f\x98\x80", "<|endoftext|>"};
  for (int i = 0; i < 200; ++i) {
    std::string text;
    for (int k = static_cast<int>(rng() % 30); k > 0; --k) text += alphabet[rng() % alphabet.size()];
    auto ids = tokenizer->Encode(text, 20);
    ASSERT_TRUE(ids.ok()) << ids.status();
    ASSERT_EQ(ids->size(), 20u);
    EXPECT_EQ(ids->front(), 512);
    EXPECT_EQ(ids->back(), 513);
    for (int64_t id : *ids) {
      EXPECT_GE(id, 0);
      EXPECT_LE(id, 513);
    }
  }
}

TEST(ClipTokenizerHostileTest, RefusesBadFilesNamingThem) {
  const std::string missing = ::testing::TempDir() + "/no_such_clip";
  auto t = ClipTokenizer::Load(missing);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(missing + "/vocab.json"));

  const std::string no_merges = NewDir("no_merges");
  std::ofstream(no_merges + "/vocab.json") << VocabJson();
  t = ClipTokenizer::Load(no_merges);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(t.status().message()), HasSubstr(no_merges + "/merges.txt"));

  auto expect_invalid = [](const std::string& dir, const std::string& file, const std::string& why) {
    auto loaded = ClipTokenizer::Load(dir);
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument) << dir << ": " << loaded.status();
    EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(dir + "/" + file)) << loaded.status();
    EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(why)) << loaded.status();
  };
  expect_invalid(WriteTokenizer("not_json", "{\"a\": 1,,]", kMerges), "vocab.json", "not a valid JSON object");
  expect_invalid(WriteTokenizer("nested", "{\"a\": {\"b\": 1}}", kMerges), "vocab.json", "nests deeper");
  expect_invalid(WriteTokenizer("deep", std::string(100000, '[') + std::string(100000, ']'), kMerges), "vocab.json",
                 "nests deeper");
  expect_invalid(WriteTokenizer("fraction", "{\"a\": 1.5}", kMerges), "vocab.json", "'a' is not an id");
  expect_invalid(WriteTokenizer("negative", "{\"a\": -1}", kMerges), "vocab.json", "'a' is not an id");
  expect_invalid(WriteTokenizer("string_id", "{\"a\": \"1\"}", kMerges), "vocab.json", "'a' is not an id");
  expect_invalid(WriteTokenizer("no_bos", VocabJson(false), kMerges), "vocab.json", "<|startoftext|>");
  const std::string huge = WriteTokenizer("huge", "", kMerges);  // Sparse: refused before reading.
  ASSERT_EQ(::truncate((huge + "/vocab.json").c_str(), int64_t{65} << 20), 0);
  expect_invalid(huge, "vocab.json", "exceeds the limit");

  const std::string vocab = VocabJson();
  expect_invalid(WriteTokenizer("one_part", vocab, "#version: 0.2\nh e\nh\n"), "merges.txt", "line 3");
  expect_invalid(WriteTokenizer("three_parts", vocab, "#version: 0.2\nh e l\n"), "merges.txt", "line 2");
  expect_invalid(WriteTokenizer("two_spaces", vocab, "h  e\n"), "merges.txt", "line 1");
  expect_invalid(WriteTokenizer("empty_line", vocab, "h e\n\nt h\n"), "merges.txt", "line 2");
  // "q x" merges symbols the vocabulary has, into "qx", which it has not.
  expect_invalid(WriteTokenizer("unknown_result", vocab, "#version: 0.2\nq x\n"), "merges.txt", "'qx' is not in");
  expect_invalid(WriteTokenizer("unknown_part", vocab, "#version: 0.2\n\xe2\x98\x83 a\n"), "merges.txt",
                 "line 2: '??" "?' is not in");  // Split: three question marks then a quote form a trigraph.
  const std::string huge_merges = WriteTokenizer("huge_merges", vocab, "");
  ASSERT_EQ(::truncate((huge_merges + "/merges.txt").c_str(), int64_t{65} << 20), 0);
  expect_invalid(huge_merges, "merges.txt", "exceeds the limit");

  // A merges.txt without the version line, with CRLF line ends and a trailing newline, loads.
  auto loaded = ClipTokenizer::Load(WriteTokenizer("crlf", vocab, "h e\r\nl o</w>\r\n"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_EQ(*(*loaded)->Encode("hello", 6), (std::vector<int64_t>{kBos, kHe, 'l', kLoEnd, kEos, kEos}));
}

TEST(ClipTokenizerHostileTest, FromTextIsLoadsParseNamingTheSource) {
  auto from_text = ClipTokenizer::FromText(VocabJson(), kMerges, "in-memory");
  auto from_files = ClipTokenizer::Load(WriteTokenizer("from_text", VocabJson(), kMerges));
  ASSERT_TRUE(from_text.ok()) << from_text.status();
  ASSERT_TRUE(from_files.ok()) << from_files.status();
  for (const std::string text : {"hello the cat", "it's aaaa <|endoftext|> \xc3\x89", ""}) {
    EXPECT_EQ(*(*from_text)->Encode(text, 12), *(*from_files)->Encode(text, 12)) << text;
  }
  auto bad = ClipTokenizer::FromText(VocabJson(), "h e\nq x\n", "in-memory");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("in-memory/merges.txt: line 2"));
  bad = ClipTokenizer::FromText("[]", "", "in-memory");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("in-memory/vocab.json"));
}

TEST(ClipTokenizerHostileTest, RefusesBadArguments) {
  auto tokenizer = ClipTokenizer::ByteLevel();
  for (int64_t bad : {int64_t{1}, int64_t{0}, int64_t{-1}, int64_t{1} << 40}) {
    auto ids = tokenizer->Encode("a", bad);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(ids.status().message()), HasSubstr("max_length"));
  }
  auto ids = tokenizer->Encode("bad \xff utf-8", 77);
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ids.status().message()), HasSubstr("UTF-8"));
}

}  // namespace
}  // namespace stowage
