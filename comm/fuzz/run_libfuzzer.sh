#!/usr/bin/env bash
# Builds comm/fuzz/slurm_hostlist_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# Slurm host-list parser on one core.
#
#   comm/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#
# Working corpus and crashes under $FS_FUZZ_OUT (default /tmp/fs_hostlist_fuzz); see
# base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../base/libfuzzer.sh"
fs_fuzz_init slurm_hostlist_fuzz /tmp/fs_hostlist_fuzz "$@"
fs_fuzz_build "$here/slurm_hostlist_fuzz.cc" "$FS_FUZZ_ROOT/comm/slurm_hostlist.cc"
fs_fuzz_run -max_len=512 --
