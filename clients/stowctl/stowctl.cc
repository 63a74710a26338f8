// stowctl: command-line client of a Stowage server.
//
//   stowctl [--target=HOST:PORT] generate --prompt="a red fox" [--out=fox.png] [--steps=8] ...
//   stowctl stream --prompt=...        (prints progress as it arrives, then the result)
//   stowctl pipelines
//
// Exit status: 0 success, 1 the server returned an error, 2 bad usage.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "google/protobuf/util/json_util.h"
#include "google/protobuf/util/time_util.h"
#include "clients/stowctl/format.h"
#include "google/protobuf/text_format.h"
#include "stowage/v1/admin.grpc.pb.h"
#include "stowage/v1/generation.grpc.pb.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "Server address HOST:PORT.");
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
ABSL_FLAG(std::string, out, "", "Where to write the image (generate, stream).");
ABSL_FLAG(bool, json, false, "generate/stream: print the reply's statistics as JSON instead of a table.");
ABSL_FLAG(std::string, token, "",
          "Admin bearer token (admin commands); defaults to the STOWAGE_TOKEN environment variable.");
ABSL_FLAG(std::string, strategy, "",
          "set-strategy: an OffloadStrategy in protobuf text format, e.g. 'custom: \"lru\"' or "
          "'workflow { rules { after { component: \"text_encoder\" offload: \"text_encoder\" } } }'.");
ABSL_FLAG(std::string, component, "", "enable/disable-group-offload: component id '<pipeline>/<name>'.");
ABSL_FLAG(std::string, options, "",
          "enable-group-offload: GroupOffloadConfig in text format, e.g. 'use_stream: true offload_type: LEAF_LEVEL'.");
ABSL_FLAG(std::string, name, "", "load-pipeline / unload-pipeline: pipeline name.");
ABSL_FLAG(uint64_t, weight_seed, 0, "load-pipeline: seed of the built-in pipeline's random weights.");
ABSL_FLAG(std::string, model_dir, "", "load-pipeline: a diffusers-format directory instead of the built-in.");
ABSL_FLAG(std::string, builtin, "zimage-tiny",
          "load-pipeline without --model_dir: the built-in architecture (zimage-tiny or tiny).");
ABSL_FLAG(int32_t, limit, 100, "placement-log: number of decisions.");
ABSL_FLAG(int32_t, max_batch_size, 1, "set-batching: most requests per batch, 1 (off) ..64.");
ABSL_FLAG(int32_t, max_queue_delay_ms, 0,
          "set-batching: how long a batch waits for more requests, 0..60000 ms.");

namespace {

using stowage::v1::GenerationService;

constexpr int kUsageError = 2;
constexpr int kRpcError = 1;

int Usage(const std::string& message) {
  std::cerr << "stowctl: " << message << "\n"
            << "usage: stowctl [--target=HOST:PORT] [--timeout=S] generate|stream|pipelines [flags]\n"
            << "       stowctl --token=T placement|set-strategy|enable-group-offload|"
               "disable-group-offload|load-pipeline|unload-pipeline|placement-log|set-batching [flags]\n"
            << "run 'stowctl --help' for the flags\n";
  return kUsageError;
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
  request.set_output_format(stowage::v1::IMAGE_FORMAT_PNG);
  const std::string guidance = absl::GetFlag(FLAGS_guidance);
  if (!guidance.empty()) {
    float g = 0;
    if (!absl::SimpleAtof(guidance, &g)) {
      std::cerr << "stowctl: --guidance '" << guidance << "' is not a number\n";
      return false;
    }
    request.set_guidance_scale(g);
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
    std::string json;
    google::protobuf::util::JsonPrintOptions options;
    options.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(response.stats(), &json, options);
    std::cout << json << std::endl;
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
  const grpc::Status status = stub.GetPlacement(&context, {}, &r);
  if (!status.ok()) return RpcFailure(status);
  std::cout << "device " << r.device() << ": " << stowage::HumanBytes(r.allocated_bytes()) << " allocated of "
            << (r.budget_bytes() > 0 ? stowage::HumanBytes(r.budget_bytes()) : std::string("unlimited"))
            << "; strategy " << r.strategy() << "; OOM recoveries " << r.oom_recoveries() << "\n";
  for (const auto& c : r.components()) {
    std::cout << absl::StrFormat("  %-24s %-16s %12s on device / %12s weights\n", c.id(),
                                 stowage::v1::ComponentPlacement::State_Name(c.state()),
                                 stowage::HumanBytes(c.device_bytes()), stowage::HumanBytes(c.weight_bytes()));
  }
  for (const auto& w : r.warnings()) std::cout << "  warning: " << w << "\n";
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
      if (!component.empty()) request.set_component_id(component);
      if (!pipeline.empty()) request.set_pipeline(pipeline);
      if (!ParseText("options", absl::GetFlag(FLAGS_options), request.mutable_options())) return kUsageError;
      return AdminCall<EnableGroupOffloadRequest, EnableGroupOffloadResponse>(
          request, [&](auto* c, const auto& q, auto* r) { return stub.EnableGroupOffload(c, q, r); });
    }
    DisableGroupOffloadRequest request;
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
  if (command == "set-batching") {
    SetBatchingRequest request;
    request.set_pipeline(absl::GetFlag(FLAGS_pipeline));
    request.mutable_batching()->set_max_batch_size(absl::GetFlag(FLAGS_max_batch_size));
    request.mutable_batching()->set_max_queue_delay_ms(absl::GetFlag(FLAGS_max_queue_delay_ms));
    return AdminCall<SetBatchingRequest, SetBatchingResponse>(
        request, [&](auto* c, const auto& q, auto* r) { return stub.SetBatching(c, q, r); });
  }
  if (command == "placement-log") {
    GetPlacementLogRequest request;
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
      "Stowage command-line client.\n  stowctl [--target=HOST:PORT] generate --prompt=TEXT "
      "[--out=FILE.png]\n  stowctl stream --prompt=TEXT\n  stowctl pipelines\n  stowctl --token=T "
      "placement | set-strategy --strategy=TEXT | enable-group-offload --component=ID|--pipeline=P "
      "[--options=TEXT] | disable-group-offload ... | load-pipeline --name=N | unload-pipeline "
      "--name=N | placement-log [--limit=N] | set-batching --pipeline=P --max_batch_size=N "
      "[--max_queue_delay_ms=MS]");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) return Usage("expected exactly one command");
  const std::string command = args[1];
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(-1);
  auto channel = grpc::CreateCustomChannel(absl::GetFlag(FLAGS_target),
                                           grpc::InsecureChannelCredentials(), channel_args);
  auto stub = GenerationService::NewStub(channel);
  if (command == "generate") return Generate(*stub);
  if (command == "stream") return Stream(*stub);
  if (command == "pipelines") return Pipelines(*stub);
  auto admin = AdminService::NewStub(channel);
  const int rc = Admin(command, *admin);
  if (rc >= 0) return rc;
  return Usage(absl::StrCat("unknown command '", command, "'"));
}
