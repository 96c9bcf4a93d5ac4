#!/usr/bin/env bash
# Builds comm/store/fuzz/wire_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# TCPStore frame decoder (and the server's hello gate) on one core.
#
#   comm/store/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   comm/store/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# The seeds in comm/store/fuzz/corpus are read, never written; working corpus and crashes under
# $FS_FUZZ_OUT (default /tmp/fs_wire_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../../base/libfuzzer.sh"
fs_fuzz_init wire_fuzz /tmp/fs_wire_fuzz "$@"
fs_fuzz_build "$here/wire_fuzz.cc" "$FS_FUZZ_ROOT/comm/store/wire.cc" \
  "$FS_FUZZ_ROOT/comm/store/store_util.cc"
fs_fuzz_run -max_len=4096 -- "$here/corpus"
