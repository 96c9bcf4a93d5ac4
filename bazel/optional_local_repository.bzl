"""A new_local_repository that degrades to a stub of incompatible targets when `path` is absent.

Used for /usr/local/cuda: on machines without it, `bazel build //...` skips the dependents
instead of failing to fetch the repository.
"""

def _impl(rctx):
    root = rctx.path(rctx.attr.path)
    if root.exists:
        for entry in root.readdir():
            rctx.symlink(entry, entry.basename)
        rctx.symlink(rctx.attr.build_file, "BUILD.bazel")
    else:
        rctx.file("BUILD.bazel", "\n".join([
            'package(default_visibility = ["//visibility:public"])',
            "[cc_library(name = n, target_compatible_with = [\"@//bazel:incompatible\"]) for n in %r]" % rctx.attr.targets,
        ]) + "\n")

optional_local_repository = repository_rule(
    implementation = _impl,
    local = True,
    attrs = {
        "path": attr.string(mandatory = True),
        "build_file": attr.label(mandatory = True),
        "targets": attr.string_list(doc = "target names the stub must provide"),
    },
)
