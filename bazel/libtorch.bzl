"""libtorch_repository: finds LibTorch on this machine and makes it @libtorch.

Where it looks, in order (the first that exists wins; one that exists but is not LibTorch is an
error naming what is missing, never a silent fall-through):
  1. `path` (fairscale_cpp_dependencies(libtorch = "/opt/libtorch"));
  2. $LIBTORCH_HOME;
  3. an official archive unpacked at /opt/libtorch or /usr/local/libtorch;
  4. the `torch` package of the first `python3` on $PATH (its torch/include and torch/lib);
  5. Debian's libtorch-dev (/usr/include/torch, /usr/lib/<triplet>/libtorch_cpu.so).
An official archive and a Python install share one layout: include/{ATen,c10,torch,...},
include/torch/csrc/api/include, lib/libtorch_cpu.so, and share/cmake/Torch (archive only).

Targets of @libtorch:
  :torch       the C++ frontend, <torch/torch.h> (~20 s per file: prefer :aten)
  :aten        ATen and c10 only: <ATen/core/Tensor.h>, <ATen/ops/*.h>, <c10/...>
  :c10d        torch.distributed's C++ side (<torch/csrc/distributed/c10d/TCPStore.hpp>, ...)
  :torch_cuda  libtorch_cuda + libc10_cuda (a CUDA build only; incompatible otherwise)
and @libtorch//:defs.bzl with LIBTORCH_VERSION, LIBTORCH_CUDA (True for a CUDA build),
LIBTORCH_LAYOUT ("debian" or "archive") and if_libtorch_cuda(if_true, if_false).

Checked at fetch time, each a clear error: the layout (names the missing files), the version
(SUPPORTED_VERSIONS; FAIRSCALE_CPP_UNTESTED_LIBTORCH=1 builds with another one anyway) and the
C++ ABI (a pre-C++11-ABI LibTorch cannot link with the system's Abseil, glog and GoogleTest).
A non-Debian LibTorch is linked with an rpath to its lib directory (as CMake's TorchConfig does).
"""

SUPPORTED_VERSIONS = ["1.13"]

_ENV = ["LIBTORCH_HOME", "FAIRSCALE_CPP_UNTESTED_LIBTORCH", "PATH"]

_ARCHIVE_PLACES = ["/opt/libtorch", "/usr/local/libtorch"]

_DEBIAN_API_INCLUDE = "/usr/include/torch/csrc/api/include"

# Files a usable LibTorch has, relative to its root (archive/Python layout).
_ARCHIVE_REQUIRED = [
    "include/ATen/ATen.h",
    "include/c10/macros/Macros.h",
    "include/torch/csrc/api/include/torch/torch.h",
    "include/torch/csrc/api/include/torch/version.h",
    "include/torch/csrc/distributed/c10d/TCPStore.hpp",
    "lib/libc10.so",
    "lib/libtorch_cpu.so",
    "lib/libtorch.so",
]

def _debian_lib_dir(rctx):
    for d in ["/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib"]:
        if rctx.path(d + "/libtorch_cpu.so").exists:
            return d
    return None

def _realpath(rctx, path):
    r = rctx.execute(["readlink", "-f", path])
    return r.stdout.strip() if r.return_code == 0 else path

def _version(rctx, version_h, where):
    text = rctx.read(version_h)
    parts = {}
    for line in text.splitlines():
        fields = [f for f in line.replace("\t", " ").split(" ") if f]
        if len(fields) == 3 and fields[0] == "#define" and fields[1].startswith("TORCH_VERSION_"):
            parts[fields[1][len("TORCH_VERSION_"):]] = fields[2]
    if "MAJOR" not in parts or "MINOR" not in parts:
        fail("LibTorch at %s: %s has no TORCH_VERSION_MAJOR/MINOR" % (where, version_h))
    return "%s.%s.%s" % (parts["MAJOR"], parts["MINOR"], parts.get("PATCH", "0"))

def _check_version(rctx, version, where):
    minor = ".".join(version.split(".")[:2])
    if minor in SUPPORTED_VERSIONS:
        return
    if rctx.os.environ.get("FAIRSCALE_CPP_UNTESTED_LIBTORCH", "") == "1":
        print("fairscale-cpp: building with LibTorch %s from %s, which is not one of the tested " % (version, where) +
              "versions (%s), because FAIRSCALE_CPP_UNTESTED_LIBTORCH=1" % ", ".join(SUPPORTED_VERSIONS))
        return
    fail(("LibTorch %s at %s is not supported: fairscale-cpp is built and tested against LibTorch %s. " +
          "Point LIBTORCH_HOME (or fairscale_cpp_dependencies(libtorch = ...)) at a supported one, or " +
          "set FAIRSCALE_CPP_UNTESTED_LIBTORCH=1 to try this one anyway.") %
         (version, where, " or ".join(SUPPORTED_VERSIONS)))

def _check_archive(rctx, root, why):
    missing = [f for f in _ARCHIVE_REQUIRED if not rctx.path(root + "/" + f).exists]
    if missing:
        fail(("%s = %s is not a LibTorch: missing %s (expected the layout of the official " +
              "archive or of a Python torch package: include/, include/torch/csrc/api/include/, lib/)") %
             (why, root, ", ".join(missing)))

def _cxx11_abi(rctx, root, python_abi):
    """False for a pre-C++11-ABI LibTorch. Python's answer wins; else TorchConfig.cmake's flags."""
    if python_abi != None:
        return python_abi
    cmake = rctx.path(root + "/share/cmake/Torch/TorchConfig.cmake")
    if cmake.exists:
        return "_GLIBCXX_USE_CXX11_ABI=0" not in rctx.read(cmake)
    return True

def _python_torch(rctx):
    """(torch dir, cxx11 abi) of python3's torch package, or None."""
    python = rctx.which("python3")
    if python == None:
        return None
    r = rctx.execute([python, "-c", "\n".join([
        "import os, torch",
        "print(os.path.dirname(os.path.abspath(torch.__file__)))",
        "print(int(bool(getattr(torch._C, '_GLIBCXX_USE_CXX11_ABI', True))))",
    ])], timeout = 120)
    if r.return_code != 0:
        return None
    lines = r.stdout.strip().splitlines()
    if len(lines) < 2:
        return None
    return (lines[-2], lines[-1] == "1")

def _find(rctx):
    """(kind, root, why, python_abi): kind "debian" or "archive"."""
    if rctx.attr.path:
        return ("archive", rctx.attr.path, "fairscale_cpp_dependencies(libtorch)", None)
    home = rctx.os.environ.get("LIBTORCH_HOME", "")
    if home:
        return ("archive", home, "LIBTORCH_HOME", None)
    for place in _ARCHIVE_PLACES:
        if rctx.path(place).exists:
            return ("archive", place, "the official archive at", None)
    found = _python_torch(rctx)
    if found != None:
        root, abi = found
        if rctx.path(root + "/include").exists and rctx.path(root + "/lib").exists:
            # Debian's python3-torch links include/ and lib/ to the system install: use that (its
            # headers are in a builtin include directory, which compiles faster).
            if _realpath(rctx, root + "/include/torch") != "/usr/include/torch":
                return ("archive", root, "python3's torch package", abi)
    if rctx.path(_DEBIAN_API_INCLUDE + "/torch/torch.h").exists and _debian_lib_dir(rctx) != None:
        return ("debian", "/usr", "Debian's libtorch-dev", None)
    fail("LibTorch not found: set LIBTORCH_HOME to an unpacked LibTorch archive (or pass " +
         "fairscale_cpp_dependencies(libtorch = \"/path/to/libtorch\")), install a Python torch " +
         "package, or install Debian's libtorch-dev (./bazelw does)")

_DEFS = """\
# Generated by fairscale-cpp's libtorch_repository: the LibTorch this build uses.
LIBTORCH_VERSION = "{version}"
LIBTORCH_CUDA = {cuda}
LIBTORCH_LAYOUT = "{layout}"

def if_libtorch_cuda(if_true, if_false = []):
    return if_true if LIBTORCH_CUDA else if_false
"""

_BUILD_HEAD = """\
# Generated by fairscale-cpp's libtorch_repository: LibTorch {version} ({layout}{cuda_note}).
package(default_visibility = ["//visibility:public"])
exports_files(["defs.bzl"])
"""

def _libtorch_repository_impl(rctx):
    kind, root, why, python_abi = _find(rctx)
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    incompatible = "@%s//%s:%s" % (_INCOMPATIBLE.workspace_name, _INCOMPATIBLE.package, _INCOMPATIBLE.name)
    if kind == "debian":
        libdir = _debian_lib_dir(rctx)
        version = _version(rctx, rctx.path(_DEBIAN_API_INCLUDE + "/torch/version.h"), "/usr/include/torch")
        _check_version(rctx, version, "/usr/include/torch (Debian's libtorch-dev)")
        cuda = rctx.path(libdir + "/libtorch_cuda.so").exists
        # Only the C++ frontend's include directory is outside the builtin /usr/include.
        rctx.symlink(_DEBIAN_API_INCLUDE + "/torch", "torch")
        headers = 'cc_library(name = "headers", hdrs = glob(["torch/**/*.h"]), includes = ["."])'
        aten_headers = 'cc_library(name = "aten_headers")'
        libs = []
        gloo = True
    else:
        if not rctx.path(root).exists:
            fail("%s = %s does not exist" % (why, root))
        _check_archive(rctx, root, why)
        root = _realpath(rctx, root)
        version = _version(rctx, rctx.path(root + "/include/torch/csrc/api/include/torch/version.h"), root)
        _check_version(rctx, version, root)
        if not _cxx11_abi(rctx, root, python_abi):
            fail(("LibTorch at %s is built with the pre-C++11 ABI (_GLIBCXX_USE_CXX11_ABI=0): it " +
                  "cannot link with the system's Abseil, glog and GoogleTest. Use the cxx11-ABI " +
                  "archive (libtorch-cxx11-abi-shared-with-deps-*.zip).") % root)
        libdir = root + "/lib"
        cuda = rctx.path(libdir + "/libtorch_cuda.so").exists
        rctx.symlink(root + "/include", "include")
        headers = "\n".join([
            "cc_library(",
            '    name = "headers",',
            '    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh"]),',
            '    includes = ["include", "include/torch/csrc/api/include"],',
            ")",
        ])
        aten_headers = 'cc_library(name = "aten_headers", deps = [":headers"])'
        libs = ["-L" + libdir, "-Wl,-rpath," + libdir]
        gloo = rctx.path(root + "/include/gloo").exists
    build = [_BUILD_HEAD.format(version = version, layout = kind, cuda_note = ", CUDA" if cuda else "")]
    build.append(headers)
    build.append(aten_headers)
    build.append('cc_library(name = "torch", deps = [":headers"], linkopts = %r)' %
                 (libs + ["-ltorch", "-ltorch_cpu", "-lc10"]))
    build.append('cc_library(name = "aten", deps = [":aten_headers"], linkopts = %r)' %
                 (libs + ["-ltorch_cpu", "-lc10"]))
    # ProcessGroupGloo.hpp is empty unless USE_C10D_GLOO is defined, and needs gloo's headers.
    build.append('cc_library(name = "c10d", deps = [":aten"], defines = %r)' %
                 (["USE_C10D_GLOO"] if gloo else []))
    if cuda:
        build.append('cc_library(name = "torch_cuda", deps = [":torch"], linkopts = %r)' %
                     (libs + ["-ltorch_cuda", "-lc10_cuda"]))
    else:
        build.append('cc_library(name = "torch_cuda", target_compatible_with = ["%s"])' % incompatible)
    rctx.file("BUILD.bazel", "\n".join(build) + "\n")
    rctx.file("defs.bzl", _DEFS.format(version = version, cuda = cuda, layout = kind))

_INCOMPATIBLE = Label("//bazel:incompatible")

libtorch_repository = repository_rule(
    implementation = _libtorch_repository_impl,
    local = True,
    environ = _ENV,
    attrs = {
        "path": attr.string(doc = "LibTorch root (official archive or Python torch layout)"),
    },
)
