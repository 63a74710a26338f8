#include "proto/wire_check.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/text.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/wire_format_lite.h"

namespace stowage {
namespace {

using google::protobuf::Descriptor;
using google::protobuf::FieldDescriptor;
using google::protobuf::internal::WireFormatLite;

// Returns false when the data is malformed (then `found` stays empty).
bool Walk(absl::string_view bytes, const Descriptor* descriptor, const std::string& path, int depth,
          std::string* found) {
  if (depth > kMaxNesting) return false;
  google::protobuf::io::CodedInputStream in(reinterpret_cast<const uint8_t*>(bytes.data()),
                                            static_cast<int>(bytes.size()));
  for (;;) {
    const uint32_t tag = in.ReadTag();
    if (tag == 0) return true;
    const FieldDescriptor* field = descriptor->FindFieldByNumber(WireFormatLite::GetTagFieldNumber(tag));
    const bool delimited = WireFormatLite::GetTagWireType(tag) == WireFormatLite::WIRETYPE_LENGTH_DELIMITED;
    if (field == nullptr || !delimited ||
        (field->type() != FieldDescriptor::TYPE_STRING && field->type() != FieldDescriptor::TYPE_MESSAGE)) {
      if (!WireFormatLite::SkipField(&in, tag)) return false;
      continue;
    }
    uint32_t length = 0;
    if (!in.ReadVarint32(&length)) return false;
    std::string value;
    if (!in.ReadString(&value, static_cast<int>(length))) return false;
    const std::string field_path = absl::StrCat(path, ".", field->name());
    if (field->type() == FieldDescriptor::TYPE_STRING) {
      if (!IsValidUtf8(value)) {
        *found = field_path;
        return true;
      }
      continue;
    }
    if (!Walk(value, field->message_type(), field_path, depth + 1, found)) return false;
    if (!found->empty()) return true;
  }
}

}  // namespace

std::string FindInvalidUtf8Field(absl::string_view bytes, const Descriptor* descriptor) {
  std::string found;
  if (!Walk(bytes, descriptor, descriptor->name(), 0, &found)) return "";
  return found;
}

}  // namespace stowage
