# Sourced (not run) by every package's fuzz/run_libfuzzer.sh: builds a libFuzzer target with
# clang's -fsanitize=fuzzer + ASan + UBSan against Debian's shared Abseil (gcc-built; the same
# libstdc++ ABI as clang's) and runs it on one core. A package's script names its sources and
# its run flags, nothing else:
#
#   source "$root/base/libfuzzer.sh"
#   fs_fuzz_init NAME DEFAULT_OUT "$@"        # parses [SECONDS] [extra libFuzzer flags...]
#   fs_fuzz_build SOURCES... [compiler/linker flags...]
#   fs_fuzz_run [-tmpfs] [libFuzzer flags...] -- SEED_DIRS...
#
# Environment: FS_FUZZ_OUT (working corpus under $FS_FUZZ_OUT/corpus, crashes under
# $FS_FUZZ_OUT/crashes, the binary as $FS_FUZZ_OUT/NAME), FS_FUZZ_NO_BUILD=1 (reuse the binary),
# CXX_FUZZ (default clang++). SECONDS 0 with -runs=N runs N executions instead of a time.
# Seed directories in the tree are read, never written. Reproduce a crash with
# $FS_FUZZ_OUT/NAME $FS_FUZZ_OUT/crashes/crash-...
set -euo pipefail

FS_FUZZ_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
FS_FUZZ_ABSL_LIBS=(
  -labsl_statusor -labsl_status -labsl_cord -labsl_cordz_info -labsl_cord_internal
  -labsl_cordz_functions -labsl_cordz_handle -labsl_exponential_biased -labsl_strerror
  -labsl_str_format_internal -labsl_strings -labsl_strings_internal -labsl_int128
  -labsl_time -labsl_civil_time -labsl_time_zone -labsl_synchronization -labsl_stacktrace
  -labsl_symbolize -labsl_debugging_internal -labsl_demangle_internal -labsl_malloc_internal
  -labsl_base -labsl_raw_logging_internal -labsl_throw_delegate -labsl_spinlock_wait
  -labsl_log_severity -pthread
)
# LibTorch's c10 (headers under /usr/include, libc10.so in the multiarch directory).
FS_FUZZ_C10=(-I/usr/include/torch/csrc/api/include -L/usr/lib/x86_64-linux-gnu -lc10)

fs_fuzz_init() {
  FS_FUZZ_NAME="$1"
  FS_FUZZ_DIR="${FS_FUZZ_OUT:-$2}"
  shift 2
  FS_FUZZ_SECONDS="${1:-60}"
  shift || true
  FS_FUZZ_EXTRA=("$@")
  FS_FUZZ_BIN="$FS_FUZZ_DIR/$FS_FUZZ_NAME"
  mkdir -p "$FS_FUZZ_DIR/corpus" "$FS_FUZZ_DIR/crashes"
}

fs_fuzz_build() {
  if [[ -n "${FS_FUZZ_NO_BUILD:-}" && -x "$FS_FUZZ_BIN" ]]; then return; fi
  local cxx="${CXX_FUZZ:-clang++}"
  echo "run_libfuzzer: building $FS_FUZZ_BIN with $cxx" >&2
  "$cxx" -std=c++17 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$FS_FUZZ_ROOT" -I/usr/include "$@" "${FS_FUZZ_ABSL_LIBS[@]}" -o "$FS_FUZZ_BIN"
}

fs_fuzz_run() {
  local tmpfs="" flags=() seeds=()
  if [[ "${1:-}" == "-tmpfs" ]]; then tmpfs=1; shift; fi
  while [[ $# -gt 0 && "$1" != "--" ]]; do flags+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  seeds=("$@")
  local env=()
  if [[ -n "$tmpfs" ]]; then
    # The files the target writes and reads live on tmpfs (a disk directory costs many times
    # the executions).
    FS_FUZZ_SHM="/dev/shm/fs_fuzz_${FS_FUZZ_NAME}_$$"
    mkdir -p "$FS_FUZZ_SHM"
    trap 'rm -rf "$FS_FUZZ_SHM"' EXIT
    env=(TEST_TMPDIR="$FS_FUZZ_SHM")
  fi
  # ASan keeps a stack trace per allocation and a 256 MiB quarantine by default; the targets
  # that allocate per execution spend most of their time there. Shorter allocation traces and a
  # smaller quarantine double their rate; a report still names the access and the free site.
  env=("ASAN_OPTIONS=${ASAN_OPTIONS:-malloc_context_size=2:quarantine_size_mb=32}" "${env[@]}")
  echo "run_libfuzzer: fuzzing $FS_FUZZ_NAME for ${FS_FUZZ_SECONDS}s" >&2
  env "${env[@]}" "$FS_FUZZ_BIN" \
    -max_total_time="$FS_FUZZ_SECONDS" \
    -rss_limit_mb=2048 \
    -print_final_stats=1 \
    -artifact_prefix="$FS_FUZZ_DIR/crashes/" \
    "${flags[@]}" "${FS_FUZZ_EXTRA[@]}" \
    "$FS_FUZZ_DIR/corpus" "${seeds[@]}"
}
