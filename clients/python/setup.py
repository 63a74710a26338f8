"""Builds the gRPC stubs of proto/stowage/v1 into the package while it builds (see pyproject.toml).

The protos are read from STOWAGE_PROTO_DIR, else from ../../proto next to this file (a checkout).
The compiler is `protoc` with `grpc_python_plugin` (Debian's protobuf-compiler and
protobuf-compiler-grpc), else grpcio-tools' `python -m grpc_tools.protoc`. The stubs land in the
build as the `stowage.v1` package (stowage/v1/*_pb2.py, *_pb2_grpc.py), which stowage_client imports.
"""

import glob
import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


def proto_dir() -> str:
    candidates = [os.environ.get("STOWAGE_PROTO_DIR", ""), os.path.join(HERE, "..", "..", "proto")]
    for d in candidates:
        if d and os.path.isdir(os.path.join(d, "stowage", "v1")):
            return os.path.abspath(d)
    sys.exit("stowage-client: no proto/stowage/v1 found: build from a Stowage checkout or set STOWAGE_PROTO_DIR")


def compile_protos(out: str) -> None:
    root = proto_dir()
    protos = sorted(glob.glob(os.path.join(root, "stowage", "v1", "*.proto")))
    if not protos:
        sys.exit(f"stowage-client: no .proto files under {root}/stowage/v1")
    os.makedirs(out, exist_ok=True)
    protoc, plugin = shutil.which("protoc"), shutil.which("grpc_python_plugin")
    if protoc and plugin:
        command = [protoc, f"--plugin=protoc-gen-grpc_python={plugin}", f"-I{root}", "-I/usr/include",
                   f"--python_out={out}", f"--grpc_python_out={out}", *protos]
    else:
        try:
            import grpc_tools  # noqa: F401
        except ImportError:
            sys.exit("stowage-client: needs protoc and grpc_python_plugin (Debian: protobuf-compiler, "
                     "protobuf-compiler-grpc) or the grpcio-tools package to build its stubs")
        command = [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"--python_out={out}",
                   f"--grpc_python_out={out}", *protos]
    subprocess.run(command, check=True)
    # Regular packages, so that the stubs import as stowage.v1 from the installed wheel.
    for package in ("stowage", os.path.join("stowage", "v1")):
        open(os.path.join(out, package, "__init__.py"), "a").close()


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        compile_protos(self.build_lib)


setup(cmdclass={"build_py": BuildWithStubs})
