#include "offload/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
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

TEST(SafetensorsTest, TheDataSectionStartsAtTheAlignmentAskedFor) {
  const std::string path = ::testing::TempDir() + "/aligned.safetensors";
  const at::Tensor x = at::arange(10, at::kFloat);
  auto write = [&](int64_t align) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    EXPECT_GE(fd, 0);
    const absl::Status status =
        WriteSafetensorsToDescriptor(fd, path, {{"x", x}, {"name that makes the header longer", x}}, {}, align);
    ::close(fd);
    return status;
  };
  for (int64_t align : {8, 64, 4096}) {
    ASSERT_TRUE(write(align).ok());
    auto file = SafetensorsFile::Open(path);
    ASSERT_TRUE(file.ok()) << file.status();
    EXPECT_EQ(((*file)->data() - static_cast<const uint8_t*>((*file)->mapping())) % align, 0) << align;
    EXPECT_TRUE(at::equal(*(*file)->Get("x"), x));
  }
  for (int64_t bad : {0, 4, 24}) EXPECT_EQ(write(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
}

TEST(SafetensorsTest, WrittenThroughADescriptorRoundTripsAndAFullDeviceIsReported) {
  const std::string path = ::testing::TempDir() + "/reserved.safetensors";
  const at::Tensor x = at::arange(1 << 20, at::kFloat);  // 4 MiB.
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_TRUE(WriteSafetensorsToDescriptor(fd, path, {{"x", x}}, {}, 64).ok());
  ::close(fd);
  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(at::equal(*(*file)->Get("x"), x));
  file->reset();
  std::remove(path.c_str());

  // /dev/full takes no reservation and fails every write with ENOSPC: the status names the file and
  // the cause.
  const int full = ::open("/dev/full", O_WRONLY | O_CLOEXEC);
  if (full < 0) GTEST_SKIP() << "no /dev/full here";
  const absl::Status status = WriteSafetensorsToDescriptor(full, "spill-file", {{"x", x}}, {}, 64);
  ::close(full);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  EXPECT_NE(status.message().find("spill-file"), std::string::npos) << status;
  EXPECT_NE(status.message().find(std::strerror(ENOSPC)), std::string::npos) << status;
}

// A file that may not grow as large as the tensors (RLIMIT_FSIZE below them, as a full disk would
// refuse them) is refused by the reservation, before anything is written.
TEST(SafetensorsTest, AReservationTheFileCannotHaveIsRefusedBeforeWriting) {
  const std::string path = ::testing::TempDir() + "/too_large.safetensors";
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  ASSERT_GE(fd, 0);
  struct rlimit was {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &was), 0);
  void (*old_handler)(int) = std::signal(SIGXFSZ, SIG_IGN);  // EFBIG instead of the signal.
  struct rlimit small = was;
  small.rlim_cur = 1 << 20;  // 1 MiB; the tensor is 4.
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &small), 0);
  const absl::Status status = WriteSafetensorsToDescriptor(fd, path, {{"x", at::arange(1 << 20, at::kFloat)}}, {}, 64);
  struct stat st {};
  const int stat_rc = ::fstat(fd, &st);
  ::setrlimit(RLIMIT_FSIZE, &was);
  std::signal(SIGXFSZ, old_handler);
  ::close(fd);
  std::remove(path.c_str());
  ASSERT_EQ(stat_rc, 0);
  EXPECT_EQ(status.code(), absl::StatusCode::kResourceExhausted) << status;
  if (status.message().find("cannot reserve") == std::string::npos) {
    // This filesystem takes no reservation (no fallocate): the write itself was refused.
    EXPECT_NE(status.message().find("writing"), std::string::npos) << status;
    GTEST_SKIP() << "no fallocate on this filesystem: " << status;
  }
  EXPECT_NE(status.message().find(std::strerror(EFBIG)), std::string::npos) << status;
  EXPECT_EQ(st.st_size, 0) << "bytes were written before the reservation was refused";
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

// --- Hostile headers ---------------------------------------------------------------------------

// A file image: 8-byte little-endian length, `header`, then `data_bytes` zero bytes.
std::string Image(const std::string& header, size_t data_bytes = 0) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + std::string(data_bytes, '\0');
}

absl::Status Parse(const std::string& header, size_t data_bytes = 0) {
  return ParseSafetensorsBytes(Image(header, data_bytes), "safetensors file 'x.safetensors'").status();
}

// INVALID_ARGUMENT whose message names the file and contains `needle`.
void ExpectRefused(const absl::Status& status, const std::string& needle) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  const std::string message(status.message());
  EXPECT_NE(message.find("x.safetensors"), std::string::npos) << message;
  EXPECT_NE(message.find(needle), std::string::npos) << message;
  EXPECT_LT(message.size(), 400u) << message;
}

TEST(SafetensorsHostileTest, ValidHeaderParses) {
  auto header = ParseSafetensorsBytes(
      Image(R"({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                "b": {"dtype": "BF16", "shape": [], "data_offsets": [24, 26]},
                "e": {"dtype": "F32", "shape": [0, 1099511627776], "data_offsets": [26, 26]},
                "__metadata__": {"format": "pt"}})", 26),
      "t");
  ASSERT_TRUE(header.ok()) << header.status();
  EXPECT_EQ(header->tensors.size(), 3u);
  EXPECT_EQ(header->tensors.at("a").shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(header->metadata.at("format"), "pt");
}

TEST(SafetensorsHostileTest, DeepNestingIsRefusedFast) {
  for (const std::string& header : {std::string(100000, '['), "{\"a\": " + std::string(100000, '{'),
                                    "{\"a\": {\"dtype\": \"F32\", \"shape\": " + std::string(9, '[')}) {
    const auto start = std::chrono::steady_clock::now();
    ExpectRefused(Parse(header), "nests deeper than 8");
    EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(200));
  }
  // Brackets inside strings are not nesting.
  EXPECT_TRUE(Parse(R"({"__metadata__": {"k": ")" + std::string(1000, '[') + R"("}})").ok());
}

TEST(SafetensorsHostileTest, DtypeAndByteSpanMustAgree) {
  ExpectRefused(Parse(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}})", 4),
                "tensor 'a' holds 4 bytes but its dtype F32 and shape need 8");
  ExpectRefused(Parse(R"({"a": {"dtype": "F16", "shape": [2], "data_offsets": [0, 8]}})", 8), "need 4");
  ExpectRefused(Parse(R"({"a": {"dtype": "Q4", "shape": [2], "data_offsets": [0, 8]}})", 8),
                "unsupported safetensors dtype 'Q4'");
  ExpectRefused(Parse(R"({"a": {"dtype": 7, "shape": [2], "data_offsets": [0, 8]}})", 8), "dtype is not a string");
}

TEST(SafetensorsHostileTest, AbsurdShapesAreInvalidArgument) {
  // Products that overflow 64 bits, in elements or in bytes.
  ExpectRefused(Parse(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}})", 8),
                "overflows 64 bits");
  ExpectRefused(Parse(R"({"a": {"dtype": "F64", "shape": [4611686018427387904], "data_offsets": [0, 8]}})", 8),
                "shape[0]");  // 2^62 is beyond 2^53.
  ExpectRefused(Parse(R"({"a": {"dtype": "F64", "shape": [4503599627370496, 4096], "data_offsets": [0, 8]}})", 8),
                "overflows 64 bits");
  for (const char* dim : {"1.5", "-1", "-0.5", "1e300", "9007199254740994", "\"NaN\"", "\"8\"", "null", "[2]"}) {
    ExpectRefused(Parse(std::string(R"({"a": {"dtype": "U8", "shape": [1, )") + dim + R"(], "data_offsets": [0, 1]}})", 1),
                  "shape[1] is not an integer");
  }
  ExpectRefused(Parse(R"({"a": {"dtype": "U8", "shape": 3, "data_offsets": [0, 3]}})", 3), "shape is not a list");
  ExpectRefused(Parse(R"({"a": {"dtype": "U8", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1], "data_offsets": [0, 1]}})", 1),
                "rank 17");
}

TEST(SafetensorsHostileTest, OffsetsMustBeIntegralAndInsideTheData) {
  for (const char* offsets : {"[0.5, 1.5]", "[-1, 0]", "[0, 1e300]", "[\"0\", 1]", "[0]", "[0, 1, 2]", "5"}) {
    const absl::Status s =
        Parse(std::string(R"({"a": {"dtype": "U8", "shape": [1], "data_offsets": )") + offsets + "}}", 4);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << offsets << ": " << s;
    EXPECT_NE(std::string(s.message()).find("data_offsets"), std::string::npos) << s;
  }
  ExpectRefused(Parse(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})", 4),
                "bytes [2, 6) lie outside the data section of 4 bytes");
  ExpectRefused(Parse(R"({"a": {"dtype": "U8", "shape": [0], "data_offsets": [3, 2]}})", 4), "lie outside");
}

TEST(SafetensorsHostileTest, OverlappingTensorsAreRefused) {
  ExpectRefused(Parse(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                          "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}})", 8),
                "overlap");
  // Touching spans and empty tensors are fine.
  EXPECT_TRUE(Parse(R"({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
                        "b": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]},
                        "c": {"dtype": "U8", "shape": [0], "data_offsets": [2, 2]}})", 8).ok());
}

TEST(SafetensorsHostileTest, HeaderLengthIsBounded) {
  std::string image(8, '\0');
  image[4] = 1;  // 2^32 bytes: over the 100 MB cap, and over the file.
  absl::Status s = ParseSafetensorsBytes(image, "safetensors file 'x.safetensors'").status();
  ExpectRefused(s, "exceeds the limit of 100000000 bytes");
  image = std::string(8, '\0');
  image[0] = 16;
  ExpectRefused(ParseSafetensorsBytes(image + "{}", "safetensors file 'x.safetensors'").status(),
                "exceeds the file");
  ExpectRefused(ParseSafetensorsBytes("abc", "safetensors file 'x.safetensors'").status(), "shorter");
}

TEST(SafetensorsHostileTest, MessagesDoNotQuoteTheHeaderAndCutLongNames) {
  // Invalid JSON around a secret: protobuf's error text would quote it.
  absl::Status s = Parse(R"({"a": {"dtype": "F32", "secret": "sk-SECRET-42",, }})");
  ExpectRefused(s, "not a valid JSON object");
  EXPECT_EQ(std::string(s.message()).find("SECRET"), std::string::npos) << s;
  // A huge tensor name and dtype label are echoed only as a short, printable prefix.
  const std::string name = "\\u0001" + std::string(100000, 'n');  // A control character, escaped in JSON.
  s = Parse("{\"" + name + R"(": {"dtype": ")" + std::string(5000, 'D') + R"(", "shape": [], "data_offsets": [0, 0]}})");
  ExpectRefused(s, "tensor '?nnn");  // Printable in the message.
  EXPECT_NE(std::string(s.message()).find("(100001 bytes)"), std::string::npos) << s;
  EXPECT_NE(std::string(s.message()).find("(5000 bytes)"), std::string::npos) << s;
  s = Parse(R"({"__metadata__": {"k": 5}})");
  ExpectRefused(s, "__metadata__ entry 'k' is not a string");
  s = Parse(R"({"a": 5})");
  ExpectRefused(s, "tensor 'a' is not an object");
}

TEST(SafetensorsHostileTest, OpenRefusesABadFileNamingIt) {
  const std::string path = std::string(::testing::TempDir()) + "/hostile.safetensors";
  {
    std::ofstream out(path, std::ios::binary);
    const std::string image = Image(R"({"a": {"dtype": "F32", "shape": [1e300], "data_offsets": [0, 4]}})", 4);
    out.write(image.data(), static_cast<std::streamsize>(image.size()));
  }
  auto file = SafetensorsFile::Open(path);
  EXPECT_EQ(file.status().code(), absl::StatusCode::kInvalidArgument) << file.status();
  EXPECT_NE(std::string(file.status().message()).find(path), std::string::npos) << file.status();
}

}  // namespace
}  // namespace stowage
