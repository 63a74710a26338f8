#include "server/openai_images.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <nlohmann/json.hpp>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "base/out_of_memory.h"
#include "base/json_limits.h"
#include "base/text.h"
#include "runtime/config.h"

namespace stowage {
namespace {

using google::protobuf::Struct;
using google::protobuf::Value;

// Fields of OpenAI's request that change nothing here: accepted and ignored, so that clients which
// always send them work.
const std::set<std::string>& IgnoredOpenAiFields() {
  static const auto* fields = new std::set<std::string>{"quality", "style", "background", "moderation"};
  return *fields;
}

// Replies are built as JSON values and serialised by nlohmann-json (keys in the order written;
// bytes that are not UTF-8 become U+FFFD), never by string concatenation.
using Json = nlohmann::ordered_json;

Json StringOrNull(const std::string& s) { return s.empty() ? Json(nullptr) : Json(s); }

std::string Serialize(const Json& value) {
  return value.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

// A protobuf message as a JSON value (protobuf's own mapping: proto field names, defaults printed).
Json ProtoJson(const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.preserve_proto_field_names = true;
  options.always_print_primitive_fields = true;
  std::string out;
  if (!google::protobuf::util::MessageToJsonString(message, &out, options).ok()) return nullptr;
  return Json::parse(out, nullptr, /*allow_exceptions=*/false);
}

const char* KindName(const Value& value) {
  switch (value.kind_case()) {
    case Value::kNullValue: return "null";
    case Value::kNumberValue: return "a number";
    case Value::kStringValue: return "a string";
    case Value::kBoolValue: return "a boolean";
    case Value::kStructValue: return "an object";
    case Value::kListValue: return "an array";
    default: return "nothing";
  }
}

// Field getters: an error for a present value of the wrong type or out of range; an absent or null
// field sets *present to false and leaves *out untouched.
std::optional<OpenAiError> GetString(const Struct& body, const std::string& name, std::string* out, bool* present) {
  *present = false;
  auto it = body.fields().find(name);
  if (it == body.fields().end() || it->second.kind_case() == Value::kNullValue) return std::nullopt;
  if (it->second.kind_case() != Value::kStringValue) {
    return InvalidRequest(absl::StrCat(name, " must be a string, not ", KindName(it->second)), name);
  }
  *out = it->second.string_value();
  *present = true;
  return std::nullopt;
}

std::optional<OpenAiError> GetInteger(const Struct& body, const std::string& name, int64_t min, int64_t max,
                                      const std::string& range, int64_t* out, bool* present) {
  *present = false;
  auto it = body.fields().find(name);
  if (it == body.fields().end() || it->second.kind_case() == Value::kNullValue) return std::nullopt;
  const Value& value = it->second;
  if (value.kind_case() != Value::kNumberValue) {
    return InvalidRequest(absl::StrCat(name, " must be an integer, not ", KindName(value)), name);
  }
  const double d = value.number_value();
  if (!std::isfinite(d) || d != std::floor(d)) {
    return InvalidRequest(absl::StrCat(name, " must be an integer; allowed: ", range), name);
  }
  if (d < static_cast<double>(min) || d > static_cast<double>(max)) {
    return InvalidRequest(absl::StrFormat("%s is %.17g; allowed: %s", name, d, range), name);
  }
  *out = static_cast<int64_t>(d);
  *present = true;
  return std::nullopt;
}

// "WxH" with 1..5 decimal digits each and no sign, space or leading zero; "auto" = the default.
std::optional<OpenAiError> ParseSize(const std::string& size, v1::GenerateRequest* request) {
  const std::string allowed =
      "\"WIDTHxHEIGHT\" in pixels (for example \"512x512\"), or \"auto\" for the model's default";
  if (size == "auto") return std::nullopt;
  const std::vector<absl::string_view> parts = absl::StrSplit(size, 'x');
  auto number = [](absl::string_view s, int* out) {
    if (s.empty() || s.size() > 5 || s[0] == '0') return false;
    for (char c : s) {
      if (!absl::ascii_isdigit(static_cast<unsigned char>(c))) return false;
    }
    return absl::SimpleAtoi(s, out);
  };
  int width = 0, height = 0;
  if (parts.size() != 2 || !number(parts[0], &width) || !number(parts[1], &height)) {
    return InvalidRequest(absl::StrCat("size ", JsonQuote(Truncated(size)), " is not valid; allowed: ", allowed),
                          "size");
  }
  request->set_width(width);
  request->set_height(height);
  return std::nullopt;
}

// The request field that a DeviceRuntime message starts with, as this API names it.
std::string ParamOf(absl::string_view message) {
  struct Prefix {
    const char* core;
    const char* param;
  };
  static constexpr Prefix kPrefixes[] = {
      {"negative_prompt", "negative_prompt"}, {"prompt", "prompt"}, {"width", "size"}, {"height", "size"},
      {"num_inference_steps", "num_inference_steps"}, {"guidance_scale", "guidance_scale"},
      {"seed", "seed"},
  };
  for (const Prefix& p : kPrefixes) {
    if (absl::StartsWith(message, p.core) && message.size() > strlen(p.core) && message[strlen(p.core)] == ' ') {
      return p.param;
    }
  }
  return "";
}

}  // namespace

std::string JsonQuote(absl::string_view s) {
  const bool utf8 = IsValidUtf8(s);
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back('"');
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (c == '"') {
      out += "\\\"";
    } else if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else if (u < 0x20 || u == 0x7f) {
      out += absl::StrFormat("\\u%04x", u);
    } else if (u >= 0x80 && !utf8) {
      out.push_back('?');
    } else {
      out.push_back(c);
    }
  }
  out.push_back('"');
  return out;
}

std::string HealthBody(const std::string& status) {
  Json body;
  body["status"] = status;
  return Serialize(body);
}

std::string ErrorBody(const OpenAiError& error) {
  Json body;
  body["error"]["message"] = error.message;
  body["error"]["type"] = StringOrNull(error.type);
  body["error"]["param"] = StringOrNull(error.param);
  body["error"]["code"] = StringOrNull(error.code);
  return Serialize(body);
}

OpenAiError InvalidRequest(std::string message, std::string param, std::string code) {
  return OpenAiError{400, std::move(message), "invalid_request_error", std::move(param), std::move(code)};
}

OpenAiError ErrorFromStatus(const absl::Status& status) {
  const std::string message(status.message());
  if (IsCannotFit(status)) return OpenAiError{400, message, "invalid_request_error", "", "insufficient_device_memory"};
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return InvalidRequest(message, ParamOf(message));
    case absl::StatusCode::kNotFound:
      return OpenAiError{404, message, "invalid_request_error", "model", "model_not_found"};
    case absl::StatusCode::kResourceExhausted:
      return OpenAiError{429, message, "rate_limit_error", "",
                         absl::StrContains(message, "queue") ? "queue_full" : "resource_exhausted"};
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kFailedPrecondition:
      return OpenAiError{503, message, "server_error", "", "unavailable"};
    case absl::StatusCode::kUnauthenticated:
      return OpenAiError{401, message, "invalid_request_error", "", "invalid_api_key"};
    case absl::StatusCode::kPermissionDenied:
      return OpenAiError{403, message, "invalid_request_error", "", "permission_denied"};
    case absl::StatusCode::kDeadlineExceeded:
      return OpenAiError{504, message, "server_error", "", "timeout"};
    default:
      return OpenAiError{500, message, "server_error", "", ""};
  }
}

std::optional<OpenAiError> ParseImagesRequest(absl::string_view body, int64_t max_bytes, ImagesRequest* request) {
  if (static_cast<int64_t>(body.size()) > max_bytes) {
    return OpenAiError{413, absl::StrCat("request body is ", body.size(), " bytes; at most ", max_bytes, " allowed"),
                       "invalid_request_error", "", "request_too_large"};
  }
  if (!IsValidUtf8(body)) return InvalidRequest("request body is not valid UTF-8");
  const absl::Status limits = CheckJsonLimits(body, JsonLimits{kMaxRequestJsonDepth, max_bytes}, "request body");
  if (!limits.ok()) return InvalidRequest(std::string(limits.message()));
  const absl::string_view trimmed = absl::StripLeadingAsciiWhitespace(body);
  if (trimmed.empty() || trimmed[0] != '{') return InvalidRequest("request body must be a JSON object");
  // Strict RFC 8259 first (nlohmann-json, Debian's): protobuf's JSON reader also takes unquoted keys,
  // single quotes and trailing commas ({prompt: 'x',}), which no JSON client sends.
  if (!nlohmann::json::accept(body.begin(), body.end())) {
    return InvalidRequest("request body is not valid JSON (RFC 8259: quoted keys and strings, no trailing commas, "
                          "nothing after the object)");
  }
  Struct json;
  google::protobuf::util::JsonParseOptions options;
  const auto parsed = google::protobuf::util::JsonStringToMessage(std::string(body), &json, options);
  if (!parsed.ok()) {
    return InvalidRequest(absl::StrCat("request body is not valid JSON (", Truncated(parsed.ToString(), 96), ")"));
  }
  return ParseImagesFields(json, /*edit=*/false, request);
}

namespace {

// The text fields of an edit's form as the JSON values the generations body has: numbers and
// booleans from their decimal / "true" / "false" text, `loras` from its JSON text.
std::optional<OpenAiError> FormFieldValue(const std::string& name, const std::string& text, Value* value) {
  static const std::set<std::string> kIntegers = {"n", "num_inference_steps", "seed", "priority", "partial_images"};
  static const std::set<std::string> kNumbers = {"guidance_scale", "strength"};
  const std::string trimmed(absl::StripAsciiWhitespace(text));
  if (kIntegers.count(name) > 0) {
    int64_t number = 0;
    if (!absl::SimpleAtoi(trimmed, &number)) {
      return InvalidRequest(absl::StrCat(name, " must be an integer, not ", JsonQuote(Truncated(text))), name);
    }
    value->set_number_value(static_cast<double>(number));
  } else if (kNumbers.count(name) > 0) {
    double number = 0;
    if (!absl::SimpleAtod(trimmed, &number) || !std::isfinite(number)) {
      return InvalidRequest(absl::StrCat(name, " must be a finite number, not ", JsonQuote(Truncated(text))), name);
    }
    value->set_number_value(number);
  } else if (name == "stream") {
    if (trimmed != "true" && trimmed != "false") {
      return InvalidRequest(absl::StrCat("stream must be true or false, not ", JsonQuote(Truncated(text))), name);
    }
    value->set_bool_value(trimmed == "true");
  } else if (name == "loras") {
    if (!nlohmann::json::accept(trimmed.begin(), trimmed.end()) ||
        !google::protobuf::util::JsonStringToMessage(trimmed, value).ok()) {
      return InvalidRequest("loras must be a JSON array of {\"name\", \"scale\"}", name);
    }
  } else {
    value->set_string_value(text);
  }
  return std::nullopt;
}

}  // namespace

std::optional<OpenAiError> ParseEditsRequest(const std::vector<FormPart>& parts, ImagesRequest* request) {
  Struct json;
  const FormPart* image = nullptr;
  const FormPart* mask = nullptr;
  for (const FormPart& part : parts) {
    if (!IsValidUtf8(part.name)) return InvalidRequest("a form field's name is not valid UTF-8");
    if (part.name == "image" || part.name == "image[]") {
      if (image != nullptr) {
        return InvalidRequest("one input image per request (image was given more than once)", "image");
      }
      image = &part;
      continue;
    }
    if (part.name == "mask") {
      if (mask != nullptr) return InvalidRequest("mask was given more than once", "mask");
      mask = &part;
      continue;
    }
    if (json.fields().count(part.name) > 0) {
      return InvalidRequest(absl::StrCat("form field ", JsonQuote(Truncated(part.name)), " was given more than once"),
                            Truncated(part.name));
    }
    if (!IsValidUtf8(part.data)) {
      return InvalidRequest(absl::StrCat("form field ", JsonQuote(Truncated(part.name)), " is not valid UTF-8"),
                            Truncated(part.name));
    }
    Value value;
    if (auto e = FormFieldValue(part.name, part.data, &value)) return e;
    (*json.mutable_fields())[part.name] = std::move(value);
  }
  if (image == nullptr || image->data.empty()) {
    return InvalidRequest("image is required: the PNG to edit, as a file field of the multipart/form-data body",
                          "image");
  }
  ImagesRequest out;
  if (auto e = ParseImagesFields(json, /*edit=*/true, &out)) return e;
  out.base.set_image(image->data);
  if (mask != nullptr) {
    if (mask->data.empty()) return InvalidRequest("mask is an empty file", "mask");
    out.base.set_mask(mask->data);
  }
  *request = std::move(out);
  return std::nullopt;
}

std::optional<OpenAiError> ParseImagesFields(const google::protobuf::Struct& json, bool edit, ImagesRequest* request) {
  for (const auto& [name, value] : json.fields()) {
    static const std::set<std::string> kKnown = {"model", "prompt", "n", "size", "response_format", "output_format",
                                                 "negative_prompt", "num_inference_steps", "guidance_scale", "seed",
                                                 "user", "priority", "stream", "partial_images", "loras"};
    if ((kKnown.count(name) == 0 && IgnoredOpenAiFields().count(name) == 0) && !(edit && name == "strength")) {
      return InvalidRequest(absl::StrCat("unrecognized request argument ", JsonQuote(Truncated(name)),
                                         "; allowed: ", absl::StrJoin(kKnown, ", "), edit ? ", strength" : "",
                                         " (and, ignored: ", absl::StrJoin(IgnoredOpenAiFields(), ", "), ")"),
                            Truncated(name), "unknown_parameter");
    }
  }

  ImagesRequest out;
  out.edit = edit;
  v1::GenerateRequest& r = out.base;
  bool present = false;
  std::string text;
  if (auto e = GetString(json, "model", &text, &present)) return e;
  if (present) r.set_pipeline(text);
  if (auto e = GetString(json, "prompt", &text, &present)) return e;
  if (!present) return InvalidRequest("prompt is required", "prompt");
  r.set_prompt(text);
  if (auto e = GetString(json, "negative_prompt", &text, &present)) return e;
  if (present) r.set_negative_prompt(text);
  if (auto e = GetString(json, "size", &text, &present)) return e;
  if (present) {
    if (auto e = ParseSize(text, &r)) return e;
  }
  if (auto e = GetString(json, "response_format", &text, &present)) return e;
  if (present && text != "b64_json") {
    if (text == "url") {
      return InvalidRequest(
          "response_format \"url\" is not supported: this server keeps no images to link to; use \"b64_json\" "
          "(the default), which returns the PNG inline",
          "response_format", "unsupported_response_format");
    }
    return InvalidRequest(
        absl::StrCat("response_format ", JsonQuote(Truncated(text)), " is not valid; allowed: \"b64_json\""),
        "response_format");
  }
  if (auto e = GetString(json, "output_format", &text, &present)) return e;
  if (present && text != "png") {
    return InvalidRequest(absl::StrCat("output_format ", JsonQuote(Truncated(text)), " is not supported; allowed: \"png\""),
                          "output_format");
  }
  int64_t number = 0;
  if (auto e = GetInteger(json, "n", 1, kMaxImagesPerRequest, absl::StrCat("1 to ", kMaxImagesPerRequest), &number,
                          &present)) {
    return e;
  }
  if (present) out.n = static_cast<int>(number);
  if (auto e = GetInteger(json, "num_inference_steps", 0, 1 << 30, "0 (the model's default) or 1 to the model's maximum",
                          &number, &present)) {
    return e;
  }
  if (present) r.set_num_inference_steps(static_cast<int32_t>(number));
  if (auto e = GetInteger(json, "seed", 0, kMaxJsonSeed, absl::StrCat("0 to ", kMaxJsonSeed), &number, &present)) {
    return e;
  }
  if (present) r.set_seed(static_cast<uint64_t>(number));
  // OpenAI's `user` (the end user a request is for) is the scheduler's tenant; `priority` is ours.
  if (auto e = GetString(json, "user", &text, &present)) return e;
  if (present) r.set_tenant(text);
  if (auto e = GetInteger(json, "priority", 0, 9, "0 (the default) to 9", &number, &present)) return e;
  if (present) r.set_priority(static_cast<int32_t>(number));
  auto stream = json.fields().find("stream");
  if (stream != json.fields().end() && stream->second.kind_case() != Value::kNullValue) {
    if (stream->second.kind_case() != Value::kBoolValue) {
      return InvalidRequest(absl::StrCat("stream must be true or false, not ", KindName(stream->second)), "stream");
    }
    out.stream = stream->second.bool_value();
  }
  if (auto e = GetInteger(json, "partial_images", 0, kMaxPartialImages, absl::StrCat("0 to ", kMaxPartialImages),
                          &number, &present)) {
    return e;
  }
  if (present) r.set_partial_images(static_cast<int32_t>(number));
  if (r.partial_images() > 0 && !out.stream) {
    return InvalidRequest("partial_images needs stream: true (previews are sent as server-sent events)",
                          "partial_images");
  }
  // LoRA adapters: [{"name": ..., "scale": ...}] (scale defaults to 1); the core checks the names
  // against the pipeline and the ranges.
  auto loras = json.fields().find("loras");
  if (loras != json.fields().end() && loras->second.kind_case() != Value::kNullValue) {
    if (loras->second.kind_case() != Value::kListValue) {
      return InvalidRequest(absl::StrCat("loras must be an array of {\"name\", \"scale\"}, not ", KindName(loras->second)),
                            "loras");
    }
    const auto& items = loras->second.list_value().values();
    if (items.size() > static_cast<size_t>(kMaxLorasPerRequest)) {
      return InvalidRequest(absl::StrCat("loras has ", items.size(), " adapters; at most ", kMaxLorasPerRequest), "loras");
    }
    for (int i = 0; i < items.size(); ++i) {
      const Value& item = items[i];
      if (item.kind_case() != Value::kStructValue) {
        return InvalidRequest(absl::StrCat("loras[", i, "] must be an object {\"name\", \"scale\"}, not ", KindName(item)),
                              "loras");
      }
      const auto& fields = item.struct_value().fields();
      for (const auto& [key, value] : fields) {
        if (key != "name" && key != "scale") {
          return InvalidRequest(absl::StrCat("loras[", i, "] has an unknown field ", JsonQuote(Truncated(key)),
                                             "; allowed: name, scale"),
                                "loras");
        }
      }
      auto name = fields.find("name");
      if (name == fields.end() || name->second.kind_case() != Value::kStringValue) {
        return InvalidRequest(absl::StrCat("loras[", i, "].name must be a string"), "loras");
      }
      v1::LoraRef* ref = r.add_loras();
      ref->set_name(name->second.string_value());
      ref->set_scale(1.0f);
      auto scale = fields.find("scale");
      if (scale != fields.end()) {
        if (scale->second.kind_case() != Value::kNumberValue || !std::isfinite(scale->second.number_value()) ||
            std::abs(scale->second.number_value()) > kMaxLoraScale) {
          return InvalidRequest(absl::StrCat("loras[", i, "].scale must be a number within [-", kMaxLoraScale, ", ",
                                             kMaxLoraScale, "]"),
                                "loras");
        }
        ref->set_scale(static_cast<float>(scale->second.number_value()));
      }
    }
  }
  auto guidance = json.fields().find("guidance_scale");
  if (guidance != json.fields().end() && guidance->second.kind_case() != Value::kNullValue) {
    if (guidance->second.kind_case() != Value::kNumberValue) {
      return InvalidRequest(absl::StrCat("guidance_scale must be a number, not ", KindName(guidance->second)),
                            "guidance_scale");
    }
    const double g = guidance->second.number_value();
    if (!std::isfinite(g) || g < 0 || g > 100) {
      return InvalidRequest(absl::StrFormat("guidance_scale is %.17g; must be finite and within [0, 100]", g),
                            "guidance_scale");
    }
    r.set_guidance_scale(static_cast<float>(g));
  }
  auto strength = json.fields().find("strength");
  if (strength != json.fields().end() && strength->second.kind_case() != Value::kNullValue) {
    const double v = strength->second.kind_case() == Value::kNumberValue ? strength->second.number_value() : -1;
    if (strength->second.kind_case() != Value::kNumberValue || !std::isfinite(v) || v <= 0 || v > 1) {
      return InvalidRequest("strength must be a number above 0 and at most 1", "strength");
    }
    r.set_strength(v);
  }
  *request = std::move(out);
  return std::nullopt;
}

v1::GenerateRequest ImageRequest(const ImagesRequest& request, int index) {
  v1::GenerateRequest r = request.base;
  if (r.has_seed()) r.set_seed(r.seed() + static_cast<uint64_t>(index));
  return r;
}

std::string ImagesResponseBody(const std::vector<v1::GenerateResponse>& images, int64_t created) {
  Json data = Json::array();
  for (const v1::GenerateResponse& image : images) {
    Json item;
    item["b64_json"] = absl::Base64Escape(image.image());
    item["seed"] = image.seed();
    item["width"] = image.width();
    item["height"] = image.height();
    item["request_id"] = image.request_id();
    item["stats"] = ProtoJson(image.stats());
    data.push_back(std::move(item));
  }
  std::string size, model;
  if (!images.empty()) {
    size = absl::StrCat(images[0].width(), "x", images[0].height());
    model = images[0].pipeline();
  }
  Json body;
  body["created"] = created;
  body["data"] = std::move(data);
  body["size"] = size;
  body["output_format"] = "png";
  body["model"] = model;
  return Serialize(body);
}

std::vector<std::pair<std::string, std::string>> StatsHeaders(const std::vector<v1::GenerateResponse>& images) {
  std::vector<std::pair<std::string, std::string>> headers;
  if (images.empty()) return headers;
  std::vector<std::string> ids, seeds;
  double queue_wait = 0, run_time = 0, preempted = 0;
  int64_t peak_device = 0, peak_reserved = 0, peak_rss = 0, h2d = 0, d2h = 0;
  int32_t batch_size = 1;
  auto seconds = [](const google::protobuf::Duration& d) { return d.seconds() + d.nanos() * 1e-9; };
  for (const v1::GenerateResponse& image : images) {
    const v1::RequestStats& s = image.stats();
    ids.push_back(image.request_id());
    seeds.push_back(absl::StrCat(image.seed()));
    queue_wait = std::max(queue_wait, seconds(s.queue_wait()));
    run_time = std::max(run_time, seconds(s.run_time()));
    preempted = std::max(preempted, seconds(s.preempted_time()));
    peak_device = std::max(peak_device, s.peak_device_memory_bytes());
    peak_reserved = std::max(peak_reserved, s.peak_device_reserved_bytes());
    peak_rss = std::max(peak_rss, s.peak_cpu_rss_bytes());
    // A batch member's byte counts are its batch's: the request counts its share of them.
    const int64_t members = std::max(1, s.batch_size());
    batch_size = std::max(batch_size, s.batch_size());
    h2d += s.host_to_device_bytes() / members;
    d2h += s.device_to_host_bytes() / members;
  }
  // Header values must be printable ASCII: request ids are (DeviceRuntime checks them), pipeline
  // and device names too; Truncated keeps that true whatever they hold.
  headers.emplace_back("X-Stowage-Pipeline", Truncated(images[0].pipeline()));
  headers.emplace_back("X-Stowage-Device", Truncated(images[0].stats().device()));
  headers.emplace_back("X-Stowage-Request-Id", Truncated(absl::StrJoin(ids, ","), 2048));
  headers.emplace_back("X-Stowage-Seed", absl::StrJoin(seeds, ","));
  headers.emplace_back("X-Stowage-Queue-Wait-Seconds", absl::StrFormat("%.6f", queue_wait));
  headers.emplace_back("X-Stowage-Run-Time-Seconds", absl::StrFormat("%.6f", run_time));
  headers.emplace_back("X-Stowage-Peak-Device-Memory-Bytes", absl::StrCat(peak_device));
  headers.emplace_back("X-Stowage-Peak-Device-Reserved-Bytes", absl::StrCat(peak_reserved));
  headers.emplace_back("X-Stowage-Peak-Cpu-Rss-Bytes", absl::StrCat(peak_rss));
  headers.emplace_back("X-Stowage-Host-To-Device-Bytes", absl::StrCat(h2d));
  headers.emplace_back("X-Stowage-Device-To-Host-Bytes", absl::StrCat(d2h));
  headers.emplace_back("X-Stowage-Batch-Size", absl::StrCat(batch_size));
  headers.emplace_back("X-Stowage-Preempted-Seconds", absl::StrFormat("%.6f", preempted));
  return headers;
}

namespace {

// "event: T\ndata: <one line of JSON>\n\n" (Serialize ends its text with a newline).
std::string Sse(const Json& event) {
  return absl::StrCat("event: ", event["type"].get<std::string>(), "\ndata: ", Serialize(event), "\n");
}

double Seconds(const google::protobuf::Duration& d) { return d.seconds() + d.nanos() * 1e-9; }

}  // namespace

std::string ProgressEvent(int image_index, const v1::Progress& progress) {
  Json event;
  event["type"] = "stowage.progress";
  event["image_index"] = image_index;
  event["stage"] = progress.stage();
  event["step"] = progress.step();
  event["total_steps"] = progress.total_steps();
  event["elapsed_seconds"] = Seconds(progress.elapsed());
  event["queue_wait_seconds"] = Seconds(progress.queue_wait());
  return Sse(event);
}

std::string PartialImageEvent(int image_index, int partial_index, const std::string& png, int width, int height,
                              int64_t created, bool edit) {
  Json event;
  event["type"] = edit ? "image_edit.partial_image" : "image_generation.partial_image";
  event["image_index"] = image_index;
  event["partial_image_index"] = partial_index;
  event["b64_json"] = absl::Base64Escape(png);
  event["size"] = absl::StrCat(width, "x", height);
  event["output_format"] = "png";
  event["created_at"] = created;
  event["quality"] = "auto";
  event["background"] = "opaque";
  return Sse(event);
}

std::string CompletedEvent(int image_index, const v1::GenerateResponse& image, int64_t created, bool edit) {
  Json event;
  event["type"] = edit ? "image_edit.completed" : "image_generation.completed";
  event["image_index"] = image_index;
  event["b64_json"] = absl::Base64Escape(image.image());
  event["size"] = absl::StrCat(image.width(), "x", image.height());
  event["output_format"] = "png";
  event["created_at"] = created;
  event["quality"] = "auto";
  event["background"] = "opaque";
  event["model"] = image.pipeline();
  event["seed"] = image.seed();
  event["request_id"] = image.request_id();
  event["stats"] = ProtoJson(image.stats());
  return Sse(event);
}

std::string ErrorEvent(const OpenAiError& error) {
  return absl::StrCat("event: error\ndata: ", ErrorBody(error), "\n");
}

namespace {

Json ModelJson(const v1::Pipeline& pipeline, int64_t created) {
  Json model;
  model["id"] = pipeline.name();
  model["object"] = "model";
  model["created"] = created;
  model["owned_by"] = "stowage";
  model["stowage"] = ProtoJson(pipeline);
  return model;
}

}  // namespace

std::string PlacementBody(const std::vector<v1::GetPlacementResponse>& devices) {
  Json list = Json::array();
  for (const v1::GetPlacementResponse& d : devices) list.push_back(ProtoJson(d));
  Json body;
  body["devices"] = std::move(list);
  return Serialize(body);
}

std::string ModelsBody(const v1::ListPipelinesResponse& pipelines, int64_t created) {
  Json data = Json::array();
  for (const v1::Pipeline& p : pipelines.pipelines()) data.push_back(ModelJson(p, created));
  Json body;
  body["object"] = "list";
  body["data"] = std::move(data);
  return Serialize(body);
}

std::optional<std::string> ModelBody(const v1::ListPipelinesResponse& pipelines, absl::string_view id,
                                     int64_t created) {
  for (const v1::Pipeline& p : pipelines.pipelines()) {
    if (p.name() == id) return Serialize(ModelJson(p, created));
  }
  return std::nullopt;
}

}  // namespace stowage
