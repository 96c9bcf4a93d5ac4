"""Rule macros for fairscale-cpp: compiler flags live here and nowhere else.

fs_cc_library / fs_cc_test / fs_cc_binary wrap the native rules with C++17 and warnings as
errors. Tests default to size "small"; multi-process tests add tags = ["block-network"] so each
runs in its own network namespace with only loopback.
"""

FS_COPTS = [
    "-std=c++17",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
    "-Wno-sign-compare",
    "-Wno-missing-field-initializers",
]

def _copts(copts):
    return FS_COPTS + (copts or [])

def fs_cc_library(name, copts = None, **kwargs):
    native.cc_library(name = name, copts = _copts(copts), **kwargs)

def fs_cc_binary(name, copts = None, **kwargs):
    native.cc_binary(name = name, copts = _copts(copts), **kwargs)

def fs_cc_test(name, copts = None, size = "small", deps = None, **kwargs):
    native.cc_test(
        name = name,
        copts = _copts(copts),
        size = size,
        deps = (deps or []),
        **kwargs
    )

def _here(name):
    # "@fairscale_cpp//bazel:name" from a consumer, "@//bazel:name" in this workspace: labels in
    # this file resolve in fairscale-cpp's repository, whichever BUILD file calls the macro.
    label = Label("//bazel:" + name)
    return "@%s//%s:%s" % (label.workspace_name, label.package, label.name)

def if_cuda(if_true, if_false = []):
    return select({_here("cuda"): if_true, "//conditions:default": if_false})

# `target_compatible_with = REQUIRES_CUDA` on targets that only make sense with CUDA.
REQUIRES_CUDA = select({_here("cuda"): [], "//conditions:default": [_here("incompatible")]})
