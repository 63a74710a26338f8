// T5Tokenizer against libsentencepiece itself: models are trained here with SentencePieceTrainer and
// every encoding is compared with SentencePieceProcessor's ids (+ </s>, cut and padded as
// transformers does). This binary links libsentencepiece but not libprotobuf: the two cannot share a
// process (see models/tokenizers/t5_tokenizer.h), which is why T5Tokenizer reads spiece.model itself.
#include "models/tokenizers/t5_tokenizer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/models/sentencepiece_reference.h"

namespace stowage {
namespace {

using ::testing::HasSubstr;

std::string NewDir(const std::string& name) {
  const std::string dir = ::testing::TempDir() + "/" + name;
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

// Prompts in several scripts; a few characters are rare enough to fall outside the character
// coverage and become <unk>.
const char* const kCorpus[] = {
    "a photo of an astronaut riding a horse on the moon",
    "A Photo of TWO cats, sitting on a mat!",
    "the quick brown fox jumps over the lazy dog",
    "a red lantern hanging in a dark alley at night, cinematic lighting",
    "portrait of a woman with long hair, oil painting, highly detailed",
    "a bowl of fruit on a wooden table: apples, pears and grapes",
    "café au lait, naïve art, résumé of a crème brûlée",
    "ＦＵＬＬＷＩＤＴＨ letters and ｄｉｇｉｔｓ １２３",
    "日本語のテキストと漢字のプロンプト",
    "中文提示词：一只猫坐在垫子上",
    "Привет мир, это тестовая строка",
    "numbers 1024x768, 3.14159 and 2024-01-01",
    "emoji 😀 and 👍 in a sentence",
    "it's a dog's life; we're here, they'd go, I'll stay",
    "snow ☃ and the integral ∮ are rare",
};

std::string WriteCorpus(const std::string& dir) {
  const std::string path = dir + "/corpus.txt";
  std::ofstream out(path);
  for (int round = 0; round < 20; ++round) {
    for (size_t i = 0; i < sizeof(kCorpus) / sizeof(kCorpus[0]); ++i) {
      if (round > 0 && i + 1 == sizeof(kCorpus) / sizeof(kCorpus[0])) continue;  // The rare line once.
      out << kCorpus[i] << "\n";
    }
  }
  return path;
}

// Trains a Unigram model into <dir>/spiece.model with T5's special ids unless `flags` says otherwise.
std::string Train(const std::string& name, const std::string& flags, int vocab_size = 150) {
  const std::string dir = NewDir(name);
  const std::string args = "--input=" + WriteCorpus(dir) + " --model_prefix=" + dir +
                           "/spiece --vocab_size=" + std::to_string(vocab_size) + " --hard_vocab_limit=false --num_threads=1 "
                           "--character_coverage=0.995 --minloglevel=2 " + flags;
  const std::string error = TrainSentencePiece(args);
  EXPECT_EQ(error, "");
  return dir;
}

// spiece.model bytes written by hand (protobuf wire format), for models the trainer cannot make:
// <pad> and </s> (CONTROL), <unk>, then `normal` pieces (NORMAL, scores -1, -2, ...), and a
// normalizer_spec with `charsmap` as its precompiled table when not empty.
std::string Varint(uint64_t v) {
  std::string out;
  for (; v >= 0x80; v >>= 7) out += static_cast<char>(v | 0x80);
  return out + static_cast<char>(v);
}
std::string BytesField(int number, const std::string& data) {
  return Varint(static_cast<uint64_t>(number) << 3 | 2) + Varint(data.size()) + data;
}
std::string PieceField(const std::string& text, float score, int type) {
  char bits[4];
  std::memcpy(bits, &score, sizeof(bits));
  return BytesField(1, BytesField(1, text) + Varint(2 << 3 | 5) + std::string(bits, 4) + Varint(3 << 3) +
                           Varint(static_cast<uint64_t>(type)));
}
std::string HandWrittenModel(const std::vector<std::string>& normal, const std::string& charsmap = "") {
  std::string model = PieceField("<pad>", 0.0f, 3) + PieceField("</s>", 0.0f, 3) + PieceField("<unk>", 0.0f, 2);
  for (size_t i = 0; i < normal.size(); ++i) model += PieceField(normal[i], -1.0f - static_cast<float>(i), 1);
  if (!charsmap.empty()) model += BytesField(3, BytesField(2, charsmap));
  return model;
}
// A precompiled normalisation table with one rule, "a" → `replacement`: a Darts-clone double array
// (root 0 with base 1; "a" at 1 ^ 'a' = 96, its leaf at 96 ^ 1 = 97, value 0), then the string.
std::string OneRuleCharsmap(const std::string& replacement) {
  std::vector<uint32_t> units(98, 0);
  units[0] = 1u << 10;                   // base 1
  units[96] = 'a' | 1u << 8 | 1u << 10;  // label 'a', has a leaf, offset 1
  units[97] = 1u << 31;                  // leaf: value 0
  std::string out;
  auto put = [&](uint32_t v) {
    for (int k = 0; k < 4; ++k) out += static_cast<char>(v >> (8 * k));
  };
  put(static_cast<uint32_t>(units.size() * 4));
  for (uint32_t u : units) put(u);
  return out + replacement + '\0';
}

constexpr char kT5Ids[] = "--model_type=unigram --pad_id=0 --eos_id=1 --unk_id=2 --bos_id=-1 ";

// The reference: libsentencepiece's ids, then </s>, cut to max_length - 1 and padded with <pad>.
std::vector<int64_t> Reference(const SentencePieceReference& sp, const std::string& text, int64_t max_length) {
  std::vector<int> pieces;
  std::string error;
  EXPECT_TRUE(sp.Encode(text, &pieces, &error)) << error;
  std::vector<int64_t> ids(pieces.begin(), pieces.end());
  if (static_cast<int64_t>(ids.size()) > max_length - 1) ids.resize(max_length - 1);
  ids.push_back(1);
  ids.resize(max_length, 0);
  return ids;
}

std::vector<std::string> FixedTexts() {
  std::vector<std::string> texts = {
      "",
      "   ",
      "a photo of an astronaut",
      "  leading, trailing and    inner   spaces  ",
      "tabs\tand\nnewlines\r\nand\x0b" "vertical",
      "ＦＵＬＬ　ＷＩＤＴＨ ｔｅｘｔ ①②③ ﬁ ﬂ",  // NFKC maps these.
      "café naïve e\xcc\x81 résumé",         // Composed and decomposed é.
      "日本語のテキスト 中文提示词",
      "emoji 😀👍🏽 👨‍👩‍👧 flags 🇫🇷",
      "unknown ☃☃☃ ∮∯∰ ⅏ ꙮ",  // Runs of unknown characters.
      "invalid \xff\xfe bytes \xc3 and \xe2\x82 cut",
      "x\xc2\xa0y\xe2\x80\x8bz\xe3\x80\x80w",  // No-break, zero-width and ideographic spaces.
      "control\x01\x02\x7f characters",
      "it's ALL CAPS and MiXeD cAsE",
      "numbers 1024x768 3.14159 2024-01-01",
      "\xe2\x96\x81" "already escaped\xe2\x96\x81 spaces",
  };
  std::string long_text;
  for (int i = 0; i < 60; ++i) long_text += "a red lantern hanging in a dark alley at night ";
  texts.push_back(long_text);
  return texts;
}

// Random strings over an alphabet of ASCII, accented Latin, CJK, emoji, rare symbols, whitespace
// and malformed bytes.
std::vector<std::string> RandomTexts(int count) {
  const std::vector<std::string> alphabet = {
      "a", "e", "t", "o", "n", "s", "h", "r", "A", "T", "Z", " ", " ", " ", "  ", "\t", "\n", ",", ".", "!",
      "'", "-", "1", "7", "é", "e\xcc\x81", "ß", "ü", "日", "本", "猫", "😀", "👍", "☃", "∮", "ﬁ", "Ａ", "１",
      "\xc2\xa0", "\xe3\x80\x80", "\xff", "\xc3", "\x01", "\xe2\x96\x81", "the", "photo", "cat", "lantern"};
  std::mt19937 rng(20240601);
  std::vector<std::string> texts;
  for (int i = 0; i < count; ++i) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int k = 0; k < n; ++k) text += alphabet[rng() % alphabet.size()];
    texts.push_back(text);
  }
  return texts;
}

void ExpectSameAsSentencePiece(const std::string& dir) {
  std::string error;
  auto sp = SentencePieceReference::Load(dir + "/spiece.model", &error);
  ASSERT_NE(sp, nullptr) << error;
  auto tokenizer = T5Tokenizer::Load(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::vector<std::string> texts = FixedTexts();
  for (std::string& t : RandomTexts(400)) texts.push_back(std::move(t));
  int unknown_runs = 0;
  for (const std::string& text : texts) {
    for (int64_t max_length : {512, 9}) {
      auto ids = (*tokenizer)->Encode(text, max_length);
      ASSERT_TRUE(ids.ok()) << ids.status();
      EXPECT_EQ(*ids, Reference(*sp, text, max_length)) << "text: '" << text << "', max_length " << max_length;
      for (int64_t id : *ids) {
        EXPECT_LE(id, (*tokenizer)->max_id());
        unknown_runs += id == sp->unk_id() || sp->is_byte(static_cast<int>(id));
      }
    }
  }
  // The texts reach the <unk> (or byte fallback) path, else its rules would go untested.
  EXPECT_GT(unknown_runs, 0);
}

TEST(T5TokenizerTest, MatchesSentencePieceOnANfkcModel) {
  // nmt_nfkc (the trainer's default, and T5's): a precompiled normalisation table.
  ExpectSameAsSentencePiece(Train("nfkc", kT5Ids));
}

TEST(T5TokenizerTest, MatchesSentencePieceWithByteFallbackUserSymbolsAndNoTable) {
  // No normalisation table, no dummy prefix, whitespace kept, byte fallback, user-defined symbols.
  ExpectSameAsSentencePiece(Train("identity", std::string(kT5Ids) +
                                                  "--normalization_rule_name=identity --add_dummy_prefix=false "
                                                  "--remove_extra_whitespaces=false --byte_fallback=true "
                                                  "--user_defined_symbols=<sep>,lantern,☃",
                                  450));
}

TEST(T5TokenizerTest, MatchesSentencePieceWithWhitespaceAsSuffixAndCaseFolding) {
  ExpectSameAsSentencePiece(Train("suffix", std::string(kT5Ids) +
                                                "--normalization_rule_name=nfkc_cf --treat_whitespace_as_suffix=true "
                                                "--split_digits=true"));
}

TEST(T5TokenizerTest, FramesCutsAndPadsAsTransformers) {
  const std::string dir = Train("frame", kT5Ids);
  std::string error;
  auto sp = SentencePieceReference::Load(dir + "/spiece.model", &error);
  ASSERT_NE(sp, nullptr) << error;
  auto tokenizer = T5Tokenizer::Load(dir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  std::vector<int> pieces;
  ASSERT_TRUE(sp->Encode("a photo of an astronaut riding a horse", &pieces, &error)) << error;
  ASSERT_GT(pieces.size(), 4u);
  // Padding: the pieces, </s>, then <pad> (0).
  auto padded = (*tokenizer)->Encode("a photo of an astronaut riding a horse", 32);
  ASSERT_TRUE(padded.ok());
  std::vector<int64_t> want(pieces.begin(), pieces.end());
  want.push_back(T5Tokenizer::kEos);
  want.resize(32, T5Tokenizer::kPad);
  EXPECT_EQ(*padded, want);
  // The cut keeps </s> last.
  auto cut = (*tokenizer)->Encode("a photo of an astronaut riding a horse", 4);
  ASSERT_TRUE(cut.ok());
  EXPECT_EQ(*cut, (std::vector<int64_t>{pieces[0], pieces[1], pieces[2], T5Tokenizer::kEos}));
  EXPECT_EQ(*(*tokenizer)->Encode("a photo", 1), (std::vector<int64_t>{T5Tokenizer::kEos}));
  EXPECT_EQ(*(*tokenizer)->Encode("", 3), (std::vector<int64_t>{T5Tokenizer::kEos, 0, 0}));
  EXPECT_EQ((*tokenizer)->max_id(), sp->piece_size() - 1);
}

TEST(T5TokenizerTest, ByteLevelIsOneIdPerUtf8Byte) {
  auto tokenizer = T5Tokenizer::ByteLevel();
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->max_id(), 258);
  EXPECT_EQ(*tokenizer->Encode("Hi \xc3\xa9", 8),
            (std::vector<int64_t>{'H' + 3, 'i' + 3, ' ' + 3, 0xc3 + 3, 0xa9 + 3, 1, 0, 0}));
  EXPECT_EQ(*tokenizer->Encode("abcdef", 3), (std::vector<int64_t>{'a' + 3, 'b' + 3, 1}));
  EXPECT_EQ(*tokenizer->Encode("\xff", 2), (std::vector<int64_t>{0xff + 3, 1}));
}

TEST(T5TokenizerTest, RefusesBadArgumentsAndFilesNamingThem) {
  auto tokenizer = T5Tokenizer::ByteLevel();
  for (int64_t bad : {int64_t{0}, int64_t{-3}, int64_t{1} << 40}) {
    auto ids = tokenizer->Encode("a", bad);
    EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(ids.status().message()), HasSubstr("max_length"));
  }

  const std::string missing = ::testing::TempDir() + "/no_such_dir";
  auto loaded = T5Tokenizer::Load(missing);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(std::string(loaded.status().message()), HasSubstr(missing + "/spiece.model"));

  auto expect_invalid = [](const std::string& dir, const std::string& why) {
    auto t = T5Tokenizer::Load(dir);
    EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument) << dir << ": " << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(dir + "/spiece.model")) << t.status();
    EXPECT_THAT(std::string(t.status().message()), HasSubstr(why)) << t.status();
  };
  const std::string garbage = NewDir("garbage");
  std::ofstream(garbage + "/spiece.model") << "this is not a protobuf \xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff";
  expect_invalid(garbage, "not a SentencePiece model");

  const std::string empty = NewDir("empty");
  std::ofstream(empty + "/spiece.model") << "";
  expect_invalid(empty, "no pieces");

  const std::string valid = Train("valid", kT5Ids);
  std::stringstream bytes;
  bytes << std::ifstream(valid + "/spiece.model", std::ios::binary).rdbuf();
  const std::string model = bytes.str();
  const std::string truncated = NewDir("truncated");
  std::ofstream(truncated + "/spiece.model", std::ios::binary) << model.substr(0, model.size() / 2);
  expect_invalid(truncated, "not a SentencePiece model");

  const std::string huge = NewDir("huge");  // Sparse: refused by its size before any read.
  std::ofstream(huge + "/spiece.model") << "";
  ASSERT_EQ(::truncate((huge + "/spiece.model").c_str(), int64_t{65} << 20), 0);
  expect_invalid(huge, "exceeds the limit");

  const std::string directory = NewDir("directory");
  NewDir("directory/spiece.model");
  expect_invalid(directory, "not a regular file");

  expect_invalid(Train("bpe", "--model_type=bpe --pad_id=0 --eos_id=1 --unk_id=2 --bos_id=-1"), "model_type 2");
  // SentencePiece's default ids (<unk> 0, <s> 1, </s> 2): not T5's layout.
  expect_invalid(Train("default_ids", "--model_type=unigram"), "</s> id 1");

  // A normalisation table whose declared size runs past its end: hand-written protobuf with one
  // normal piece, <unk>, and normalizer_spec.precompiled_charsmap = "\xff\xff\x00\x00" + 8 bytes.
  const std::string charsmap = NewDir("charsmap");
  const std::string pieces = std::string("\x0a\x08\x0a\x01" "a" "\x15\x00\x00\x80\xbf", 10) +  // "a", -1.0
                             std::string("\x0a\x09\x0a\x05<unk>\x18\x02", 11);
  const std::string rules = std::string("\xff\xff\x00\x00", 4) + "12345678";
  const std::string normalizer = std::string("\x1a") + static_cast<char>(rules.size() + 2) + "\x12" +
                                 static_cast<char>(rules.size()) + rules;
  std::ofstream(charsmap + "/spiece.model", std::ios::binary) << pieces << normalizer;
  expect_invalid(charsmap, "normalisation rules are truncated");
}

TEST(T5TokenizerTest, DamagedModelsEndInAStatusNeverACrash) {
  const std::string valid = Train("to_damage", kT5Ids);
  std::stringstream bytes;
  bytes << std::ifstream(valid + "/spiece.model", std::ios::binary).rdbuf();
  const std::string model = bytes.str();
  const std::string dir = NewDir("damaged");
  std::mt19937 rng(7);
  int loaded = 0;
  for (int round = 0; round < 300; ++round) {
    std::string damaged = model;
    for (int k = 0; k < 1 + round % 8; ++k) damaged[rng() % damaged.size()] = static_cast<char>(rng());
    std::ofstream(dir + "/spiece.model", std::ios::binary | std::ios::trunc) << damaged;
    auto tokenizer = T5Tokenizer::Load(dir);
    if (!tokenizer.ok()) {
      EXPECT_EQ(tokenizer.status().code(), absl::StatusCode::kInvalidArgument) << tokenizer.status();
      continue;
    }
    ++loaded;
    for (const std::string& text : FixedTexts()) {
      auto ids = (*tokenizer)->Encode(text, 64);
      if (ids.ok()) {
        EXPECT_EQ(ids->size(), 64u);
        for (int64_t id : *ids) EXPECT_LE(id, (*tokenizer)->max_id());
      }
    }
  }
  EXPECT_GT(loaded, 0);  // Some damage lands in scores or piece text, and still loads.
}

TEST(T5TokenizerTest, FromBytesIsLoadsParseNamingTheSource) {
  const std::string dir = Train("from_bytes", kT5Ids);
  std::stringstream bytes;
  bytes << std::ifstream(dir + "/spiece.model", std::ios::binary).rdbuf();
  auto from_file = T5Tokenizer::Load(dir);
  auto from_bytes = T5Tokenizer::FromBytes(bytes.str(), "in-memory model");
  ASSERT_TRUE(from_file.ok()) << from_file.status();
  ASSERT_TRUE(from_bytes.ok()) << from_bytes.status();
  for (const std::string& text : FixedTexts()) {
    EXPECT_EQ(*(*from_bytes)->Encode(text, 64), *(*from_file)->Encode(text, 64));
  }
  auto bad = T5Tokenizer::FromBytes("\x0a\xff", "in-memory model");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("in-memory model: not a SentencePiece model"));
}

// Found while writing tests/fuzz/t5_tokenizer_fuzzer: a normalisation rule's replacement is any
// string of the table, so a small model could make a 4,096-byte prompt (Flux's limit) normalise
// to gigabytes (a 1 MB replacement: 4 GB, then a lattice of 16 bytes per byte) and take the
// process down. The normalised text is now at most 64 times the text (NFKC's largest expansion,
// U+FDFA, is 11-fold); beyond that Encode refuses the text, naming the model.
TEST(T5TokenizerTest, NormalisationThatExpandsWithoutBoundIsRefused) {
  auto expanding = T5Tokenizer::FromBytes(
      HandWrittenModel({"\xe2\x96\x81", "x", "xxxxxxxx"}, OneRuleCharsmap(std::string(1 << 20, 'x'))), "expanding");
  ASSERT_TRUE(expanding.ok()) << expanding.status();
  auto ids = (*expanding)->Encode(std::string(4096, 'a'), 512);
  EXPECT_EQ(ids.status().code(), absl::StatusCode::kInvalidArgument) << ids.status();
  EXPECT_THAT(std::string(ids.status().message()), HasSubstr("expanding: the normalisation rules expand"));
  // Expanding within the bound (8-fold, as real tables do) encodes: "▁" then "xxxxxxxx" per "a".
  auto modest = T5Tokenizer::FromBytes(
      HandWrittenModel({"\xe2\x96\x81", "x", "xxxxxxxx"}, OneRuleCharsmap("xxxxxxxx")), "modest");
  ASSERT_TRUE(modest.ok()) << modest.status();
  ids = (*modest)->Encode(std::string(4096, 'a'), 8);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(*ids, (std::vector<int64_t>{3, 5, 5, 5, 5, 5, 5, T5Tokenizer::kEos}));
}

// Found with the above: the Viterbi walks, from every byte of the normalised text, as deep into the
// pieces' trie as the text matches, so one piece as long as the text made Encode quadratic in the
// normalised text. Even within the 64-fold bound it hung: a 64-fold rule and a piece of 64 * n "x"
// took 2.7 s for n = 256 "a", 12 s for 512, 62 s for 1,024 (so about 16 minutes for a 4,096-byte
// prompt). Pieces are now at most 256 bytes (the trainer makes pieces of at most 16 characters by
// default).
TEST(T5TokenizerTest, LongPiecesAreRefused) {
  auto longest = T5Tokenizer::FromBytes(HandWrittenModel({"\xe2\x96\x81", "x", std::string(256, 'x')}), "m");
  ASSERT_TRUE(longest.ok()) << longest.status();
  // "▁" then two whole pieces of 256 "x".
  EXPECT_EQ(*(*longest)->Encode(std::string(512, 'x'), 5),
            (std::vector<int64_t>{3, 5, 5, T5Tokenizer::kEos, T5Tokenizer::kPad}));
  auto too_long = T5Tokenizer::FromBytes(HandWrittenModel({"\xe2\x96\x81", "x", std::string(257, 'x')}), "m");
  EXPECT_EQ(too_long.status().code(), absl::StatusCode::kInvalidArgument) << too_long.status();
  EXPECT_THAT(std::string(too_long.status().message()), HasSubstr("m: piece 5 is longer than 256 bytes"));
}

}  // namespace
}  // namespace stowage
