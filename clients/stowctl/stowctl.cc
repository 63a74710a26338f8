// stowctl: command-line client of a Stowage server.
//
//   stowctl [--target=HOST:PORT] generate --prompt="a red fox" [--out=fox.png] [--steps=8] ...
//   stowctl stream --prompt=...        (prints progress as it arrives, then the result)
//   stowctl pipelines
//
// Exit status: 0 success, 1 the server returned an error, 2 bad usage.
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
#include "clients/stowctl/format.h"
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

namespace {

using stowage::v1::GenerationService;

constexpr int kUsageError = 2;
constexpr int kRpcError = 1;

int Usage(const std::string& message) {
  std::cerr << "stowctl: " << message << "\n"
            << "usage: stowctl [--target=HOST:PORT] [--timeout=S] generate|stream|pipelines [flags]\n"
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

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Stowage command-line client.\n  stowctl [--target=HOST:PORT] generate --prompt=TEXT "
      "[--out=FILE.png]\n  stowctl stream --prompt=TEXT\n  stowctl pipelines");
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
  return Usage(absl::StrCat("unknown command '", command, "'"));
}
