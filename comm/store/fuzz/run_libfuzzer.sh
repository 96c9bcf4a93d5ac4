#!/usr/bin/env bash
# Builds comm/store/fuzz/wire_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# TCPStore frame decoder for N seconds (default 60).
#
#   comm/store/fuzz/run_libfuzzer.sh [SECONDS]
#
# The seeds in comm/store/fuzz/corpus are read but never written: new inputs go to the working
# corpus under $FS_FUZZ_OUT (default /tmp/fs_wire_fuzz), crashes to $FS_FUZZ_OUT/crashes.
# Reproduce a crash with:  $FS_FUZZ_OUT/wire_fuzz $FS_FUZZ_OUT/crashes/crash-...
set -euo pipefail

seconds="${1:-60}"
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${FS_FUZZ_OUT:-/tmp/fs_wire_fuzz}"
cxx="${CXX_FUZZ:-clang++}"
mkdir -p "$out/corpus" "$out/crashes"

# Debian's Abseil is a set of shared libraries (gcc-built; same libstdc++ ABI as clang's).
absl_libs=(
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
  -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_strerror
  -labsl_str_format_internal -labsl_strings -labsl_strings_internal -labsl_int128
  -labsl_time -labsl_civil_time -labsl_time_zone -labsl_synchronization -labsl_stacktrace
  -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal -labsl_malloc_internal
  -labsl_base -labsl_raw_logging_internal -labsl_throw_delegate -labsl_spinlock_wait
  -labsl_log_severity
)

echo "run_libfuzzer: building $out/wire_fuzz with $cxx" >&2
"$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root" -I/usr/include \
  "$root/comm/store/fuzz/wire_fuzz.cc" \
  "$root/comm/store/wire.cc" \
  "$root/comm/store/store_util.cc" \
  "${absl_libs[@]}" -o "$out/wire_fuzz"

echo "run_libfuzzer: fuzzing for ${seconds}s" >&2
# -max_len: frames with small keys/values exercise every branch; the length fields themselves
# are what the decoder must distrust. -rss_limit_mb catches an allocation the limits missed.
"$out/wire_fuzz" \
  -max_total_time="$seconds" \
  -max_len=4096 \
  -rss_limit_mb=2048 \
  -print_final_stats=1 \
  -artifact_prefix="$out/crashes/" \
  "$out/corpus" "$here/corpus"
