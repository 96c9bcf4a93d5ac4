#!/usr/bin/env bash
# Builds examples/gpt/fuzz/checkpoint_files_fuzz.cc with clang's libFuzzer + ASan + UBSan and
# fuzzes the COMPLETE-marker and metrics.jsonl readers on one core; the files they parse live on
# tmpfs.
#
#   examples/gpt/fuzz/run_libfuzzer.sh [SECONDS] [extra libFuzzer flags...]
#
# The seeds in examples/gpt/fuzz/corpus are read, never written; working corpus and crashes
# under $FS_FUZZ_OUT (default /tmp/fs_ckpt_files_fuzz); see base/libfuzzer.sh.
here="$(cd "$(dirname "$0")" && pwd)"
source "$here/../../../base/libfuzzer.sh"
fs_fuzz_init checkpoint_files_fuzz /tmp/fs_ckpt_files_fuzz "$@"
r="$FS_FUZZ_ROOT"
fs_fuzz_build "$here/checkpoint_files_fuzz.cc" "$r/examples/gpt/checkpoints.cc" \
  "$r/train_state/step_dir.cc" "$r/base/atomic_file.cc" "$r/examples/gpt/metrics_file.cc" "$r/base/fnv1a.cc" \
  "$r/base/json_fields.cc"
fs_fuzz_run -tmpfs -max_len=4096 -- "$here/corpus"
