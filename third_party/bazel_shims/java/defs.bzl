# Stand-in for @rules_java//java:defs.bzl (only loaded by @bazel_tools//tools/jdk toolchains).
java_import = native.java_import
java_runtime = native.java_runtime
java_toolchain = native.java_toolchain
