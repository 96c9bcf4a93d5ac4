#!/usr/bin/env bash
# Builds offload/fuzz/disk_tier_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the
# offload tier's file reader (DiskTier::Open and the chunk reads after it) for N seconds
# (default 60), in one process on one core.
#
#   offload/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#
# The seeds in offload/fuzz/corpus are read but never written: new inputs go to the working
# corpus under $FS_FUZZ_OUT (default /tmp/fs_offload_fuzz), crashes to $FS_FUZZ_OUT/crashes.
# Reproduce a crash with:  $FS_FUZZ_OUT/disk_tier_fuzz $FS_FUZZ_OUT/crashes/crash-...
# A fixed number of executions instead of a time: run_libfuzzer.sh 0 -runs=10000000
# FS_FUZZ_NO_BUILD=1 reuses the binary already in $FS_FUZZ_OUT.
set -euo pipefail

seconds="${1:-60}"
shift || true
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${FS_FUZZ_OUT:-/tmp/fs_offload_fuzz}"
cxx="${CXX_FUZZ:-clang++}"
mkdir -p "$out/corpus" "$out/crashes"

# Debian's Abseil and LibTorch are shared libraries (gcc-built; same libstdc++ ABI as clang's).
# libtorch-dev installs c10's headers under /usr/include and libc10.so in the multiarch dir.
absl_libs=(
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
  -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_strerror
  -labsl_str_format_internal -labsl_strings -labsl_strings_internal -labsl_int128
  -labsl_synchronization -labsl_stacktrace -labsl_symbolize -labsl_debugging_internal
  -labsl_demangle_internal -labsl_malloc_internal -labsl_time -labsl_civil_time
  -labsl_time_zone -labsl_base -labsl_raw_logging_internal -labsl_throw_delegate
  -labsl_spinlock_wait -labsl_log_severity -pthread
)
torch_libs=(-L/usr/lib/x86_64-linux-gnu -lc10)

if [[ -z "${FS_FUZZ_NO_BUILD:-}" ]]; then
  echo "run_libfuzzer: building $out/disk_tier_fuzz with $cxx" >&2
  "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root" -I/usr/include -I/usr/include/torch/csrc/api/include \
    "$here/disk_tier_fuzz.cc" \
    "$root/offload/disk_tier.cc" \
    "$root/offload/tier.cc" \
    "$root/base/fnv1a.cc" \
    "${absl_libs[@]}" "${torch_libs[@]}" -o "$out/disk_tier_fuzz"
fi

# The fuzzed file lives on tmpfs: every execution writes, opens and reads it.
shm="/dev/shm/fs_offload_fuzz_$$"
mkdir -p "$shm"
trap 'rm -rf "$shm"' EXIT

echo "run_libfuzzer: fuzzing for ${seconds}s" >&2
# -max_len: the seeds are 4-8 KiB (a 4096-byte header, the table 4096-aligned, then the data).
# -malloc_limit_mb: every allocation Open() makes is bounded by the file (at most 16 KiB here)
# or by the expected tensors (a few hundred bytes); 16 MiB is far beyond both, and a hostile
# header that once sized a 64 MiB layout buffer trips it.
TEST_TMPDIR="$shm" "$out/disk_tier_fuzz" \
  -max_total_time="$seconds" \
  -max_len=16384 \
  -rss_limit_mb=2048 \
  -malloc_limit_mb=16 \
  -print_final_stats=1 \
  -artifact_prefix="$out/crashes/" \
  "$@" \
  "$out/corpus" "$here/corpus"
