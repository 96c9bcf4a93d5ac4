#!/usr/bin/env bash
# Builds offload/fuzz/disk_tier_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# offload tier's file reader (DiskTier::Open and the chunk reads after it) on one core; the
# fuzzed file lives on tmpfs (every execution writes, opens and reads it).
#
#   offload/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   offload/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# The seeds in offload/fuzz/corpus are read, never written; working corpus and crashes under
# $FS_FUZZ_OUT (default /tmp/fs_offload_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../base/libfuzzer.sh"
fs_fuzz_init disk_tier_fuzz /tmp/fs_offload_fuzz "$@"
fs_fuzz_build "$here/disk_tier_fuzz.cc" "$FS_FUZZ_ROOT/offload/disk_tier.cc" \
  "$FS_FUZZ_ROOT/offload/tier.cc" "$FS_FUZZ_ROOT/base/fnv1a.cc" "${FS_FUZZ_C10[@]}"
# -max_len: the seeds are 4-8 KiB (a 4096-byte header, the table 4096-aligned, then the data).
# -malloc_limit_mb: every allocation Open() makes is bounded by the file (at most 16 KiB here)
# or by the expected tensors (a few hundred bytes); 16 MiB is far beyond both, and a hostile
# header that once sized a 64 MiB layout buffer trips it.
fs_fuzz_run -tmpfs -max_len=16384 -malloc_limit_mb=16 -- "$here/corpus"
