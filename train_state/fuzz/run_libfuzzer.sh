#!/usr/bin/env bash
# Builds train_state/fuzz/marker_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# CheckpointManager's COMPLETE marker reader on one core.
#
#   train_state/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   train_state/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# Working corpus and crashes under $FS_FUZZ_OUT (default /tmp/fs_marker_fuzz); see
# base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../base/libfuzzer.sh"
fs_fuzz_init marker_fuzz /tmp/fs_marker_fuzz "$@"
fs_fuzz_build "$here/marker_fuzz.cc" "$FS_FUZZ_ROOT/train_state/step_dir.cc" "$FS_FUZZ_ROOT/base/atomic_file.cc" \
  "$FS_FUZZ_ROOT/base/fnv1a.cc" "$FS_FUZZ_ROOT/base/json_fields.cc"
fs_fuzz_run -max_len=4096 -malloc_limit_mb=64 -- "$here/corpus"
