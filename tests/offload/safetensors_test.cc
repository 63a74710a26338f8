#include "offload/safetensors.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>

#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

namespace stowage {
namespace {

// This process's resident bytes of mapped files: RssFile, plus RssShmem for files on tmpfs.
int64_t RssFileBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  int64_t bytes = 0;
  while (std::getline(status, line)) {
    if (line.rfind("RssFile:", 0) == 0) bytes += std::stoll(line.substr(8)) * 1024;
    if (line.rfind("RssShmem:", 0) == 0) bytes += std::stoll(line.substr(9)) * 1024;
  }
  return bytes;
}

TEST(SafetensorsTest, RoundTripIsZeroCopyAndExact) {
  const std::string path = std::string(::testing::TempDir()) + "/roundtrip.safetensors";
  const at::Tensor a = at::arange(12, at::kFloat).reshape({3, 4});
  const at::Tensor b = at::arange(5, at::kBFloat16);
  ASSERT_TRUE(WriteSafetensors(path, {{"a", a}, {"b", b}}, {{"k", "v"}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->metadata().at("k"), "v");
  auto got = (*file)->Get("a");
  ASSERT_TRUE(got.ok());
  EXPECT_TRUE(at::equal(*got, a));
  const auto* data = static_cast<const uint8_t*>(got->data_ptr());
  EXPECT_GE(data, (*file)->data());
  EXPECT_LT(data, (*file)->data() + (*file)->data_bytes());
  EXPECT_EQ((*file)->Get("missing").status().code(), absl::StatusCode::kNotFound);
}

TEST(SafetensorsTest, ReleaseMappedPagesDropsRssButKeepsTheData) {
  const std::string path = std::string(::testing::TempDir()) + "/big.safetensors";
  const int64_t n = int64_t{4} << 20;  // 16 MiB of float32.
  const at::Tensor values = at::rand({n});
  ASSERT_TRUE(WriteSafetensors(path, {{"w", values}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  at::Tensor mapped = *(*file)->Get("w");
  const double sum = mapped.sum().item<double>();  // Touches every page.
  const int64_t before = RssFileBytes();
  const int64_t bytes = n * 4;
  const int64_t released = ReleaseMappedPages(mapped.data_ptr(), bytes);
  const int64_t page = ::sysconf(_SC_PAGESIZE);
  EXPECT_GE(released, bytes - 2 * page);
  EXPECT_LE(released, bytes);
  EXPECT_LE(RssFileBytes(), before - released + 2 * page) << "RSS did not drop";
  EXPECT_EQ(mapped.sum().item<double>(), sum);  // Read back from the page cache.
  EXPECT_TRUE(at::equal(mapped, values));

  // Memory that is not a safetensors mapping is never touched.
  at::Tensor heap = values.clone();
  EXPECT_EQ(ReleaseMappedPages(heap.data_ptr(), bytes), 0);
  EXPECT_TRUE(at::equal(heap, values));
  // Nor a range running past the mapping's end.
  EXPECT_EQ(ReleaseMappedPages(mapped.data_ptr(), (*file)->mapping_bytes() + page), 0);
  // A closed file's range is forgotten: memory mapped at the same address afterwards (anonymous,
  // writable) is never dropped.
  void* address = mapped.data_ptr();
  mapped = at::Tensor();
  file->reset();
  const uintptr_t first_page = (reinterpret_cast<uintptr_t>(address) + page - 1) / page * page;
  void* reused = ::mmap(reinterpret_cast<void*>(first_page), static_cast<size_t>(4 * page),
                        PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
  if (reused == reinterpret_cast<void*>(first_page)) {
    std::memset(reused, 0x5a, static_cast<size_t>(4 * page));
    EXPECT_EQ(ReleaseMappedPages(reused, 4 * page), 0);
    EXPECT_EQ(static_cast<uint8_t*>(reused)[2 * page], 0x5a);  // Not zeroed by MADV_DONTNEED.
    ::munmap(reused, static_cast<size_t>(4 * page));
  } else {
    if (reused != MAP_FAILED) ::munmap(reused, static_cast<size_t>(4 * page));
    EXPECT_EQ(ReleaseMappedPages(address, bytes), 0);  // The address range is taken: check what we can.
  }
}

}  // namespace
}  // namespace stowage
