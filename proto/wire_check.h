// Parsing requests off the wire with errors a client can act on.
//
// Protobuf refuses a proto3 string field holding invalid UTF-8 by failing the whole parse, which
// gRPC reports as a bare INTERNAL. After such a failure, FindInvalidUtf8Field walks the wire data
// once more to say which field it was (proto/strict_requests.h uses it for every gRPC message).
//
// The walk is linear in the input and refuses nesting deeper than kMaxNesting.
#ifndef STOWAGE_PROTO_WIRE_CHECK_H_
#define STOWAGE_PROTO_WIRE_CHECK_H_

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"

namespace stowage {

inline constexpr int kMaxNesting = 32;

// The first string field (as "Message.field.subfield") whose value is not valid UTF-8, or "" when
// there is none or the bytes are not well-formed for `descriptor`.
std::string FindInvalidUtf8Field(absl::string_view bytes, const google::protobuf::Descriptor* descriptor);

}  // namespace stowage

#endif  // STOWAGE_PROTO_WIRE_CHECK_H_
