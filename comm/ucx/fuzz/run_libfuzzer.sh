#!/usr/bin/env bash
# Builds comm/ucx/fuzz/ucx_wire_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# decoders of what ucx peers send (comm/ucx/ucx_wire.h; no UCX context) for N seconds (default
# 60), in this one process (one core).
#
#   comm/ucx/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#
# The seeds in comm/ucx/fuzz/corpus are read but never written: new inputs go to the working
# corpus under $FS_FUZZ_OUT (default /tmp/fs_ucx_fuzz), crashes to $FS_FUZZ_OUT/crashes.
# Reproduce a crash with:  $FS_FUZZ_OUT/ucx_wire_fuzz $FS_FUZZ_OUT/crashes/crash-...
# A fixed number of executions instead of a time: run_libfuzzer.sh 0 -runs=10000000
# FS_FUZZ_NO_BUILD=1 reuses the binary already in $FS_FUZZ_OUT.
set -euo pipefail

seconds="${1:-60}"
shift || true
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${FS_FUZZ_OUT:-/tmp/fs_ucx_fuzz}"
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
  -labsl_log_severity -pthread
)

if [[ -z "${FS_FUZZ_NO_BUILD:-}" ]]; then
  echo "run_libfuzzer: building $out/ucx_wire_fuzz with $cxx" >&2
  "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root" -I/usr/include \
    "$here/ucx_wire_fuzz.cc" \
    "$root/comm/ucx/ucx_wire.cc" \
    "$root/comm/algorithms/transport.cc" \
    "$root/comm/communicator.cc" \
    "$root/comm/types.cc" \
    "$root/comm/work.cc" \
    "${absl_libs[@]}" -o "$out/ucx_wire_fuzz"
fi

echo "run_libfuzzer: fuzzing for ${seconds}s" >&2
# -max_len: a 64 KiB worker address is the longest valid input; 4 KiB reaches every branch.
"$out/ucx_wire_fuzz" \
  -max_total_time="$seconds" \
  -max_len=4096 \
  -rss_limit_mb=2048 \
  -print_final_stats=1 \
  -artifact_prefix="$out/crashes/" \
  "$@" \
  "$out/corpus" "$here/corpus"
