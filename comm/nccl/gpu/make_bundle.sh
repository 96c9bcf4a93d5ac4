#!/bin/bash
# Packs the NCCL tests for a GPU machine that has CUDA + NCCL but no Bazel (e.g. the lent device
# machine): builds nccl_test and registration_test here with --config=cuda, statically linking
# our own libraries, and copies them, their Debian shared libraries (Abseil, glog, ...; not NCCL,
# not the CUDA driver) and comm/nccl/gpu/run.sh into <out> (default .devbundle, git-ignored via
# .git/info/exclude). There: `bash <out>/run.sh` (OUT=<dir for the log> optional).
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-.devbundle}
./bazelw build --config=cuda --dynamic_mode=off //comm/nccl:nccl_test //comm/nccl:registration_test
bin=$(./bazelw info --config=cuda bazel-bin 2>/dev/null)
rm -rf "$out" && mkdir -p "$out/lib" "$out/fallback"
cp "$bin/comm/nccl/nccl_test" "$bin/comm/nccl/registration_test" comm/nccl/gpu/run.sh "$out/"
chmod u+w "$out"/*
for b in "$out/nccl_test" "$out/registration_test"; do ldd "$b" | awk '/=> \//{print $3}'; done |
  sort -u | grep -vE 'lib(c|m|pthread|rt|dl|gcc_s|stdc\+\+|nccl)\.so' |
  xargs -I{} cp -L {} "$out/lib/"
cp -L /lib/x86_64-linux-gnu/libstdc++.so.6 "$out/fallback/"  # only if the machine's is older
du -sh "$out"
