#include "offload/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <thread>
#include <vector>

#include <fstream>
#include <string>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"

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

std::string TempPath(const std::string& name) { return std::string(::testing::TempDir()) + "/" + name; }

// What `cp new old` does to `old`: the same inode, truncated, then written.
void RewriteInPlace(const std::string& path, const std::string& bytes) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  ::close(fd);
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

TEST(SafetensorsChangedOnDiskTest, TruncatedUnderAViewReadsZerosAndReportsTheFile) {
  const std::string path = TempPath("truncated.safetensors");
  const at::Tensor values = at::rand({1 << 20}) + 1;  // 4 MiB, no zeros.
  ASSERT_TRUE(WriteSafetensors(path, {{"w", values}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  at::Tensor view = *(*file)->Get("w");
  EXPECT_TRUE((*file)->CheckUnchanged().ok());
  const int64_t size = (*file)->mapping_bytes();

  ASSERT_EQ(::truncate(path.c_str(), 0), 0);
  // Without the handler this read dies of SIGBUS.
  const double sum = view.sum().item<double>();
  EXPECT_EQ(sum, 0.0);
  EXPECT_TRUE((*file)->damaged());
  const absl::Status status = (*file)->CheckUnchanged();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find(absl::StrCat("model file '", path, "' changed on disk after it was loaded (size ",
                                               size, " → 0)")),
            std::string::npos)
      << status;
  EXPECT_NE(status.message().find("unload and load the pipeline again"), std::string::npos);
  EXPECT_EQ(MappedFilesContaining({view.data_ptr()}).size(), 1u);
  // Closing the damaged file unmaps both its file pages and the zero pages.
  view = at::Tensor();
  file->reset();
}

TEST(SafetensorsChangedOnDiskTest, PartlyTruncatedFileFaultsOnlyPastTheCutAndAMemcpyWorkerSurvives) {
  const std::string path = TempPath("half.safetensors");
  const at::Tensor values = at::rand({1 << 20}) + 1;
  ASSERT_TRUE(WriteSafetensors(path, {{"w", values}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const at::Tensor view = *(*file)->Get("w");
  ASSERT_EQ(::truncate(path.c_str(), (*file)->mapping_bytes() / 2), 0);
  std::vector<float> copy(values.numel());
  std::thread worker([&] { std::memcpy(copy.data(), view.data_ptr(), copy.size() * sizeof(float)); });
  worker.join();
  EXPECT_EQ(copy[0], values[0].item<float>());  // Before the cut: the file's bytes.
  EXPECT_EQ(copy.back(), 0.0f);                 // After it: zeros.
  EXPECT_TRUE((*file)->damaged());
  EXPECT_EQ((*file)->CheckUnchanged().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SafetensorsChangedOnDiskTest, RewrittenInPlaceIsReportedEvenBeforeAFault) {
  const std::string path = TempPath("rewritten.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"w", at::ones({1024})}}).ok());
  const std::string other = TempPath("rewritten_new.safetensors");
  ASSERT_TRUE(WriteSafetensors(other, {{"w", at::full({1024}, 2.0)}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  // File timestamps come from a coarse clock: let it tick so the rewrite gets a new mtime.
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  RewriteInPlace(path, ReadAll(other));  // Same size, new bytes: only the mtime tells.
  EXPECT_FALSE((*file)->damaged());
  const absl::Status status = (*file)->CheckUnchanged();
  EXPECT_EQ(status.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(status.message().find("rewritten"), std::string::npos) << status;
}

TEST(SafetensorsChangedOnDiskTest, RenamedOverOrRemovedKeepsTheOldDataAndStaysOk) {
  const std::string path = TempPath("renamed.safetensors");
  const at::Tensor old_values = at::arange(4096, at::kFloat);
  ASSERT_TRUE(WriteSafetensors(path, {{"w", old_values}}).ok());
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  const at::Tensor view = *(*file)->Get("w");
  // WriteSafetensors writes a temporary file and renames it onto the path.
  ASSERT_TRUE(WriteSafetensors(path, {{"w", at::zeros({8})}}).ok());
  EXPECT_TRUE(at::equal(view, old_values));
  EXPECT_TRUE((*file)->CheckUnchanged().ok()) << (*file)->CheckUnchanged();
  ASSERT_EQ(std::remove(path.c_str()), 0);
  EXPECT_TRUE(at::equal(view, old_values));
  EXPECT_TRUE((*file)->CheckUnchanged().ok()) << (*file)->CheckUnchanged();
  EXPECT_FALSE((*file)->damaged());
}

TEST(SafetensorsChangedOnDiskTest, MappedFilesContainingFindsEachFileOnce) {
  const std::string a_path = TempPath("files_a.safetensors");
  const std::string b_path = TempPath("files_b.safetensors");
  ASSERT_TRUE(WriteSafetensors(a_path, {{"x", at::ones({4})}, {"y", at::ones({4})}}).ok());
  ASSERT_TRUE(WriteSafetensors(b_path, {{"z", at::ones({4})}}).ok());
  auto a = SafetensorsFile::Open(a_path);
  auto b = SafetensorsFile::Open(b_path);
  ASSERT_TRUE(a.ok() && b.ok());
  const at::Tensor x = *(*a)->Get("x"), y = *(*a)->Get("y"), z = *(*b)->Get("z");
  const at::Tensor heap = at::ones({4});
  const auto files = MappedFilesContaining({x.data_ptr(), heap.data_ptr(), z.data_ptr(), y.data_ptr()});
  ASSERT_EQ(files.size(), 2u);
  EXPECT_EQ(files[0]->path(), a_path);
  EXPECT_EQ(files[1]->path(), b_path);
  EXPECT_TRUE(MappedFilesContaining({heap.data_ptr()}).empty());
}

// The handler only takes faults inside safetensors mappings; any other SIGBUS still kills.
TEST(SafetensorsChangedOnDiskDeathTest, SigbusElsewhereStillKills) {
  ::testing::FLAGS_gtest_death_test_style = "threadsafe";
  const std::string path = TempPath("guard.safetensors");
  ASSERT_TRUE(WriteSafetensors(path, {{"w", at::ones({4})}}).ok());
  ASSERT_TRUE(SafetensorsFile::Open(path).ok());  // Installs the handler.
  const std::string raw = TempPath("raw.bin");
  RewriteInPlace(raw, std::string(1 << 16, 'x'));
  EXPECT_EXIT(
      {
        const int fd = ::open(raw.c_str(), O_RDONLY);
        auto* bytes = static_cast<volatile const char*>(::mmap(nullptr, 1 << 16, PROT_READ, MAP_SHARED, fd, 0));
        (void)::truncate(raw.c_str(), 0);
        std::printf("%c", bytes[8192]);
        std::exit(0);
      },
      ::testing::KilledBySignal(SIGBUS), "");
  EXPECT_EXIT(::raise(SIGBUS), ::testing::KilledBySignal(SIGBUS), "");  // Sent, not a fault.
}

}  // namespace
}  // namespace stowage
