// Included by every generated *.grpc.pb.h (protoc's grpc plugin, additional_header_includes) so
// that a message protobuf cannot parse gets INVALID_ARGUMENT naming the field (a string field
// holding invalid UTF-8) or the message type, instead of gRPC's bare INTERNAL with an empty
// message.
//
// How: gRPC 1.51's generated stubs and handlers (de)serialise every message through
// grpc::SerializationTraits<grpc::protobuf::MessageLite>. This header gives that instantiation an
// explicit specialization with the same fast path as gRPC's own (zero-copy parse of the byte
// buffer); only when that parse fails does it look at the bytes again (proto/wire_check.h) to
// explain why. Every translation unit of this project that (de)serialises messages includes a
// generated *.grpc.pb.h and so sees this specialization; gRPC's libraries that carry their own
// copy behave the same for every well-formed message.
#ifndef STOWAGE_PROTO_STRICT_REQUESTS_H_
#define STOWAGE_PROTO_STRICT_REQUESTS_H_

#include <string>
#include <vector>

#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/support/byte_buffer.h>

#include "google/protobuf/message.h"
#include "proto/wire_check.h"

template <>
class grpc::SerializationTraits<grpc::protobuf::MessageLite, void> {
 public:
  static grpc::Status Serialize(const grpc::protobuf::MessageLite& msg, grpc::ByteBuffer* bb, bool* own_buffer) {
    return grpc::GenericSerialize<grpc::ProtoBufferWriter, grpc::protobuf::MessageLite>(msg, bb, own_buffer);
  }
  static grpc::Status Deserialize(grpc::ByteBuffer* buffer, grpc::protobuf::MessageLite* msg) {
    if (buffer == nullptr) return grpc::Status(grpc::StatusCode::INTERNAL, "No payload");
    bool parsed = false;
    {
      grpc::ProtoBufferReader reader(buffer);
      if (!reader.status().ok()) return reader.status();
      parsed = msg->ParseFromZeroCopyStream(&reader);
    }
    grpc::Status status;
    if (!parsed) status = Explain(*buffer, *msg);
    buffer->Clear();
    return status;
  }

 private:
  static grpc::Status Explain(grpc::ByteBuffer& buffer, const grpc::protobuf::MessageLite& msg) {
    const auto* full = dynamic_cast<const google::protobuf::Message*>(&msg);
    std::string field;
    std::vector<grpc::Slice> slices;
    if (full != nullptr && buffer.Dump(&slices).ok()) {
      std::string bytes;
      for (const grpc::Slice& slice : slices) bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      field = stowage::FindInvalidUtf8Field(bytes, full->GetDescriptor());
    }
    if (!field.empty()) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          field + " is not valid UTF-8; string fields must be UTF-8 text");
    }
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                        "the message is not a well-formed " + msg.GetTypeName() + " message");
  }
};

// Streaming handlers (GenerateStream) deserialise through the request's own type rather than
// MessageLite: the request types get the same behaviour.
#define STOWAGE_STRICT_REQUEST(Type)                                                             \
  template <>                                                                                    \
  class grpc::SerializationTraits<Type, void>                                                    \
      : public grpc::SerializationTraits<grpc::protobuf::MessageLite, void> {}

namespace stowage::v1 {
class GenerateRequest;
}  // namespace stowage::v1
STOWAGE_STRICT_REQUEST(stowage::v1::GenerateRequest);
#undef STOWAGE_STRICT_REQUEST

#endif  // STOWAGE_PROTO_STRICT_REQUESTS_H_
