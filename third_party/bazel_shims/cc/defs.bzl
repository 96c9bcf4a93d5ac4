# Stand-in for @rules_cc//cc:defs.bzl: Bazel 4.2.3's own WORKSPACE suffix wants to download
# rules_cc; offline we re-export the native C++ rules instead (see ../README.md).
cc_binary = native.cc_binary
cc_library = native.cc_library
cc_test = native.cc_test
cc_import = native.cc_import
cc_toolchain = native.cc_toolchain
cc_toolchain_suite = native.cc_toolchain_suite
