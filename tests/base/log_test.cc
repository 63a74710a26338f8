#include "base/log.h"

#include <string>

#include <gtest/gtest.h>

namespace stowage {
namespace {

TEST(LogValueTest, PlainValuesStayAndEverythingElseIsQuotedAndEscaped) {
  EXPECT_EQ(LogValue("zimage-tiny"), "zimage-tiny");
  EXPECT_EQ(LogValue("cuda:0"), "cuda:0");
  EXPECT_EQ(LogValue(""), "\"\"");
  EXPECT_EQ(LogValue("two words"), "\"two words\"");
  EXPECT_EQ(LogValue("a=b"), "\"a=b\"");
  EXPECT_EQ(LogValue("say \"hi\"\\"), "\"say \\\"hi\\\"\\\\\"");
  // A client's newline cannot start a forged line.
  EXPECT_EQ(LogValue("x\nrequest id=forged status=OK"), "\"x\\x0arequest id=forged status=OK\"");
  EXPECT_EQ(LogValue(std::string("\xff\x00", 2)), "\"\\xff\\x00\"");
  EXPECT_EQ(LogValue(std::string(300, 'a'), 4), "aaaa...(300 bytes)");
}

TEST(LogTest, LinesCarryATimestampALevelAndTheText) {
  testing::internal::CaptureStderr();
  LogInfo("event key=1");
  LogWarning("event key=2");
  LogError("event key=3");
  const std::string out = testing::internal::GetCapturedStderr();
  EXPECT_NE(out.find(" I event key=1\n"), std::string::npos) << out;
  EXPECT_NE(out.find(" W event key=2\n"), std::string::npos) << out;
  EXPECT_NE(out.find(" E event key=3\n"), std::string::npos) << out;
  EXPECT_EQ(out.substr(4, 1), "-");
  EXPECT_EQ(out.substr(10, 1), "T");
}

}  // namespace
}  // namespace stowage
