#include "offload/host_spill.h"

#include <dirent.h>
#include <linux/magic.h>
#include <sys/vfs.h>
#include <unistd.h>
#include <stdlib.h>

#include <memory>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "base/process_memory.h"
#include "offload/safetensors.h"
#include "tests/offload/spill_dir.h"
#include "tests/offload/stack_model.h"

namespace stowage {
namespace {

std::string MakeTempDir() { return MakeSpillTestDir(); }

int FilesIn(const std::string& dir) {
  int n = 0;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return -1;
  while (dirent* e = ::readdir(d)) {
    if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") ++n;
  }
  ::closedir(d);
  return n;
}

bool Mapped(const at::Tensor& t) { return !MappedFilesContaining({t.data_ptr()}).empty(); }

int64_t Rss() {
  absl::StatusOr<ProcessMemory> m = ReadProcessMemory();
  return m.ok() ? m->rss_bytes : -1;
}

TEST(HostSpillTest, SpilledTensorsKeepTheirValuesAsViewsOfAFileThatIsRemoved) {
  StackModel model;
  std::vector<at::Tensor> before;
  int slots = 0;
  model.ForEachModule([&](Module& m) {
    for (TensorSlot& s : m.slots()) {
      before.push_back(s.value.clone());
      ++slots;
    }
  });
  const at::Tensor x = at::randn({3, 16});
  const at::Tensor out_before = model.Forward(x);

  const std::string dir = MakeTempDir();
  ASSERT_FALSE(dir.empty());
  absl::StatusOr<SpillStats> stats = SpillHeapTensors(model, dir, "stack", /*min_bytes=*/0);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->tensors, slots);
  EXPECT_EQ(stats->bytes, StackModel::kTotalBytes);
  EXPECT_EQ(FilesIn(dir), 0) << "the spill file is removed once mapped";

  size_t i = 0;
  model.ForEachModule([&](Module& m) {
    for (TensorSlot& s : m.slots()) {
      EXPECT_TRUE(Mapped(s.value)) << m.path() << "." << s.name;
      EXPECT_EQ(s.value.scalar_type(), before[i].scalar_type());
      EXPECT_EQ(s.value.sizes(), before[i].sizes());
      EXPECT_TRUE(at::equal(s.value, before[i])) << m.path() << "." << s.name;
      EXPECT_EQ(reinterpret_cast<uintptr_t>(s.value.data_ptr()) % 64, 0u);
      ++i;
    }
  });
  EXPECT_TRUE(at::equal(model.Forward(x), out_before));

  // Everything is a file's view now: a second spill has nothing to do and writes nothing.
  absl::StatusOr<SpillStats> again = SpillHeapTensors(model, dir, "stack", 0);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->tensors, 0);
  EXPECT_EQ(again->bytes, 0);
  EXPECT_EQ(FilesIn(dir), 0);
}

TEST(HostSpillTest, SmallTensorsStayAndSharedMemoryStaysShared) {
  Module root("Root");
  const at::Tensor big = at::randn({64, 64});    // 16 KiB.
  const at::Tensor small = at::randn({8});       // 32 bytes.
  root.AddParameter("a", big);
  root.AddParameter("b", big);  // The same memory in two slots.
  root.AddParameter("c", small);
  const std::string dir = MakeTempDir();
  absl::StatusOr<SpillStats> stats = SpillHeapTensors(root, dir, "tied weights/../x", 4096);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->tensors, 2);
  EXPECT_EQ(stats->bytes, 64 * 64 * 4);
  const auto& s = root.slots();
  EXPECT_TRUE(Mapped(s[0].value));
  EXPECT_EQ(s[0].value.data_ptr(), s[1].value.data_ptr());
  EXPECT_TRUE(at::equal(s[0].value, big));
  EXPECT_FALSE(Mapped(s[2].value));
  EXPECT_EQ(s[2].value.data_ptr(), small.data_ptr());
}

TEST(HostSpillTest, SpilledTensorsLeaveTheProcessRssUntilReadAndCanBeReleasedAgain) {
  Module root("Root");
  constexpr int64_t kBytes = 192LL << 20;
  root.AddParameter("w", at::rand({kBytes / 4}));  // Written: its pages are in RSS.
  const at::Tensor copy_sum = root.slots()[0].value.sum();
  const int64_t before = Rss();
  ASSERT_GT(before, kBytes);
  const std::string dir = MakeTempDir();
  absl::StatusOr<SpillStats> stats = SpillHeapTensors(root, dir, "big");
  ASSERT_TRUE(stats.ok()) << stats.status();
  const int64_t after = Rss();
  EXPECT_LT(after, before - kBytes * 3 / 4) << "before " << before << " after " << after;
  // Read through the mapping: the same values, its pages back in RSS; released again afterwards.
  const at::Tensor w = root.slots()[0].value;
  EXPECT_TRUE(at::allclose(w.sum(), copy_sum));
  EXPECT_GT(Rss(), after + kBytes * 3 / 4);
  EXPECT_GE(ReleaseMappedPages(w.data_ptr(), static_cast<int64_t>(w.nbytes())), kBytes - 8192);
  EXPECT_LT(Rss(), after + kBytes / 4);
}

TEST(HostSpillTest, ABadDirectoryIsRefusedByNameAndChangesNothing) {
  Module root("Root");
  root.AddParameter("w", at::randn({64, 64}));
  const void* was = root.slots()[0].value.data_ptr();

  absl::StatusOr<SpillStats> empty = SpillHeapTensors(root, "", "x");
  EXPECT_EQ(empty.status().code(), absl::StatusCode::kInvalidArgument);

  const std::string missing = MakeTempDir() + "/no/such/dir";
  absl::StatusOr<SpillStats> gone = SpillHeapTensors(root, missing, "x");
  EXPECT_EQ(gone.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(gone.status().message().find(missing), std::string::npos) << gone.status();

  const std::string dir = MakeTempDir();
  const std::string file = dir + "/plain-file";
  ASSERT_TRUE(WriteSafetensors(file, {{"x", at::zeros({4})}}).ok());
  absl::StatusOr<SpillStats> not_dir = SpillHeapTensors(root, file, "x");
  EXPECT_EQ(not_dir.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(not_dir.status().message().find("not a writable directory"), std::string::npos);

  EXPECT_EQ(root.slots()[0].value.data_ptr(), was);
  EXPECT_EQ(FilesIn(dir), 1);

  // A tmpfs would keep the "spilled" bytes in RAM: refused by name.
  struct statfs fs;
  if (::statfs("/dev/shm", &fs) == 0 && fs.f_type == TMPFS_MAGIC && ::access("/dev/shm", W_OK) == 0) {
    absl::StatusOr<SpillStats> ram = SpillHeapTensors(root, "/dev/shm", "x");
    EXPECT_EQ(ram.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_NE(ram.status().message().find("tmpfs or ramfs"), std::string::npos) << ram.status();
    EXPECT_EQ(root.slots()[0].value.data_ptr(), was);
  }
}

}  // namespace
}  // namespace stowage
