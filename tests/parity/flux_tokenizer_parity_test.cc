// Parity of Flux.1's tokenizers with transformers: ClipTokenizer and T5Tokenizer on the files of
// tests/fixtures/flux_tokenizers/ must give exactly the ids that transformers' CLIPTokenizer,
// T5TokenizerFast and T5Tokenizer (and sentencepiece itself) wrote to its expected.json. The folder is
// written on the GPU host by tests/parity/make_flux_tokenizer_fixtures.py; this test is registered
// (//tests/fixtures:flux_tokenizer_parity_test, and in CMakeLists.txt) only once the folder exists.
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "base/json_limits.h"
#include "google/protobuf/struct.pb.h"
#include "models/tokenizers/clip_tokenizer.h"
#include "models/core/diffusers_format.h"
#include "models/tokenizers/t5_tokenizer.h"

namespace stowage {
namespace {

std::string FixtureDir() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* workspace = std::getenv("TEST_WORKSPACE");
  const std::string root = srcdir == nullptr ? "." : std::string(srcdir) + "/" + (workspace ? workspace : "stowage");
  return root + "/tests/fixtures/flux_tokenizers";
}

struct Case {
  std::string text;
  int64_t max_length = 0;
  // (name of the reference, its ids), for each reference the fixture has for this case.
  std::vector<std::pair<std::string, std::vector<int64_t>>> references;
};

const google::protobuf::Value* Field(const google::protobuf::Struct& s, const std::string& name) {
  auto it = s.fields().find(name);
  return it == s.fields().end() ? nullptr : &it->second;
}

// expected.json's cases for `model` ("clip" or "t5") with the listed reference fields.
std::vector<Case> ReadCases(const std::string& model, const std::vector<std::string>& reference_fields) {
  auto expected = ReadJsonFile(FixtureDir() + "/expected.json", kConfigJsonLimits);
  EXPECT_TRUE(expected.ok()) << expected.status();
  if (!expected.ok()) return {};
  const google::protobuf::Value* section = Field(*expected, model);
  const google::protobuf::Value* cases =
      section != nullptr && section->has_struct_value() ? Field(section->struct_value(), "cases") : nullptr;
  EXPECT_TRUE(cases != nullptr && cases->has_list_value()) << "expected.json has no " << model << ".cases";
  if (cases == nullptr || !cases->has_list_value()) return {};
  std::vector<Case> out;
  for (const google::protobuf::Value& value : cases->list_value().values()) {
    const google::protobuf::Struct& c = value.struct_value();
    const google::protobuf::Value* text = Field(c, "text");
    const google::protobuf::Value* max_length = Field(c, "max_length");
    EXPECT_TRUE(text != nullptr && text->has_string_value() && max_length != nullptr && max_length->has_number_value())
        << "a " << model << " case without text or max_length";
    if (text == nullptr || max_length == nullptr) continue;
    Case parsed{text->string_value(), static_cast<int64_t>(max_length->number_value()), {}};
    for (const std::string& name : reference_fields) {
      const google::protobuf::Value* ids = Field(c, name);
      if (ids == nullptr || !ids->has_list_value()) continue;  // That reference was not written.
      std::vector<int64_t> list;
      for (const google::protobuf::Value& id : ids->list_value().values()) {
        list.push_back(static_cast<int64_t>(id.number_value()));
      }
      parsed.references.emplace_back(name, std::move(list));
    }
    EXPECT_FALSE(parsed.references.empty()) << "no reference ids for '" << parsed.text << "'";
    out.push_back(std::move(parsed));
  }
  EXPECT_FALSE(out.empty()) << "expected.json has no " << model << " cases";
  return out;
}

template <typename Tokenizer>
void ExpectSameIds(const Tokenizer& tokenizer, const std::vector<Case>& cases) {
  int compared = 0;
  for (const Case& c : cases) {
    auto ids = tokenizer.Encode(c.text, c.max_length);
    ASSERT_TRUE(ids.ok()) << ids.status() << " for '" << c.text << "'";
    for (const auto& [reference, want] : c.references) {
      EXPECT_EQ(*ids, want) << reference << ", max_length " << c.max_length << ", text '" << c.text << "'";
      ++compared;
    }
  }
  EXPECT_GT(compared, 0);
}

TEST(FluxTokenizerParityTest, ClipMatchesTransformersCLIPTokenizer) {
  auto tokenizer = ClipTokenizer::Load(FixtureDir() + "/clip");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  ExpectSameIds(**tokenizer, ReadCases("clip", {"ids"}));
}

TEST(FluxTokenizerParityTest, T5MatchesTransformersAndSentencePiece) {
  auto tokenizer = T5Tokenizer::Load(FixtureDir() + "/t5");
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  // "ids": T5TokenizerFast (FluxPipeline's tokenizer_2); "slow_ids": T5Tokenizer; and
  // sentencepiece's own ids, cut and framed.
  ExpectSameIds(**tokenizer, ReadCases("t5", {"ids", "slow_ids", "sentencepiece_ids"}));
}

}  // namespace
}  // namespace stowage
