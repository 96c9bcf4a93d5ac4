#!/usr/bin/env bash
# Builds pipe/fuzz/wire_fuzz.cc with clang's libFuzzer + ASan + UBSan and fuzzes the bytes //pipe
# receives from other ranks (a boundary's activation header and layout, the skip declarations)
# on one core.
#
#   pipe/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#   pipe/fuzz/run_libfuzzer.sh 0 -runs=10000000
#
# The seeds in pipe/fuzz/corpus are read, never written; working corpus and crashes under
# $FS_FUZZ_OUT (default /tmp/fs_pipe_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../base/libfuzzer.sh"
fs_fuzz_init wire_fuzz /tmp/fs_pipe_fuzz "$@"
fs_fuzz_build "$here/wire_fuzz.cc" "$FS_FUZZ_ROOT/pipe/internal/boundary_layout.cc" \
  "$FS_FUZZ_ROOT/pipe/internal/skip_declarations.cc" "$FS_FUZZ_ROOT/pipe/skip_id.cc" \
  "${FS_FUZZ_C10[@]}"
# -max_len: the seeds are under 400 bytes; 4 KiB leaves room for layouts of dozens of tensors
# and declarations of dozens of layers. -malloc_limit_mb: the decoders allocate at most a few
# times the input (4 KiB); a count or size field that turned into a large allocation trips it.
fs_fuzz_run -max_len=4096 -malloc_limit_mb=16 -- "$here/corpus"
