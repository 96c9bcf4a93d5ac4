#!/usr/bin/env bash
# CI of the consumer workspace (run by .ci/run after the main tests; runs alone too):
#   1. builds and tests it as a user gets it: fairscale-cpp through fairscale_cpp_dependencies()
#      with Debian's LibTorch (the default);
#   2. checks libtorch_repository's errors at fetch time: a directory that is not LibTorch, an
#      unsupported version, a pre-C++11-ABI build;
#   3. builds and tests it again against the same LibTorch files arranged as the official
#      archive (libtorch/{include,lib,share/cmake/Torch}, a tree of symlinks made here) through
#      LIBTORCH_HOME, and checks that build used that layout.
# Both builds share the disk cache (~/.cache/bazel-disk), so a second CI run on the same machine
# is cache hits. The archive build has its own output base (~/.cache/fairscale-cpp-consumer-archive)
# so the two do not refetch @libtorch back and forth.
set -euo pipefail
cd "$(dirname "$0")"
FLAGS=(--nosandbox_debug --disk_cache=~/.cache/bazel-disk --show_timestamps=false)
ARCHIVE_BASE=${HOME}/.cache/fairscale-cpp-consumer-archive

step() { echo "consumer ci: $*"; }

step "1/4 test //... against the default LibTorch (Debian's)"
bazel test "${FLAGS[@]}" --test_output=errors //...
bazel shutdown

# A LibTorch tree in the official archive's layout, made of links to Debian's files.
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
archive_tree() {  # archive_tree DIR
  local root=$1 libdir
  libdir=$(dirname "$(readlink -f /usr/lib/*/libtorch_cpu.so | head -1)")
  mkdir -p "$root/include" "$root/lib" "$root/share/cmake"
  for d in ATen c10 caffe2 torch; do ln -s "/usr/include/$d" "$root/include/$d"; done
  for f in "$libdir"/lib{torch,torch_cpu,c10,torch_global_deps}.so*; do ln -s "$f" "$root/lib/"; done
  ln -s "$libdir/cmake/Torch" "$root/share/cmake/Torch"
}

# expect_fetch_error NAME PATTERN: fetching @libtorch with LIBTORCH_HOME=$tmp/NAME fails with a
# message matching PATTERN.
expect_fetch_error() {
  local name=$1 pattern=$2 out
  if out=$(cd "$tmp/other" && LIBTORCH_HOME="$tmp/$name" bazel --output_base="$tmp/other_base" \
      build "${FLAGS[@]}" --nobuild @libtorch//:torch 2>&1); then
    echo "$out"
    echo "FAIL: LIBTORCH_HOME=$name fetched"
    exit 1
  fi
  if ! grep -qE "$pattern" <<<"$out"; then
    echo "$out"
    echo "FAIL: LIBTORCH_HOME=$name: no error matching '$pattern'"
    exit 1
  fi
  step "  LIBTORCH_HOME=<$name>: $(grep -oE "$pattern" <<<"$out" | head -1)"
}

step "2/4 every target of fairscale-cpp analyses from another workspace (a clean export of HEAD)"
# `bazel build @fairscale_cpp//...` from a consumer: no label may resolve in the consumer's
# repository. (A checkout with bazel-* links of its own is not clean: Bazel 4 skips those links
# only in the main repository, so the export comes from git.)
mkdir -p "$tmp/export" "$tmp/other"
git -C ../.. archive HEAD | tar -x -C "$tmp/export"
cat >"$tmp/other/WORKSPACE" <<EOF
local_repository(name = "fairscale_cpp", path = "$tmp/export")
load("@fairscale_cpp//bazel:repositories.bzl", "fairscale_cpp_dependencies")
fairscale_cpp_dependencies()
EOF
(cd "$tmp/other" && bazel --output_base="$tmp/other_base" build "${FLAGS[@]}" --nobuild @fairscale_cpp//... &&
 bazel --output_base="$tmp/other_base" test "${FLAGS[@]}" --test_output=errors @fairscale_cpp//tools:deps_test)

step "3/4 libtorch_repository rejects what is not a usable LibTorch"
mkdir -p "$tmp/empty"
expect_fetch_error empty "is not a LibTorch: missing include/ATen/ATen.h"
mkdir -p "$tmp/too_new"
archive_tree "$tmp/too_new"
rm "$tmp/too_new/include/torch"
mkdir -p "$tmp/too_new/include/torch"
cp -as /usr/include/torch/. "$tmp/too_new/include/torch/"
version_h="$tmp/too_new/include/torch/csrc/api/include/torch/version.h"
rm "$version_h"
printf '#define TORCH_VERSION_MAJOR 2\n#define TORCH_VERSION_MINOR 99\n#define TORCH_VERSION_PATCH 0\n' \
    >"$version_h"
expect_fetch_error too_new "LibTorch 2\.99\.0 at [^ ]+ is not supported"
mkdir -p "$tmp/old_abi"
archive_tree "$tmp/old_abi"
rm "$tmp/old_abi/share/cmake/Torch"
mkdir -p "$tmp/old_abi/share/cmake/Torch"
echo 'set(TORCH_CXX_FLAGS "-D_GLIBCXX_USE_CXX11_ABI=0")' >"$tmp/old_abi/share/cmake/Torch/TorchConfig.cmake"
expect_fetch_error old_abi "built with the pre-C\+\+11 ABI"
(cd "$tmp/other" && bazel --output_base="$tmp/other_base" shutdown)

step "4/4 test //... against LibTorch in the official archive's layout (LIBTORCH_HOME)"
# At a fixed path: the rpath to its lib/ is on the link command lines, which then stay cached.
tree=${ARCHIVE_BASE}-libtorch
rm -rf "$tree"
archive_tree "$tree"
# In a copy of this workspace: Bazel 4 would take this directory's bazel-* links, which point
# into the other output base, for packages.
ws=${ARCHIVE_BASE}-workspace
rm -rf "$ws" && mkdir -p "$ws"
cp BUILD.bazel ./*.cc ./*.sh "$ws/"
sed "s#path = \"../..\"#path = \"$(cd ../.. && pwd)\"#" WORKSPACE >"$ws/WORKSPACE"
(cd "$ws" && LIBTORCH_HOME="$tree" bazel --output_base="$ARCHIVE_BASE" test "${FLAGS[@]}" \
    --test_output=errors //...)
layout=$(cd "$ws" && LIBTORCH_HOME="$tree" bazel --output_base="$ARCHIVE_BASE" info output_base)/external/libtorch/defs.bzl
grep -q 'LIBTORCH_LAYOUT = "archive"' "$layout" || { cat "$layout"; echo "FAIL: not the archive layout"; exit 1; }
step "  built and tested with $(grep -E '^LIBTORCH_(VERSION|LAYOUT)' "$layout" | tr '\n' ' ')"
(cd "$ws" && bazel --output_base="$ARCHIVE_BASE" shutdown)
step "PASS"
