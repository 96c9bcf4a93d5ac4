#!/usr/bin/env bash
# Builds comm/ucx/fuzz/ucx_wire_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# decoders of what ucx peers send (comm/ucx/ucx_wire.h; no UCX context) on one core.
#
#   comm/ucx/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   comm/ucx/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# The seeds in comm/ucx/fuzz/corpus are read, never written; working corpus and crashes under
# $FS_FUZZ_OUT (default /tmp/fs_ucx_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../../base/libfuzzer.sh"
fs_fuzz_init ucx_wire_fuzz /tmp/fs_ucx_fuzz "$@"
fs_fuzz_build "$here/ucx_wire_fuzz.cc" "$FS_FUZZ_ROOT/comm/ucx/ucx_wire.cc" \
  "$FS_FUZZ_ROOT/comm/algorithms/transport.cc" "$FS_FUZZ_ROOT/comm/communicator.cc" \
  "$FS_FUZZ_ROOT/comm/types.cc" "$FS_FUZZ_ROOT/comm/work.cc"
fs_fuzz_run -max_len=4096 -- "$here/corpus"
