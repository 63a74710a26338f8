#include "base/process_memory.h"

#include <fstream>
#include <vector>

#include "gtest/gtest.h"

namespace stowage {
namespace {

TEST(ProcessMemoryTest, ReadsRssAndItsPeak) {
  const absl::StatusOr<ProcessMemory> before = ReadProcessMemory();
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_GT(before->rss_bytes, 0);
  EXPECT_GE(before->peak_rss_bytes, before->rss_bytes);
  // 64 MiB touched: the RSS grows by about that much, and the peak with it.
  std::vector<char> block(size_t{64} << 20);
  for (size_t i = 0; i < block.size(); i += 4096) block[i] = 1;
  const absl::StatusOr<ProcessMemory> after = ReadProcessMemory();
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_GE(after->rss_bytes - before->rss_bytes, int64_t{60} << 20);
  EXPECT_GE(after->peak_rss_bytes, after->rss_bytes);
}

TEST(ProcessMemoryTest, ParsesTheBracketedHugePageMode) {
  EXPECT_EQ(ParseTransparentHugePageMode("always [madvise] never"), "madvise");
  EXPECT_EQ(ParseTransparentHugePageMode("[always] madvise never\n"), "always");
  EXPECT_EQ(ParseTransparentHugePageMode("always madvise [never]"), "never");
  EXPECT_EQ(ParseTransparentHugePageMode("always madvise never"), "");
  EXPECT_EQ(ParseTransparentHugePageMode("always [madvise"), "");
  EXPECT_EQ(ParseTransparentHugePageMode(""), "");
}

TEST(ProcessMemoryTest, HugePageModeMatchesTheKernelsFile) {
  std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string contents;
  if (!file || !std::getline(file, contents)) {
    EXPECT_EQ(TransparentHugePageMode(), "");
    EXPECT_FALSE(TransparentHugePagesOn());
    return;
  }
  const std::string mode = TransparentHugePageMode();
  EXPECT_EQ(mode, ParseTransparentHugePageMode(contents));
  EXPECT_TRUE(mode == "always" || mode == "madvise" || mode == "never") << contents;
  EXPECT_EQ(TransparentHugePagesOn(), mode != "never") << contents;
}

}  // namespace
}  // namespace stowage
