#!/usr/bin/env bash
# Builds comm/fuzz/slurm_hostlist_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# Slurm host-list parser for N seconds (default 60). New inputs and crashes go to $FS_FUZZ_OUT
# (default /tmp/fs_hostlist_fuzz).
#
#   comm/fuzz/run_libfuzzer.sh [SECONDS]
set -euo pipefail
seconds="${1:-60}"
root="$(cd "$(dirname "$0")/../.." && pwd)"
out="${FS_FUZZ_OUT:-/tmp/fs_hostlist_fuzz}"
mkdir -p "$out/corpus" "$out/crashes"
"${CXX_FUZZ:-clang++}" -std=c++17 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I"$root" \
  "$root/comm/fuzz/slurm_hostlist_fuzz.cc" "$root/comm/slurm_hostlist.cc" \
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal \
  -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_strerror \
  -labsl_str_format_internal -labsl_strings -labsl_strings_internal -labsl_int128 \
  -labsl_synchronization -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal \
  -labsl_demangle_internal -labsl_malloc_internal -labsl_time -labsl_civil_time \
  -labsl_time_zone -labsl_base -labsl_raw_logging_internal -labsl_throw_delegate \
  -labsl_spinlock_wait -labsl_log_severity -o "$out/slurm_hostlist_fuzz"
"$out/slurm_hostlist_fuzz" -max_total_time="$seconds" -max_len=512 -rss_limit_mb=2048 \
  -print_final_stats=1 -artifact_prefix="$out/crashes/" "$out/corpus"
