"""LibTorch as a Bazel repository.

Default: Debian's libtorch-dev (LibTorch 1.13, CPU only) under /usr.
CUDA: `bazel build --config=cuda --repo_env=STOWAGE_LIBTORCH_DIR=/path/to/libtorch`, where the
directory holds include/ and lib/ of a CUDA LibTorch (for example `python3 -c 'import torch,os;
print(os.path.dirname(torch.__file__))'`). `--config=cuda` sets STOWAGE_TORCH_VARIANT=cuda, and the
rule refuses a directory without libtorch_cuda.so rather than silently building for the CPU.
"""

def _libtorch_repository_impl(ctx):
    variant = ctx.os.environ.get("STOWAGE_TORCH_VARIANT", "cpu")
    root = ctx.os.environ.get("STOWAGE_LIBTORCH_DIR", "")
    if variant not in ("cpu", "cuda"):
        fail("STOWAGE_TORCH_VARIANT must be 'cpu' or 'cuda', got '%s'" % variant)
    if variant == "cuda":
        if not root:
            fail("--config=cuda needs --repo_env=STOWAGE_LIBTORCH_DIR=<LibTorch dir with include/ and lib/>")
        if not ctx.path(root + "/lib/libtorch_cuda.so").exists:
            fail("STOWAGE_LIBTORCH_DIR=%s has no lib/libtorch_cuda.so: not a CUDA LibTorch" % root)
        cuda_dir = ctx.os.environ.get("CUDA_HOME", "/usr/local/cuda")
        ctx.symlink(root + "/include", "include")
        ctx.symlink(root + "/lib", "lib")
        ctx.symlink(cuda_dir + "/include", "cuda_include")
        build = """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "torch",
    hdrs = glob(["include/**/*.h", "include/**/*.cuh", "cuda_include/**/*.h"], allow_empty = True),
    includes = ["include", "include/torch/csrc/api/include", "cuda_include"],
    defines = ["STOWAGE_WITH_CUDA=1"],
    linkopts = [
        "-L{lib}", "-Wl,-rpath,{lib}", "-Wl,--no-as-needed",
        "-ltorch", "-ltorch_cuda", "-ltorch_cpu", "-lc10_cuda", "-lc10",
        "-Wl,--as-needed", "-L{cuda}/lib64", "-lcudart",
    ],
)
""".format(lib = root + "/lib", cuda = cuda_dir)
    else:
        # Debian keeps torch/torch.h under include/torch/csrc/api/include: `includes` reaches
        # dependents, copts would not.
        ctx.symlink("/usr/include/torch/csrc/api/include", "api_include")
        build = """
package(default_visibility = ["//visibility:public"])
cc_library(
    name = "torch",
    includes = ["api_include"],
    linkopts = ["-ltorch", "-ltorch_cpu", "-lc10"],
)
"""
    ctx.file("BUILD", build)
    ctx.file("WORKSPACE", "workspace(name = \"libtorch\")\n")

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    environ = ["STOWAGE_TORCH_VARIANT", "STOWAGE_LIBTORCH_DIR", "CUDA_HOME"],
    local = True,
)
