// The OpenAI images API in terms of DeviceRuntime's messages, with no transport: the JSON body of
// POST /v1/images/generations → GenerateRequests, GenerateResponses → the JSON reply and its stats
// headers, ListPipelines → GET /v1/models, and absl::Status → OpenAI's error object with its HTTP
// status. server/http_front.cc is the transport glue around these functions.
//
// The request follows OpenAI's Images API (model, prompt, n, size "WxH", response_format) with
// Stowage's own fields beside them (negative_prompt, num_inference_steps, guidance_scale, seed).
// Everything from the client is untrusted: the body is checked for size, nesting, UTF-8 and types
// before any field is used, and error messages never echo more than a short printable prefix.
//
// Thread-safety: every function is a pure function of its arguments.
#ifndef STOWAGE_SERVER_OPENAI_IMAGES_H_
#define STOWAGE_SERVER_OPENAI_IMAGES_H_

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/struct.pb.h"
#include "stowage/v1/admin.pb.h"
#include "stowage/v1/generation.pb.h"

namespace stowage {

// n: 1..kMaxImagesPerRequest images per request (OpenAI's own bound).
inline constexpr int kMaxImagesPerRequest = 10;
// seed: an integer in 0..kMaxJsonSeed (JSON numbers are exact integers only up to 2^53). Image i
// of a request gets seed + i.
inline constexpr int64_t kMaxJsonSeed = (int64_t{1} << 53) - kMaxImagesPerRequest;
// Deepest JSON nesting accepted in a request body (a real one is a flat object: depth 1).
inline constexpr int kMaxRequestJsonDepth = 8;

// An OpenAI error object and the HTTP status that carries it.
struct OpenAiError {
  int http_status = 500;
  std::string message;
  // "invalid_request_error", "authentication_error", "not_found_error", "rate_limit_error",
  // "server_error".
  std::string type;
  // The request field at fault, or empty (JSON null).
  std::string param;
  // A machine-readable code ("invalid_api_key", "model_not_found", "queue_full", ...), or empty.
  std::string code;
};

// The health reply: {"status": STATUS}.
std::string HealthBody(const std::string& status);

// {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
std::string ErrorBody(const OpenAiError& error);

// A 400 invalid_request_error naming `param`.
OpenAiError InvalidRequest(std::string message, std::string param = "", std::string code = "");

// The error for a status from DeviceRuntime (or any absl::Status): INVALID_ARGUMENT and
// OUT_OF_RANGE → 400 (param named when the message starts with a request field: a width or height
// error names "size"); NOT_FOUND → 404 "model_not_found"; RESOURCE_EXHAUSTED → 429 ("queue_full"
// when the device queue refused it); UNAVAILABLE and FAILED_PRECONDITION (a pipeline loading,
// being unloaded or failed; the server stopping) → 503; UNAUTHENTICATED → 401; PERMISSION_DENIED →
// 403; DEADLINE_EXCEEDED → 504; anything else → 500. The message is the status's own.
OpenAiError ErrorFromStatus(const absl::Status& status);

// One POST /v1/images/generations request.
struct ImagesRequest {
  // pipeline, prompt, negative_prompt, width and height (0: the pipeline's default),
  // num_inference_steps, guidance_scale and seed when given.
  v1::GenerateRequest base;
  int n = 1;
  // `stream: true`: the reply is server-sent events (ProgressEvent and the others below) instead
  // of one JSON body. Previews (partial_images, streams only) are base.partial_images.
  bool stream = false;
  // POST /v1/images/edits (base.image, base.mask, base.strength set): streamed events are named
  // image_edit.* instead of image_generation.*.
  bool edit = false;
};

// One part of a multipart/form-data (or url-encoded) body: a field's name and its bytes (a file's
// contents or a text value; which one a field is, its name says).
struct FormPart {
  std::string name;
  std::string data;
};


// Parses and type-checks the body of POST /v1/images/generations. `max_bytes` bounds the body.
// Returns the error to answer with (always a 4xx) when the body is unacceptable: not UTF-8, not a
// JSON object, too deep, a field of the wrong type or out of the range given here (n, size's form,
// seed), response_format "url", or a field this API does not know. Ranges that depend on the
// pipeline (size, steps, prompt length) are DeviceRuntime's to check.
std::optional<OpenAiError> ParseImagesRequest(absl::string_view body, int64_t max_bytes, ImagesRequest* request);

// The fields of a request once read from its body (a JSON object, or an edit's form as one):
// what ParseImagesRequest checks after the JSON itself. `edit` also allows "strength" (above 0, at
// most 1).
std::optional<OpenAiError> ParseImagesFields(const google::protobuf::Struct& json, bool edit, ImagesRequest* request);

// POST /v1/images/edits, as OpenAI's images.edit sends it (multipart/form-data): the file fields
// `image` (or `image[]`: one image) and `mask` (optional) — PNGs; DeviceRuntime decodes and checks
// them — and the text fields of the generations body (numbers, booleans and `loras`' JSON as text),
// plus `strength`. 400 for a missing image, a field given twice, a field that is not UTF-8 or not
// of its type, and anything ParseImagesFields refuses.
std::optional<OpenAiError> ParseEditsRequest(const std::vector<FormPart>& parts, ImagesRequest* request);

// The GenerateRequest of image `index` (0-based) of `request`: the base, with seed + index when a
// seed was given.
v1::GenerateRequest ImageRequest(const ImagesRequest& request, int index);

// The reply to a request whose images all succeeded, in order:
// {"created": <unix seconds>, "data": [{"b64_json": <PNG>, "seed", "width", "height", "request_id",
//  "stats": <RequestStats as proto3 JSON>}...], "size": "WxH", "output_format": "png",
//  "model": <pipeline>}.
std::string ImagesResponseBody(const std::vector<v1::GenerateResponse>& images, int64_t created);

// The per-request statistics of `images` as response headers (X-Stowage-*): pipeline, device,
// request ids and seeds (comma-separated), queue wait and run time (seconds, the largest), peak
// device / device reserved / CPU RSS bytes (the largest), bytes moved host→device and device→host
// (summed over the images).
std::vector<std::pair<std::string, std::string>> StatsHeaders(const std::vector<v1::GenerateResponse>& images);

// Server-sent events of a streamed request (`stream: true`), each "event: <type>\ndata: <json>\n\n"
// with the type repeated as the JSON's "type" (OpenAI's image streaming events, which the SDKs
// yield as they come), and "image_index" (0..n-1) naming the request's image:
//   stowage.progress                 {stage, step, total_steps, elapsed_seconds, queue_wait_seconds}
//                                    at each stage start and after each denoising step
//   image_generation.partial_image   {b64_json: <PNG>, partial_image_index, size, output_format,
//                                    created_at, quality, background} — a preview (partial_images)
//   image_generation.completed       {b64_json: <PNG>, size, output_format, created_at, quality,
//                                    background, seed, request_id, stats} — one per image
//   error                            {"error": <OpenAI error object>} — the request failed after the
//                                    stream began (an error before it is a plain HTTP error reply)
std::string ProgressEvent(int image_index, const v1::Progress& progress);
// `edit`: the events of POST /v1/images/edits, image_edit.partial_image and image_edit.completed.
std::string PartialImageEvent(int image_index, int partial_index, const std::string& png, int width, int height,
                              int64_t created, bool edit = false);
std::string CompletedEvent(int image_index, const v1::GenerateResponse& image, int64_t created, bool edit = false);
std::string ErrorEvent(const OpenAiError& error);

// GET /v1/placement: {"devices": [<GetPlacementResponse as proto3 JSON>...]}, one per device.
std::string PlacementBody(const std::vector<v1::GetPlacementResponse>& devices);

// GET /v1/models: {"object": "list", "data": [<model>...]}, one model per pipeline:
// {"id": name, "object": "model", "created": <created>, "owned_by": "stowage",
//  "stowage": <the Pipeline message as proto3 JSON: state, limits, components...>}.
std::string ModelsBody(const v1::ListPipelinesResponse& pipelines, int64_t created);
// GET /v1/models/{id}: the one model, or nullopt when no pipeline has that name.
std::optional<std::string> ModelBody(const v1::ListPipelinesResponse& pipelines, absl::string_view id,
                                     int64_t created);

// `s` as a JSON string literal (quotes included, control characters escaped); when `s` is not
// valid UTF-8 its bytes above 0x7f become '?', so the output is always valid JSON.
std::string JsonQuote(absl::string_view s);

}  // namespace stowage

#endif  // STOWAGE_SERVER_OPENAI_IMAGES_H_
