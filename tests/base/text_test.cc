#include "base/text.h"

#include <string>

#include <gtest/gtest.h>

namespace stowage {
namespace {

TEST(TruncatedTest, ShortPrintableTextIsUnchanged) {
  EXPECT_EQ(Truncated("zimage-tiny"), "zimage-tiny");
  EXPECT_EQ(Truncated(""), "");
  EXPECT_EQ(Truncated(std::string(64, 'a')), std::string(64, 'a'));  // Exactly at the limit.
}

TEST(TruncatedTest, LongTextIsCutAndSaysItsLength) {
  EXPECT_EQ(Truncated(std::string(65, 'a')), std::string(64, 'a') + "...(65 bytes)");
  EXPECT_EQ(Truncated(std::string(100, 'b'), 4), "bbbb...(100 bytes)");
  EXPECT_EQ(Truncated(std::string(1 << 20, 'c'), 0), "...(1048576 bytes)");
}

TEST(TruncatedTest, NonPrintableBytesBecomeQuestionMarks) {
  EXPECT_EQ(Truncated(std::string("a\nb\0c\x7f\xff", 7)), "a?b?c??");
  EXPECT_EQ(Truncated("\xe4\xb8\xad"), "???");  // UTF-8 is not echoed raw either.
}

}  // namespace
}  // namespace stowage
