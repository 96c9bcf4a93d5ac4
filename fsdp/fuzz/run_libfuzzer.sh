#!/usr/bin/env bash
# Builds fsdp/fuzz/sharded_checkpoint_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# sharded checkpoint's readers (manifest, rank files, a directory cross-checked) on one core.
#
#   fsdp/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   fsdp/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# Working corpus and crashes under $FS_FUZZ_OUT (default /tmp/fs_fsdp_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../base/libfuzzer.sh"
fs_fuzz_init sharded_checkpoint_fuzz /tmp/fs_fsdp_fuzz "$@"
fs_fuzz_build "$here/sharded_checkpoint_fuzz.cc" "$FS_FUZZ_ROOT/fsdp/internal/shard_file.cc" "$FS_FUZZ_ROOT/base/atomic_file.cc" \
  "$FS_FUZZ_ROOT/base/fnv1a.cc" "$FS_FUZZ_ROOT/base/json_fields.cc"
# -max_len: the seeds are up to 2.5 KiB (a manifest and two rank files). -malloc_limit_mb: the
# readers allocate at most a file's size (16 KiB here) plus JSON nodes; a hostile length field
# that turned into a large allocation trips it.
fs_fuzz_run -tmpfs -max_len=16384 -malloc_limit_mb=64 -- "$here/corpus"
