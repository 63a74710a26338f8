"""Protobuf/gRPC code generation with Debian's protoc (no @com_google_protobuf needed).

Sources live under proto/ and are imported as "stowage/v1/<file>.proto"; generated headers are
included the same way ("stowage/v1/<file>.pb.h").
"""

def cc_grpc_proto_library(name, srcs, deps = [], extra_hdrs = [], grpc_include = None, cc_deps = [], visibility = None):
    """`grpc_include`: a header every generated *.grpc.pb.h includes (in `extra_hdrs`, its code in
    `cc_deps`)."""
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + ".pb.h", base + ".pb.cc", base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    native.genrule(
        name = name + "_cc_gen",
        srcs = srcs + [d + "_srcs" for d in deps],
        outs = outs,
        cmd = ("/usr/bin/protoc --proto_path=$$(dirname $$(dirname $$(dirname $(location {first})))) " +
               "--cpp_out=$(GENDIR)/proto --grpc_out={grpc_params}$(GENDIR)/proto " +
               "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin " +
               " ".join(["$(location %s)" % s for s in srcs])).format(
            first = srcs[0],
            grpc_params = ("additional_header_includes=%s:" % grpc_include) if grpc_include else "",
        ),
    )
    native.filegroup(name = name + "_srcs", srcs = srcs, visibility = visibility)
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")] + extra_hdrs,
        includes = ["."],
        deps = deps + cc_deps + ["@system//:grpc", "@system//:protobuf"],
        visibility = visibility,
    )

def py_grpc_proto_library(name, srcs, visibility = None):
    """Generates *_pb2.py and *_pb2_grpc.py next to each other (stowage/v1/...)."""
    outs = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs += [base + "_pb2.py", base + "_pb2_grpc.py"]
    native.genrule(
        name = name,
        srcs = srcs,
        outs = outs,
        cmd = ("/usr/bin/protoc --proto_path=$$(dirname $$(dirname $$(dirname $(location {first})))) " +
               "--python_out=$(GENDIR)/proto --grpc_python_out=$(GENDIR)/proto " +
               "--plugin=protoc-gen-grpc_python=/usr/bin/grpc_python_plugin " +
               " ".join(["$(location %s)" % s for s in srcs])).format(first = srcs[0]),
        visibility = visibility,
    )
