// libFuzzer target: a config.json through the same parse + validate functions the loaders use, for
// every architecture (Z-Image transformer, AutoencoderKL, Qwen3, the tiny models, the scheduler),
// without building tensors. Any input must give OK, INVALID_ARGUMENT or UNIMPLEMENTED quickly; a
// config a reader accepts must pass its validator again (the reader validates what it returns).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "models/nets/autoencoder_kl.h"
#include "models/core/diffusers_format.h"
#include "models/pipelines/flow_match_scheduler.h"
#include "models/nets/qwen3_text_encoder.h"
#include "models/pipelines/tiny_models.h"
#include "models/nets/zimage_transformer.h"

namespace {

void Expect(const absl::Status& status) {
  if (!status.ok() && status.code() != absl::StatusCode::kInvalidArgument &&
      status.code() != absl::StatusCode::kUnimplemented) {
    std::abort();
  }
}

template <typename Config>
void Check(const absl::StatusOr<Config>& parsed, const std::string& file) {
  Expect(parsed.status());
  if (parsed.ok() && !stowage::Validate(*parsed, file).ok()) std::abort();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto json = stowage::ParseJsonObject(text, stowage::kConfigJsonLimits, "config.json");
  Expect(json.status());
  if (!json.ok()) return 0;
  const std::string file = "config.json";
  Check(stowage::ZImageTransformerConfigFromJson(*json, file), file);
  Check(stowage::AutoencoderKLConfigFromJson(*json, file), file);
  Check(stowage::Qwen3ConfigFromJson(*json, file), file);
  Check(stowage::TinyTextEncoderConfigFromJson(*json, {}, file), file);
  Check(stowage::TinyDiTConfigFromJson(*json, {}, file), file);
  Check(stowage::TinyVaeDecoderConfigFromJson(*json, {}, file), file);
  Check(stowage::FlowMatchSchedulerConfigFromJson(*json, {}, file), file);
  return 0;
}
