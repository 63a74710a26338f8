// Requests against a pipeline's limits, without a device or a server: each out-of-range field is
// refused naming itself and what is allowed; defaults are filled; a valid request passes intact.
#include "runtime/request_validation.h"

#include <memory>
#include <string>

#include <gtest/gtest.h>

#include "tests/runtime/latch_pipeline.h"

namespace stowage {
namespace {

class RequestValidationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    PipelineLoadOptions options;
    options.name = "latch";
    auto created = LatchRegistry(std::make_shared<LatchGate>()).CreateBuiltin("latch", options);
    ASSERT_TRUE(created.ok()) << created.status();
    pipeline_ = std::move(*created);
  }
  absl::StatusOr<GenerationParams> Check(const v1::GenerateRequest& request, bool split = false) {
    return ValidateRequest(request, *pipeline_, adapters_, split);
  }
  static v1::GenerateRequest Good() {
    v1::GenerateRequest r;
    r.set_prompt("a red square");
    return r;
  }
  // The refusal of `request`: its code, and that its message contains `part`.
  void ExpectRefused(const v1::GenerateRequest& request, absl::StatusCode code, const std::string& part,
                     bool split = false) {
    const absl::StatusOr<GenerationParams> checked = Check(request, split);
    ASSERT_FALSE(checked.ok()) << "accepted: " << request.ShortDebugString();
    EXPECT_EQ(checked.status().code(), code) << checked.status();
    EXPECT_NE(checked.status().message().find(part), std::string::npos) << checked.status();
  }

  std::unique_ptr<Pipeline> pipeline_;
  AdapterTable adapters_;
};

TEST_F(RequestValidationTest, AValidRequestGetsThePipelinesDefaultsAndASeed) {
  v1::GenerateRequest r = Good();
  absl::StatusOr<GenerationParams> params = Check(r);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->prompt, "a red square");
  EXPECT_EQ(params->width, 64);
  EXPECT_EQ(params->height, 64);
  EXPECT_EQ(params->steps, 2);
  r.set_seed(42);
  r.set_width(128);
  r.set_num_inference_steps(5);
  params = Check(r);
  ASSERT_TRUE(params.ok()) << params.status();
  EXPECT_EQ(params->seed, 42u);
  EXPECT_EQ(params->width, 128);
  EXPECT_EQ(params->height, 64);
  EXPECT_EQ(params->steps, 5);
}

TEST_F(RequestValidationTest, EachOutOfRangeFieldIsRefusedNamingItself) {
  v1::GenerateRequest r = Good();
  r.clear_prompt();
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "prompt is required");
  r = Good();
  r.set_prompt(std::string(127, 'a'));
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "prompt is 127 bytes; at most 126");
  r = Good();
  r.set_prompt("bad \xff utf8");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "prompt is not valid UTF-8");
  r = Good();
  r.set_width(100);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "width is 100; allowed: 64 to 256 in multiples of 16");
  r = Good();
  r.set_height(512);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "height is 512");
  r = Good();
  r.set_num_inference_steps(101);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "num_inference_steps is 101; allowed: 1 to 100");
  r = Good();
  r.set_guidance_scale(-1.0f);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "guidance_scale is -1");
  r = Good();
  r.set_partial_images(4);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "partial_images is 4");
  r = Good();
  r.set_priority(10);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "priority is 10");
  r = Good();
  r.set_tenant("no spaces allowed");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "tenant no spaces allowed is not at most 64 characters");
  r = Good();
  r.set_request_id("tab\there");
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "request_id must be printable ASCII");
  r = Good();
  r.set_output_format(static_cast<v1::ImageFormat>(99));
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "output_format 99 is not supported");
  r = Good();
  r.set_strength(0.5);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "strength: only for requests with an image");
}

TEST_F(RequestValidationTest, AdaptersMustBeLoadedNamedOnceAndNotOnASplitPipeline) {
  v1::GenerateRequest r = Good();
  v1::LoraRef* ref = r.add_loras();
  ref->set_name("style");
  ref->set_scale(1.0f);
  ExpectRefused(r, absl::StatusCode::kFailedPrecondition, "runs on several devices", /*split=*/true);
  const absl::StatusOr<GenerationParams> unknown = Check(r);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("loras[0]"), std::string::npos) << unknown.status();
  ref->set_scale(11.0f);
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "loras[0].scale is 11");
  r.clear_loras();
  for (int i = 0; i < 9; ++i) r.add_loras()->set_name("a" + std::to_string(i));
  ExpectRefused(r, absl::StatusCode::kInvalidArgument, "loras: 9 adapters; at most 8");
}

}  // namespace
}  // namespace stowage
