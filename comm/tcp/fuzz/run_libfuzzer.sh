#!/usr/bin/env bash
# Builds comm/tcp/fuzz/tcp_transport_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# tcp backend's receive path (a real TcpTransport against fuzzer-written peer bytes) for N
# seconds (default 60), on one core.
#
#   comm/tcp/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#
# The seeds in comm/tcp/fuzz/corpus are read but never written: new inputs go to the working
# corpus under $FS_FUZZ_OUT (default /tmp/fs_tcp_fuzz), crashes to $FS_FUZZ_OUT/crashes.
# Reproduce a crash with:  $FS_FUZZ_OUT/tcp_transport_fuzz $FS_FUZZ_OUT/crashes/crash-...
# A fixed number of executions instead of a time: run_libfuzzer.sh 0 -runs=10000000
# FS_FUZZ_NO_BUILD=1 reuses the binary already in $FS_FUZZ_OUT. libFuzzer runs in this one
# process (one core); no -jobs/-workers.
set -euo pipefail

seconds="${1:-60}"
shift || true
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../../.." && pwd)"
out="${FS_FUZZ_OUT:-/tmp/fs_tcp_fuzz}"
cxx="${CXX_FUZZ:-clang++}"
mkdir -p "$out/corpus" "$out/crashes"

# Debian's Abseil and glog are shared libraries (gcc-built; same libstdc++ ABI as clang's).
absl_libs=(
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
  -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_strerror
  -labsl_str_format_internal -labsl_strings -labsl_strings_internal -labsl_int128
  -labsl_time -labsl_civil_time -labsl_time_zone -labsl_synchronization -labsl_stacktrace
  -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal -labsl_malloc_internal
  -labsl_base -labsl_raw_logging_internal -labsl_throw_delegate -labsl_spinlock_wait
  -labsl_log_severity -lglog -lgflags -pthread
)

if [[ -z "${FS_FUZZ_NO_BUILD:-}" ]]; then
  echo "run_libfuzzer: building $out/tcp_transport_fuzz with $cxx" >&2
  "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root" -I/usr/include \
    "$here/tcp_transport_fuzz.cc" \
    "$root/comm/tcp/tcp_transport.cc" \
    "$root/comm/tcp/tcp_transport_errors.cc" \
    "$root/comm/tcp/internal/mesh.cc" \
    "$root/comm/tcp/internal/same_host.cc" \
    "$root/comm/tcp/internal/socket.cc" \
    "$root/comm/tcp/internal/transport_for_testing.cc" \
    "$root/comm/algorithms/transport.cc" \
    "$root/comm/communicator.cc" \
    "$root/comm/types.cc" \
    "$root/comm/work.cc" \
    "$root/base/logging.cc" \
    "${absl_libs[@]}" -o "$out/tcp_transport_fuzz"
fi

echo "run_libfuzzer: fuzzing for ${seconds}s" >&2
# -max_len: a few frames exercise every branch; the header fields are what the transport must
# distrust. -rss_limit_mb catches an allocation that a hostile length turned into memory.
"$out/tcp_transport_fuzz" \
  -max_total_time="$seconds" \
  -max_len=4096 \
  -rss_limit_mb=2048 \
  -print_final_stats=1 \
  -artifact_prefix="$out/crashes/" \
  "$@" \
  "$out/corpus" "$here/corpus"
