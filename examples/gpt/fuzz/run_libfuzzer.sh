#!/usr/bin/env bash
# Builds examples/gpt/fuzz/checkpoint_files_fuzz.cc with clang's libFuzzer + ASan + UBSan and
# fuzzes the COMPLETE-marker and metrics.jsonl readers for N seconds (default 60), on one core.
# The working corpus and any crashes go to $FS_FUZZ_OUT (default /tmp/fs_ckpt_files_fuzz); the
# first run seeds it from the replay test's seeds (corpus/).
#
#   examples/gpt/fuzz/run_libfuzzer.sh [SECONDS]
set -euo pipefail
seconds="${1:-60}"
root="$(cd "$(dirname "$0")/../../.." && pwd)"
out="${FS_FUZZ_OUT:-/tmp/fs_ckpt_files_fuzz}"
mkdir -p "$out/corpus" "$out/crashes"
cp -n "$root/examples/gpt/fuzz/corpus/"* "$out/corpus/" 2>/dev/null || true
"${CXX_FUZZ:-clang++}" -std=c++17 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -I"$root" \
  "$root/examples/gpt/fuzz/checkpoint_files_fuzz.cc" "$root/examples/gpt/checkpoint_dir.cc" \
  "$root/examples/gpt/metrics_file.cc" "$root/base/fnv1a.cc" \
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal \
  -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_strerror \
  -labsl_str_format_internal -labsl_strings -labsl_strings_internal -labsl_int128 \
  -labsl_synchronization -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal \
  -labsl_demangle_internal -labsl_malloc_internal -labsl_time -labsl_civil_time \
  -labsl_time_zone -labsl_base -labsl_raw_logging_internal -labsl_throw_delegate \
  -labsl_spinlock_wait -labsl_log_severity -o "$out/checkpoint_files_fuzz"
mkdir -p /dev/shm/fs_ckpt_files_fuzz
# The files the readers parse live on tmpfs (a disk directory costs 10x the executions).
TEST_TMPDIR=/dev/shm/fs_ckpt_files_fuzz "$out/checkpoint_files_fuzz" -max_total_time="$seconds" -max_len=4096 \
  -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$out/crashes/" "$out/corpus"
