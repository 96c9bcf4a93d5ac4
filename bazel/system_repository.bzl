"""system_repository: a repository of BUILD files over a system (Debian) library.

The library's headers live in a builtin include directory of the toolchain (/usr/include) and its
shared objects in the linker's default path, so the repository holds only BUILD files with
`linkopts`. `marker` is a path that exists when the package is installed: without it the fetch
fails naming the package to install, or (with `optional = True`) every target in `stub_targets`
becomes incompatible, so `bazel build //...` skips their dependents.
"""

def _label_str(label):
    # "@repo//pkg:name" that resolves to the same target from any repository (str(Label) drops
    # the "@" of the main repository).
    return "@%s//%s:%s" % (label.workspace_name, label.package, label.name)

_INCOMPATIBLE = Label("//bazel:incompatible")

def _system_repository_impl(rctx):
    marker = rctx.path(rctx.attr.marker)
    rctx.file("WORKSPACE", 'workspace(name = "%s")\n' % rctx.name)
    if not marker.exists:
        if not rctx.attr.optional:
            fail("@%s: %s not found: install the Debian package %s (./bazelw installs it)" % (
                rctx.name,
                rctx.attr.marker,
                rctx.attr.package,
            ))
        incompatible = _label_str(_INCOMPATIBLE)
        stub = ['package(default_visibility = ["//visibility:public"])']
        for name in rctx.attr.stub_targets:
            stub.append('cc_library(name = "%s", target_compatible_with = ["%s"])' % (name, incompatible))
        rctx.file("BUILD.bazel", "\n".join(stub) + "\n")
        return
    if rctx.attr.link_root:
        for entry in marker.readdir():
            rctx.symlink(entry, entry.basename)
    for label, path in rctx.attr.build_files.items():
        rctx.symlink(label, path)

system_repository = repository_rule(
    implementation = _system_repository_impl,
    local = True,
    attrs = {
        "marker": attr.string(mandatory = True, doc = "absolute path that exists when installed"),
        "package": attr.string(doc = "the Debian package that provides it (for the error)"),
        "build_files": attr.label_keyed_string_dict(
            doc = "BUILD file -> its path in the repository (e.g. 'BUILD.bazel', 'absl/strings/BUILD')",
            allow_files = True,
        ),
        "link_root": attr.bool(doc = "symlink the marker directory's entries into the repository"),
        "optional": attr.bool(doc = "a stub of incompatible targets instead of an error when absent"),
        "stub_targets": attr.string_list(doc = "target names the stub provides"),
    },
)
