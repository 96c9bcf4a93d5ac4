"""fairscale_cpp_dependencies(): every repository fairscale-cpp needs, for any WORKSPACE.

A consumer's WORKSPACE:

    local_repository(name = "fairscale_cpp", path = "/path/to/fairscale-cpp")  # or http_archive
    load("@fairscale_cpp//bazel:repositories.bzl", "fairscale_cpp_dependencies")
    fairscale_cpp_dependencies()

A repository the WORKSPACE already declared is kept (declare yours before the call): an Abseil
built from source as @com_google_absl, your own @com_google_googletest, a @libtorch of yours
(it must provide :torch, :aten, :c10d and :torch_cuda, see libtorch.bzl). The rest are Debian's
system libraries (./bazelw installs them), under the upstream repository names and labels:

  @com_google_absl           Abseil (libabsl-dev), //absl/strings, //absl/status:statusor, ...
  @com_google_googletest     GoogleTest + GoogleMock (libgtest-dev, libgmock-dev): :gtest, :gtest_main
  @com_github_google_benchmark  Google Benchmark (libbenchmark-dev): :benchmark, :benchmark_main
  @com_github_google_glog    glog + gflags (libgoogle-glog-dev): :glog
  @nlohmann_json             nlohmann-json3-dev: :json
  @libtorch                  LibTorch, found by libtorch.bzl (libtorch = "/path" or $LIBTORCH_HOME)
  @fairscale_cpp_gloo, @fairscale_cpp_ucx   libgloo-dev, libucx-dev (the benchmark, //comm/ucx)
  @fairscale_cpp_netfilter_queue   libnetfilter-queue-dev (the multi-host tests' packet delayer)
  @fairscale_cpp_cuda        /usr/local/cuda (CUDA + NCCL); a stub of incompatible targets without it
  @rules_cc, @rules_java, @remote_coverage_tools   offline stand-ins for what Bazel 4.2.3's own
                             WORKSPACE suffix would download (native rules re-exported)

Every label here is resolved in fairscale-cpp's repository (Label()), never in the caller's.
"""

load("//bazel:libtorch.bzl", "libtorch_repository")
load("//bazel:system_repository.bzl", "system_repository")

def _sys(name):
    return Label("//third_party/system:" + name)

# Offline stand-ins for @rules_cc, @rules_java, @remote_coverage_tools: only
# @rules_cc//cc:defs.bzl, @rules_java//java:defs.bzl and :coverage_report_generator are used.
_SHIMS = {
    "rules_cc": {
        "cc/BUILD": "",
        "cc/defs.bzl": "\n".join([
            "# Offline stand-in for rules_cc: Bazel's native C++ rules.",
            "cc_binary = native.cc_binary",
            "cc_library = native.cc_library",
            "cc_test = native.cc_test",
            "cc_import = native.cc_import",
            "cc_toolchain = native.cc_toolchain",
            "cc_toolchain_suite = native.cc_toolchain_suite",
        ]),
    },
    "rules_java": {
        "java/BUILD": "",
        "java/defs.bzl": "\n".join([
            "# Offline stand-in for rules_java (only loaded by @bazel_tools//tools/jdk).",
            "java_import = native.java_import",
            "java_runtime = native.java_runtime",
            "java_toolchain = native.java_toolchain",
        ]),
    },
    "remote_coverage_tools": {
        "BUILD": "\n".join([
            "# Offline stand-in for remote_coverage_tools (only `bazel coverage` uses it).",
            'filegroup(name = "coverage_report_generator", visibility = ["//visibility:public"])',
        ]),
    },
}

def _shim_impl(rctx):
    rctx.file("WORKSPACE", "")
    for path, content in _SHIMS[rctx.attr.shim].items():
        rctx.file(path, content + "\n")

_shim = repository_rule(implementation = _shim_impl, attrs = {"shim": attr.string()})

_ABSL_PACKAGES = [
    "algorithm",
    "base",
    "container",
    "flags",
    "functional",
    "random",
    "status",
    "strings",
    "synchronization",
    "time",
    "types",
]

# Debian libraries with one BUILD file each: (repository, marker path, package, BUILD file).
_SYSTEM_LIBRARIES = [
    ("com_google_googletest", "/usr/include/gmock", "libgmock-dev", "gtest.BUILD"),
    ("com_github_google_benchmark", "/usr/include/benchmark", "libbenchmark-dev", "benchmark.BUILD"),
    ("com_github_google_glog", "/usr/include/glog", "libgoogle-glog-dev", "glog.BUILD"),
    ("nlohmann_json", "/usr/include/nlohmann", "nlohmann-json3-dev", "nlohmann_json.BUILD"),
    ("fairscale_cpp_gloo", "/usr/include/gloo", "libgloo-dev", "gloo.BUILD"),
    ("fairscale_cpp_ucx", "/usr/include/ucp", "libucx-dev", "ucx.BUILD"),
    ("fairscale_cpp_netfilter_queue", "/usr/include/libnetfilter_queue", "libnetfilter-queue-dev",
     "netfilter_queue.BUILD"),
]

def _maybe(rule, name, **kwargs):
    if not native.existing_rule(name):
        rule(name = name, **kwargs)

def fairscale_cpp_dependencies(libtorch = None):
    """Declares every repository fairscale-cpp needs that the WORKSPACE has not declared yet.

    Args:
      libtorch: the LibTorch to build with (an unpacked official archive, or a Python torch
        package directory). None: $LIBTORCH_HOME, /opt/libtorch, /usr/local/libtorch, python3's
        torch, then Debian's libtorch-dev (see libtorch.bzl).
    """
    for name in _SHIMS:
        _maybe(_shim, name, shim = name)
    _maybe(libtorch_repository, "libtorch", path = libtorch or "")
    _maybe(
        system_repository,
        "com_google_absl",
        marker = "/usr/include/absl",
        package = "libabsl-dev",
        build_files = {
            _sys("absl/%s.BUILD" % p): "absl/%s/BUILD.bazel" % p
            for p in _ABSL_PACKAGES
        },
    )
    for name, marker, package, build_file in _SYSTEM_LIBRARIES:
        _maybe(
            system_repository,
            name,
            marker = marker,
            package = package,
            build_files = {_sys(build_file): "BUILD.bazel"},
        )
    # CUDA + NCCL are not a Debian package; without /usr/local/cuda every target is
    # incompatible, so `bazel build //...` skips their dependents instead of failing.
    _maybe(
        system_repository,
        "fairscale_cpp_cuda",
        marker = "/usr/local/cuda",
        package = "CUDA (not a Debian package)",
        build_files = {_sys("cuda.BUILD"): "BUILD.bazel"},
        link_root = True,
        optional = True,
        stub_targets = ["cuda_headers", "cudart", "nccl"],
    )
