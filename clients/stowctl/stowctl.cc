// stowctl: command-line client of a Stowage server.
//
//   stowctl [--target=HOST:PORT] generate --prompt="a red fox" [--out=fox.png] [--steps=8] ...
//   stowctl stream --prompt=...        (prints progress as it arrives, then the result)
//   stowctl pipelines
//   stowctl health                     (grpc.health.v1: exit 0 only when the server is SERVING)
//   stowctl ready [--pipelines=a,b]    (health, and the pipelines READY: a readiness probe)
//   stowctl --tls [--ca_cert=ca.pem] [--server_name=NAME] ...   (any command over TLS)
//
// Exit status: 0 success, 1 the server returned an error (or, for health/ready, is not serving or
// not ready), 2 bad usage.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"
#include "base/bounded_read.h"
#include "base/command_line.h"
#include "clients/stowctl/format.h"
#include "google/protobuf/text_format.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address HOST:PORT.");
ABSL_FLAG(bool, tls, false, "Connect with TLS (the server's config has tls { cert_file key_file }).");
ABSL_FLAG(std::string, ca_cert, "",
          "With --tls: PEM file of the CA certificates that verify the server; empty: the system's roots.");
ABSL_FLAG(std::string, server_name, "",
          "With --tls: the name the server's certificate must carry, when it is not the --target host "
          "(for example a certificate for 'stowage.default.svc' reached at 127.0.0.1).");
ABSL_FLAG(std::string, pipelines, "",
          "ready: comma-separated pipelines that must be READY; empty: at least one READY pipeline.");
ABSL_FLAG(double, timeout, 0, "Deadline in seconds for the call; 0 means none.");
ABSL_FLAG(std::string, pipeline, "", "Pipeline name; empty selects the server's default.");
ABSL_FLAG(std::string, prompt, "", "Text to depict (generate, stream).");
ABSL_FLAG(std::string, negative_prompt, "", "Text to steer away from.");
ABSL_FLAG(int32_t, width, 0, "Image width in pixels; 0 = pipeline default.");
ABSL_FLAG(int32_t, height, 0, "Image height in pixels; 0 = pipeline default.");
ABSL_FLAG(int32_t, steps, 0, "Denoising steps; 0 = pipeline default.");
ABSL_FLAG(std::string, guidance, "", "Guidance scale; empty = pipeline default.");
ABSL_FLAG(std::string, seed, "", "Noise seed (unsigned 64-bit); empty = random.");
ABSL_FLAG(std::string, request_id, "", "Client request identifier.");
ABSL_FLAG(int32_t, priority, 0, "Scheduling priority, 0 (default) ..9: higher runs first (generate, stream).");
ABSL_FLAG(std::string, tenant, "",
          "Who the request is for, for fair shares (generate, stream): at most 64 characters of [A-Za-z0-9._-].");
ABSL_FLAG(std::string, out, "", "Where to write the image (generate, stream).");
ABSL_FLAG(std::string, format, "png",
          "generate/stream: image format of the reply: png (compressed), png_fast (uncompressed PNG, encoded "
          "in milliseconds) or rgb (raw 8-bit RGB rows; written as they come)");
ABSL_FLAG(bool, json, false,
          "generate/stream: print the reply's statistics as JSON instead of a table; placement: the whole "
          "GetPlacement reply as JSON (every counter of the streamed components) instead of the summary.");
ABSL_FLAG(std::string, token, "",
          "Admin bearer token (admin commands); defaults to the STOWAGE_TOKEN environment variable.");
ABSL_FLAG(std::string, strategy, "",
          "set-strategy: an OffloadStrategy in protobuf text format, e.g. 'custom: \"lru\"' or "
          "'workflow { rules { after { component: \"text_encoder\" offload: \"text_encoder\" } } }'.");
ABSL_FLAG(std::string, component, "",
          "enable/disable-group-offload: component id '<pipeline>/<name>'. move-component: the component's "
          "name within --pipeline (e.g. text_encoder).");
ABSL_FLAG(std::string, options, "",
          "enable-group-offload: GroupOffloadConfig in text format, e.g. 'use_stream: true offload_type: LEAF_LEVEL'.");
ABSL_FLAG(std::string, name, "", "load-pipeline / unload-pipeline: pipeline name; load-adapter / unload-adapter: adapter name.");
ABSL_FLAG(uint64_t, weight_seed, 0, "load-pipeline: seed of the built-in pipeline's random weights.");
ABSL_FLAG(std::string, model_dir, "", "load-pipeline: a diffusers-format directory instead of the built-in.");
ABSL_FLAG(std::string, builtin, "zimage-tiny",
          "load-pipeline without --model_dir: the built-in architecture (zimage-tiny or tiny).");
ABSL_FLAG(int32_t, limit, 100, "placement-log: number of decisions.");
ABSL_FLAG(std::vector<std::string>, lora, {},
          "generate/stream: LoRA adapters loaded on the pipeline, NAME or NAME:SCALE (scale 1 by default, "
          "-10..10), comma-separated.");
ABSL_FLAG(std::string, path, "", "load-adapter: the adapter's safetensors file (PEFT / diffusers layout), on the server.");
ABSL_FLAG(double, alpha, 0, "load-adapter: LoRA alpha for layers whose file gives none (0: factor 1).");
ABSL_FLAG(int32_t, partial_images, 0, "stream: previews of the image while it denoises, 0..3.");
ABSL_FLAG(std::string, image, "",
          "generate/stream: a PNG file to start from (image to image; Z-Image and Flux pipelines). Width and height "
          "0 take its size.");
ABSL_FLAG(std::string, mask, "",
          "generate/stream with --image: a PNG the image's size; white (or transparent) pixels are repainted, the "
          "rest kept (inpainting).");
ABSL_FLAG(std::string, strength, "",
          "generate/stream with --image: how much of the schedule runs from it, above 0 and at most 1; empty = 0.6, "
          "or 1.0 with --mask.");
ABSL_FLAG(std::string, device, "",
          "Admin commands: the device to act on or describe (\"cuda:1\", \"sim:0\"); empty = the server's "
          "first. drain-device / resume-device: required.");
ABSL_FLAG(int32_t, max_batch_size, 1, "set-batching: most requests per batch, 1 (off) ..64.");
ABSL_FLAG(std::string, scheduler, "",
          "set-scheduler: a SchedulerConfig in protobuf text format, e.g. 'max_reorder_delay_ms: 4000' or "
          "'priority_mode: PRIORITY_WEIGHTED tenant_weights { key: \"gold\" value: 2 }'; empty = first come, "
          "first served.");
ABSL_FLAG(int64_t, memory_budget_bytes, -1,
          "set-memory-budget: the device's memory budget in bytes, its context included; 0 = the whole "
          "device (required).");
ABSL_FLAG(int32_t, max_queue_delay_ms, 0,
          "set-batching: how long a batch waits for more requests, 0..60000 ms.");

namespace {

using stowage::v1::GenerationService;

constexpr int kUsageError = 2;
constexpr int kRpcError = 1;

int Usage(const std::string& message) {
  std::cerr << "stowctl: " << message << "\n"
            << "usage: stowctl [--target=HOST:PORT] [--timeout=S] [--tls [--ca_cert=F] [--server_name=N]] "
               "generate|stream|pipelines|health|ready [flags]\n"
            << "       stowctl --token=T placement|set-strategy|enable-group-offload|"
               "disable-group-offload|load-pipeline|unload-pipeline|load-adapter|unload-adapter|placement-log|"
               "set-batching|set-scheduler|get-scheduler|drain-device|resume-device|"
               "move-component|set-memory-budget [flags]\n"
            << "run 'stowctl --help' for the flags\n";
  return kUsageError;
}

// `message` as one line of JSON, every field printed (zeros too).
void PrintJson(const google::protobuf::Message& message) {
  std::string json;
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  (void)google::protobuf::util::MessageToJsonString(message, &json, options);
  std::cout << json << std::endl;
}

int RpcFailure(const grpc::Status& status) {
  std::cerr << "error: " << status.error_code() << " " << status.error_message() << "\n";
  return kRpcError;
}

void SetDeadline(grpc::ClientContext& context) {
  const double timeout = absl::GetFlag(FLAGS_timeout);
  if (timeout > 0) {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::microseconds(static_cast<int64_t>(timeout * 1e6)));
  }
}

// Builds the request from flags; returns false (after printing why) on a malformed flag.
bool BuildRequest(stowage::v1::GenerateRequest& request) {
  request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
  request.set_prompt(absl::GetFlag(FLAGS_prompt));
  request.set_negative_prompt(absl::GetFlag(FLAGS_negative_prompt));
  request.set_width(absl::GetFlag(FLAGS_width));
  request.set_height(absl::GetFlag(FLAGS_height));
  request.set_num_inference_steps(absl::GetFlag(FLAGS_steps));
  request.set_request_id(absl::GetFlag(FLAGS_request_id));
  request.set_priority(absl::GetFlag(FLAGS_priority));
  request.set_tenant(absl::GetFlag(FLAGS_tenant));
  for (const std::string& lora : absl::GetFlag(FLAGS_lora)) {
    stowage::v1::LoraRef* ref = request.add_loras();
    const size_t colon = lora.rfind(':');
    ref->set_name(lora.substr(0, colon));
    ref->set_scale(1.0f);
    if (colon != std::string::npos) {
      float scale = 0;
      if (!absl::SimpleAtof(lora.substr(colon + 1), &scale)) {
        std::cerr << "stowctl: --lora '" << lora << "' is not NAME or NAME:SCALE\n";
        return false;
      }
      ref->set_scale(scale);
    }
  }
  const std::string format = absl::GetFlag(FLAGS_format);
  if (format == "png") {
    request.set_output_format(stowage::v1::IMAGE_FORMAT_PNG);
  } else if (format == "png_fast") {
    request.set_output_format(stowage::v1::IMAGE_FORMAT_PNG_FAST);
  } else if (format == "rgb") {
    request.set_output_format(stowage::v1::IMAGE_FORMAT_RGB);
  } else {
    std::cerr << "stowctl: --format '" << format << "' is not one of png, png_fast, rgb\n";
    return false;
  }
  const std::string guidance = absl::GetFlag(FLAGS_guidance);
  if (!guidance.empty()) {
    float g = 0;
    if (!absl::SimpleAtof(guidance, &g)) {
      std::cerr << "stowctl: --guidance '" << guidance << "' is not a number\n";
      return false;
    }
    request.set_guidance_scale(g);
  }
  // Images in: the files are read here (at most the server's request size); the server checks
  // their contents.
  auto read_file = [](const std::string& flag, const std::string& path, std::string* out) {
    absl::StatusOr<std::string> bytes = stowage::ReadFileAtMost(path, 32 << 20);
    if (!bytes.ok() || bytes->empty()) {
      std::cerr << "stowctl: cannot read " << flag << " '" << path << "'"
                << (bytes.ok() ? ": empty" : absl::StrCat(": ", bytes.status().message())) << "\n";
      return false;
    }
    *out = *std::move(bytes);
    return true;
  };
  const std::string image = absl::GetFlag(FLAGS_image), mask = absl::GetFlag(FLAGS_mask);
  const std::string strength = absl::GetFlag(FLAGS_strength);
  if ((!mask.empty() || !strength.empty()) && image.empty()) {
    std::cerr << "stowctl: --mask and --strength need --image\n";
    return false;
  }
  if (!image.empty() && !read_file("--image", image, request.mutable_image())) return false;
  if (!mask.empty() && !read_file("--mask", mask, request.mutable_mask())) return false;
  if (!strength.empty()) {
    double s = 0;
    if (!absl::SimpleAtod(strength, &s)) {
      std::cerr << "stowctl: --strength '" << strength << "' is not a number\n";
      return false;
    }
    request.set_strength(s);
  }
  const std::string seed = absl::GetFlag(FLAGS_seed);
  if (!seed.empty()) {
    uint64_t s = 0;
    if (!absl::SimpleAtoi(seed, &s)) {
      std::cerr << "stowctl: --seed '" << seed << "' is not an unsigned 64-bit integer\n";
      return false;
    }
    request.set_seed(s);
  }
  if (request.prompt().empty()) {
    std::cerr << "stowctl: --prompt is required\n";
    return false;
  }
  return true;
}

int WriteResult(const stowage::v1::GenerateResponse& response) {
  const std::string out = absl::GetFlag(FLAGS_out);
  if (!out.empty()) {
    std::ofstream file(out, std::ios::binary);
    file.write(response.image().data(), static_cast<std::streamsize>(response.image().size()));
    if (!file) {
      std::cerr << "error: cannot write " << out << "\n";
      return kRpcError;
    }
  }
  if (absl::GetFlag(FLAGS_json)) {
    PrintJson(response.stats());
    return 0;
  }
  std::cout << stowage::FormatGenerateResponse(response, out);
  return 0;
}

int Generate(GenerationService::Stub& stub) {
  stowage::v1::GenerateRequest request;
  if (!BuildRequest(request)) return kUsageError;
  grpc::ClientContext context;
  SetDeadline(context);
  stowage::v1::GenerateResponse response;
  const grpc::Status status = stub.Generate(&context, request, &response);
  if (!status.ok()) return RpcFailure(status);
  return WriteResult(response);
}

int Stream(GenerationService::Stub& stub) {
  stowage::v1::GenerateRequest request;
  if (!BuildRequest(request)) return kUsageError;
  request.set_partial_images(absl::GetFlag(FLAGS_partial_images));
  grpc::ClientContext context;
  SetDeadline(context);
  std::unique_ptr<grpc::ClientReader<stowage::v1::GenerateStreamResponse>> reader =
      stub.GenerateStream(&context, request);
  stowage::v1::GenerateStreamResponse message;
  bool have_result = false;
  stowage::v1::GenerateResponse result;
  while (reader->Read(&message)) {
    if (message.has_progress()) {
      std::cout << stowage::FormatProgress(message.progress()) << std::endl;
    } else if (message.has_partial_image()) {
      // Previews go beside --out: OUT.partial<i>.png (not written without --out).
      const stowage::v1::PartialImage& partial = message.partial_image();
      const std::string out = absl::GetFlag(FLAGS_out);
      std::cout << "preview " << partial.index() << " after step " << partial.step() << " (" << partial.width()
                << "x" << partial.height() << ")";
      if (!out.empty()) {
        const std::string path = absl::StrCat(out, ".partial", partial.index(), ".png");
        std::ofstream(path, std::ios::binary) << partial.image();
        std::cout << ": " << path;
      }
      std::cout << std::endl;
    } else if (message.has_result()) {
      result = message.result();
      have_result = true;
    }
  }
  const grpc::Status status = reader->Finish();
  if (!status.ok()) return RpcFailure(status);
  if (!have_result) return RpcFailure(grpc::Status(grpc::StatusCode::INTERNAL, "stream ended without a result"));
  return WriteResult(result);
}

int Pipelines(GenerationService::Stub& stub) {
  grpc::ClientContext context;
  SetDeadline(context);
  stowage::v1::ListPipelinesResponse response;
  const grpc::Status status = stub.ListPipelines(&context, {}, &response);
  if (!status.ok()) return RpcFailure(status);
  std::cout << stowage::FormatPipelines(response);
  return 0;
}

// grpc.health.v1.Health/Check for the overall service (""), through the generic stub: the health
// messages are two fields, and Debian ships no generated C++ stubs for them. Sets `serving` from the
// reply's status field (1 = SERVING; 2 = NOT_SERVING; absent = UNKNOWN).
grpc::Status HealthCheck(const std::shared_ptr<grpc::Channel>& channel, bool* serving) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  SetDeadline(context);
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1), response;  // HealthCheckRequest{service: ""}: zero bytes.
  absl::Notification done;
  grpc::Status status;
  stub.UnaryCall(&context, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   status = std::move(s);
                   done.Notify();
                 });
  done.WaitForNotification();
  std::string bytes;
  std::vector<grpc::Slice> slices;
  if (status.ok() && response.Dump(&slices).ok()) {
    for (const auto& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  }
  *serving = bytes == std::string("\x08\x01", 2);  // Field 1 (status), varint 1 (SERVING).
  return status;
}

int Health(const std::shared_ptr<grpc::Channel>& channel) {
  bool serving = false;
  const grpc::Status status = HealthCheck(channel, &serving);
  if (!status.ok()) return RpcFailure(status);
  std::cout << (serving ? "SERVING" : "NOT_SERVING") << "\n";
  return serving ? 0 : kRpcError;
}

// A readiness probe: the server is SERVING and the pipelines are READY (--pipelines names them;
// without it, at least one must be). A pipeline still LOADING, being unloaded or FAILED is not
// ready, nor is a name the server does not host.
int Ready(const std::shared_ptr<grpc::Channel>& channel, GenerationService::Stub& stub) {
  bool serving = false;
  grpc::Status status = HealthCheck(channel, &serving);
  if (!status.ok()) return RpcFailure(status);
  if (!serving) {
    std::cout << "not ready: the server is not SERVING\n";
    return kRpcError;
  }
  grpc::ClientContext context;
  SetDeadline(context);
  stowage::v1::ListPipelinesResponse response;
  status = stub.ListPipelines(&context, {}, &response);
  if (!status.ok()) return RpcFailure(status);
  std::vector<std::string> wanted = absl::StrSplit(absl::GetFlag(FLAGS_pipelines), ',', absl::SkipWhitespace());
  std::vector<std::string> not_ready;
  int ready = 0;
  for (const auto& p : response.pipelines()) {
    if (p.state() == stowage::v1::PIPELINE_READY) ++ready;
  }
  for (const std::string& name : wanted) {
    const stowage::v1::Pipeline* found = nullptr;
    for (const auto& p : response.pipelines()) {
      if (p.name() == name) found = &p;
    }
    if (found == nullptr) {
      not_ready.push_back(name + " (not hosted)");
    } else if (found->state() != stowage::v1::PIPELINE_READY) {
      not_ready.push_back(name + " (" + stowage::v1::PipelineState_Name(found->state()) + ")");
    }
  }
  if (wanted.empty() && ready == 0) not_ready.push_back("no pipeline is READY");
  if (!not_ready.empty()) {
    std::cout << "not ready: " << absl::StrJoin(not_ready, ", ") << "\n";
    return kRpcError;
  }
  std::cout << "ready: " << ready << " pipeline(s) READY\n";
  return 0;
}

// Plaintext, or TLS with --tls (the CA bundle of --ca_cert, the name of --server_name). Returns
// null after printing why when the flags are inconsistent or the CA file cannot be read.
std::shared_ptr<grpc::ChannelCredentials> Credentials(grpc::ChannelArguments& channel_args) {
  const std::string ca_cert = absl::GetFlag(FLAGS_ca_cert);
  const std::string server_name = absl::GetFlag(FLAGS_server_name);
  if (!absl::GetFlag(FLAGS_tls)) {
    if (!ca_cert.empty() || !server_name.empty()) {
      Usage("--ca_cert and --server_name need --tls");
      return nullptr;
    }
    return grpc::InsecureChannelCredentials();
  }
  grpc::SslCredentialsOptions options;
  if (!ca_cert.empty()) {
    std::ifstream in(ca_cert, std::ios::binary);
    std::stringstream pem;
    pem << in.rdbuf();
    if (!in || pem.str().empty()) {
      Usage(absl::StrCat("cannot read --ca_cert '", ca_cert, "'"));
      return nullptr;
    }
    options.pem_root_certs = pem.str();
  }
  if (!server_name.empty()) channel_args.SetSslTargetNameOverride(server_name);
  return grpc::SslCredentials(options);
}

using stowage::v1::AdminService;

std::string Token() {
  std::string token = absl::GetFlag(FLAGS_token);
  if (token.empty()) {
    const char* env = std::getenv("STOWAGE_TOKEN");
    if (env != nullptr) token = env;
  }
  return token;
}

void Authorize(grpc::ClientContext& context) {
  SetDeadline(context);
  const std::string token = Token();
  if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

template <typename Message>
bool ParseText(const std::string& flag, const std::string& text, Message* message) {
  if (!google::protobuf::TextFormat::ParseFromString(text, message)) {
    std::cerr << "stowctl: --" << flag << " is not a valid " << message->GetTypeName()
              << " in protobuf text format\n";
    return false;
  }
  return true;
}

int Placement(AdminService::Stub& stub) {
  grpc::ClientContext context;
  Authorize(context);
  stowage::v1::GetPlacementResponse r;
  stowage::v1::GetPlacementRequest request;
  request.set_device(absl::GetFlag(FLAGS_device));
  const grpc::Status status = stub.GetPlacement(&context, request, &r);
  if (!status.ok()) return RpcFailure(status);
  if (absl::GetFlag(FLAGS_json)) {  // Every field, the streamed components' counters included.
    PrintJson(r);
    return 0;
  }
  std::cout << stowage::FormatPlacement(r);
  return 0;
}

template <typename Request, typename Response, typename Call>
int AdminCall(const Request& request, Call call) {
  grpc::ClientContext context;
  Authorize(context);
  Response response;
  const grpc::Status status = call(&context, request, &response);
  if (!status.ok()) return RpcFailure(status);
  std::string text;
  google::protobuf::TextFormat::PrintToString(response, &text);
  std::cout << text;
  return 0;
}

int Admin(const std::string& command, AdminService::Stub& stub) {
  using namespace stowage::v1;  // NOLINT: message names read better unqualified here.
  if (command == "placement") return Placement(stub);
  if (command == "set-strategy") {
    SetOffloadStrategyRequest request;
    request.set_device(absl::GetFlag(FLAGS_device));
    if (!ParseText("strategy", absl::GetFlag(FLAGS_strategy), request.mutable_strategy())) return kUsageError;
    return AdminCall<SetOffloadStrategyRequest, SetOffloadStrategyResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.SetOffloadStrategy(c, q, r); });
  }
  if (command == "enable-group-offload" || command == "disable-group-offload") {
    const std::string component = absl::GetFlag(FLAGS_component);
    const std::string pipeline = absl::GetFlag(FLAGS_pipeline);
    if (component.empty() == pipeline.empty()) {
      std::cerr << "stowctl: give exactly one of --component or --pipeline\n";
      return kUsageError;
    }
    if (command == "enable-group-offload") {
      EnableGroupOffloadRequest request;
      request.set_device(absl::GetFlag(FLAGS_device));
      if (!component.empty()) request.set_component_id(component);
      if (!pipeline.empty()) request.set_pipeline(pipeline);
      if (!ParseText("options", absl::GetFlag(FLAGS_options), request.mutable_options())) return kUsageError;
      return AdminCall<EnableGroupOffloadRequest, EnableGroupOffloadResponse>(
          request, [&](auto* c, const auto& q, auto* r) { return stub.EnableGroupOffload(c, q, r); });
    }
    DisableGroupOffloadRequest request;
    request.set_device(absl::GetFlag(FLAGS_device));
    if (!component.empty()) request.set_component_id(component);
    if (!pipeline.empty()) request.set_pipeline(pipeline);
    return AdminCall<DisableGroupOffloadRequest, DisableGroupOffloadResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.DisableGroupOffload(c, q, r); });
  }
  if (command == "load-pipeline") {
    LoadPipelineRequest request;
    request.mutable_pipeline()->set_name(absl::GetFlag(FLAGS_name));
    if (absl::GetFlag(FLAGS_model_dir).empty()) {
      request.mutable_pipeline()->set_builtin(absl::GetFlag(FLAGS_builtin));
    } else {
      request.mutable_pipeline()->set_model_dir(absl::GetFlag(FLAGS_model_dir));
    }
    request.mutable_pipeline()->set_weight_seed(absl::GetFlag(FLAGS_weight_seed));
    return AdminCall<LoadPipelineRequest, LoadPipelineResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.LoadPipeline(c, q, r); });
  }
  if (command == "unload-pipeline") {
    UnloadPipelineRequest request;
    request.set_name(absl::GetFlag(FLAGS_name));
    return AdminCall<UnloadPipelineRequest, UnloadPipelineResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.UnloadPipeline(c, q, r); });
  }
  if (command == "load-adapter") {
    LoadAdapterRequest request;
    request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
    request.set_name(absl::GetFlag(FLAGS_name));
    request.set_path(absl::GetFlag(FLAGS_path));
    request.set_alpha(static_cast<float>(absl::GetFlag(FLAGS_alpha)));
    return AdminCall<LoadAdapterRequest, LoadAdapterResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.LoadAdapter(c, q, r); });
  }
  if (command == "unload-adapter") {
    UnloadAdapterRequest request;
    request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
    request.set_name(absl::GetFlag(FLAGS_name));
    return AdminCall<UnloadAdapterRequest, UnloadAdapterResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.UnloadAdapter(c, q, r); });
  }
  if (command == "drain-device" || command == "resume-device") {
    DrainDeviceRequest request;
    request.set_device(absl::GetFlag(FLAGS_device));
    request.set_drain(command == "drain-device");
    return AdminCall<DrainDeviceRequest, DrainDeviceResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.DrainDevice(c, q, r); });
  }
  if (command == "move-component") {
    MoveComponentRequest request;
    request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
    request.set_component(absl::GetFlag(FLAGS_component));
    request.set_device(absl::GetFlag(FLAGS_device));
    return AdminCall<MoveComponentRequest, MoveComponentResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.MoveComponent(c, q, r); });
  }
  if (command == "set-batching") {
    SetBatchingRequest request;
    request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
    request.mutable_batching()->set_max_batch_size(absl::GetFlag(FLAGS_max_batch_size));
    request.mutable_batching()->set_max_queue_delay_ms(absl::GetFlag(FLAGS_max_queue_delay_ms));
    return AdminCall<SetBatchingRequest, SetBatchingResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.SetBatching(c, q, r); });
  }
  if (command == "set-scheduler") {
    SetSchedulerRequest request;
    if (!ParseText("scheduler", absl::GetFlag(FLAGS_scheduler), request.mutable_scheduler())) return kUsageError;
    return AdminCall<SetSchedulerRequest, SetSchedulerResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.SetScheduler(c, q, r); });
  }
  if (command == "set-memory-budget") {
    if (absl::GetFlag(FLAGS_memory_budget_bytes) == -1) return Usage("set-memory-budget needs --memory_budget_bytes");
    SetMemoryBudgetRequest request;
    request.set_memory_budget_bytes(absl::GetFlag(FLAGS_memory_budget_bytes));
    request.set_device(absl::GetFlag(FLAGS_device));
    return AdminCall<SetMemoryBudgetRequest, SetMemoryBudgetResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.SetMemoryBudget(c, q, r); });
  }
  if (command == "get-scheduler") {
    return AdminCall<GetSchedulerRequest, GetSchedulerResponse>(
        GetSchedulerRequest(), [&](auto* c, const auto& q, auto* r) { return stub.GetScheduler(c, q, r); });
  }
  if (command == "placement-log") {
    GetPlacementLogRequest request;
    request.set_device(absl::GetFlag(FLAGS_device));
    request.set_limit(absl::GetFlag(FLAGS_limit));
    grpc::ClientContext context;
    Authorize(context);
    GetPlacementLogResponse response;
    const grpc::Status status = stub.GetPlacementLog(&context, request, &response);
    if (!status.ok()) return RpcFailure(status);
    for (const auto& d : response.decisions()) {
      std::cout << absl::StrFormat("%s %-10s %-14s %-24s %12s  [%s] %s\n",
                                   google::protobuf::util::TimeUtil::ToString(d.time()), d.request_id(),
                                   d.action(), d.component(), stowage::HumanBytes(d.bytes()), d.strategy(),
                                   d.reason());
    }
    return 0;
  }
  return -1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Stowage command-line client.\n  stowctl [--target=HOST:PORT] [--tls [--ca_cert=FILE] "
      "[--server_name=NAME]] generate --prompt=TEXT [--out=FILE.png]\n  stowctl stream --prompt=TEXT\n"
      "  stowctl pipelines\n  stowctl health\n  stowctl ready [--pipelines=A,B]\n  stowctl --token=T "
      "placement | set-strategy --strategy=TEXT | enable-group-offload --component=ID|--pipeline=P "
      "[--options=TEXT] | disable-group-offload ... | load-pipeline --name=N | unload-pipeline "
      "--name=N | load-adapter --pipeline=P --name=N --path=FILE [--alpha=A] | unload-adapter --pipeline=P "
      "--name=N | placement-log [--limit=N] | set-batching --pipeline=P --max_batch_size=N "
      "[--max_queue_delay_ms=MS] | set-scheduler --scheduler=TEXT | get-scheduler | drain-device --device=D | resume-device --device=D | move-component "
      "--pipeline=P --component=NAME --device=D | set-memory-budget --memory_budget_bytes=N; admin commands take "
      "--device=D on a server with several devices");
  std::vector<char*> args = stowage::ParseCommandLine(argc, argv, "clients/stowctl/stowctl.cc");
  if (args.size() != 2) return Usage("expected exactly one command");
  const std::string command = args[1];
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);
  std::shared_ptr<grpc::ChannelCredentials> credentials = Credentials(channel_args);
  if (credentials == nullptr) return kUsageError;
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target), credentials, channel_args);
  auto stub = GenerationService::NewStub(channel);
  if (command == "generate") return Generate(*stub);
  if (command == "stream") return Stream(*stub);
  if (command == "pipelines") return Pipelines(*stub);
  if (command == "health") return Health(channel);
  if (command == "ready") return Ready(channel, *stub);
  auto admin = AdminService::NewStub(channel);
  const int rc = Admin(command, *admin);
  if (rc >= 0) return rc;
  return Usage(absl::StrCat("unknown command '", command, "'"));
}
