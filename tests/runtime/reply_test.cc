// A reply from what a run measured: peaks take the larger of the device's and the floors a remote
// call left, bytes are after minus before, this device's usage comes first, then the peers'; the
// image is encoded as asked and its encoding counted in the run time.
#include "runtime/reply.h"

#include <gtest/gtest.h>

namespace stowage {
namespace {

Image Gray(int w, int h) {
  Image image;
  image.width = w;
  image.height = h;
  image.rgb.assign(static_cast<size_t>(w) * h * 3, 128);
  return image;
}

TEST(ReplyTest, StatsComeFromTheMeasurementsAndThePeersFollowThisDevice) {
  GenerationParams params;
  params.seed = 99;
  ReplyFacts facts;
  facts.pipeline = "p";
  facts.request_id = "req-1";
  facts.device = "sim:0";
  facts.batch_size = 3;
  facts.queue_wait = absl::Milliseconds(5);
  facts.batch_wait = absl::Milliseconds(2);
  facts.run_time = absl::Milliseconds(100);
  facts.before.host_to_device_bytes = 1000;
  facts.after.host_to_device_bytes = 5000;
  facts.before.device_to_host_bytes = 10;
  facts.after.device_to_host_bytes = 30;
  facts.after.peak_allocated_bytes = 700;
  facts.peak_floor_allocated = 900;  // A remote call reset the peak after it reached 900.
  facts.after.peak_reserved_bytes = 800;
  facts.after.context_bytes = 100;
  facts.peak_floor_reserved = 50;
  facts.peak_cpu_rss_bytes = 12345;
  // The allocator ran short 7 times (2 of them while a preempting request ran) and raised 3
  // out-of-memory errors (1 of them then).
  facts.before.allocator_retries = 4;
  facts.after.allocator_retries = 11;
  facts.preempted_allocator_retries = 2;
  facts.before.allocator_ooms = 1;
  facts.after.allocator_ooms = 4;
  facts.preempted_allocator_ooms = 1;
  v1::DeviceUsage peer;
  peer.set_device("sim:1");
  peer.set_host_to_device_bytes(77);
  const v1::GenerateResponse reply =
      BuildReply(Gray(16, 8), params, facts, {{"denoise", absl::Milliseconds(90), true}}, {peer});
  EXPECT_EQ(reply.width(), 16);
  EXPECT_EQ(reply.height(), 8);
  EXPECT_EQ(reply.seed(), 99u);
  EXPECT_EQ(reply.request_id(), "req-1");
  const v1::RequestStats& s = reply.stats();
  EXPECT_EQ(s.peak_device_memory_bytes(), 900);
  EXPECT_EQ(s.peak_device_reserved_bytes(), 900);  // 800 reserved + 100 context.
  EXPECT_EQ(s.host_to_device_bytes(), 4000);
  EXPECT_EQ(s.device_to_host_bytes(), 20);
  EXPECT_EQ(s.peak_cpu_rss_bytes(), 12345);
  EXPECT_EQ(s.allocator_retries(), 5);
  EXPECT_EQ(s.allocator_ooms(), 2);
  EXPECT_EQ(s.batch_size(), 3);
  ASSERT_EQ(s.stages_size(), 1);
  EXPECT_TRUE(s.stages(0).shared());
  ASSERT_EQ(s.devices_size(), 2);
  EXPECT_EQ(s.devices(0).device(), "sim:0");
  EXPECT_EQ(s.devices(0).host_to_device_bytes(), 4000);
  EXPECT_EQ(s.devices(1).device(), "sim:1");
  EXPECT_EQ(s.devices(1).host_to_device_bytes(), 77);
}

TEST(ReplyTest, TheImageIsEncodedAsAskedAndItsTimeCounted) {
  for (v1::ImageFormat format : {v1::IMAGE_FORMAT_UNSPECIFIED, v1::IMAGE_FORMAT_PNG, v1::IMAGE_FORMAT_PNG_FAST,
                                 v1::IMAGE_FORMAT_RGB}) {
    v1::GenerateResponse reply = BuildReply(Gray(16, 8), {}, {}, {}, {});
    *reply.mutable_stats()->mutable_run_time() = ToProto(absl::Seconds(1));
    ASSERT_TRUE(EncodeReplyImage(Gray(16, 8), format, reply).ok());
    if (format == v1::IMAGE_FORMAT_RGB) {
      EXPECT_EQ(reply.format(), v1::IMAGE_FORMAT_RGB);
      EXPECT_EQ(reply.image().size(), 16u * 8 * 3);
    } else {
      EXPECT_EQ(reply.image().substr(1, 3), "PNG");
      EXPECT_EQ(reply.format(), format == v1::IMAGE_FORMAT_PNG_FAST ? v1::IMAGE_FORMAT_PNG_FAST : v1::IMAGE_FORMAT_PNG);
    }
    ASSERT_EQ(reply.stats().stages_size(), 1);
    EXPECT_EQ(reply.stats().stages(0).stage(), "encode_image");
    EXPECT_EQ(FromProto(reply.stats().run_time()), absl::Seconds(1) + FromProto(reply.stats().stages(0).duration()));
  }
}

}  // namespace
}  // namespace stowage
