#!/usr/bin/env bash
# The README's own loop at 2 ranks: a run that crashes after step 12 (its newest complete
# checkpoint: step 10) and is started again ends with parameters bitwise equal to an
# uninterrupted run's, on every rank, with sync and with async checkpoints.
set -euo pipefail
launch="$1"
loop="$2"
readme="$3"
source_file="$4"
# The README's listing is this file.
if ! diff <(sed -n '/<!-- begin example\/own_loop.cc -->/,/<!-- end example\/own_loop.cc -->/p' \
              "$readme" | sed '1,2d;$d' | sed '$d') "$source_file" > /dev/null; then
  echo "train_state/README.md's listing differs from example/own_loop.cc" >&2
  exit 1
fi
tmp="${TEST_TMPDIR:-/tmp}/own_loop_$$"
mkdir -p "$tmp"
run() { timeout 300 "$launch" --nproc_per_node=2 --master_port=0 -- "$loop" "$@"; }
for async in true false; do
  run --ckpt="$tmp/straight_$async" --steps=30 --async=$async > "$tmp/straight_$async.txt" 2>&1 ||
    { cat "$tmp/straight_$async.txt"; exit 1; }
  if run --ckpt="$tmp/crash_$async" --steps=30 --die_after=12 --async=$async \
      > "$tmp/crash1_$async.txt" 2>&1; then
    cat "$tmp/crash1_$async.txt"; echo "the crashing run succeeded" >&2; exit 1
  fi
  run --ckpt="$tmp/crash_$async" --steps=30 --async=$async > "$tmp/crash2_$async.txt" 2>&1 ||
    { cat "$tmp/crash2_$async.txt"; exit 1; }
  grep -q "rank 0 resumed at step 10" "$tmp/crash2_$async.txt" ||
    { cat "$tmp/crash2_$async.txt"; echo "did not resume at step 10" >&2; exit 1; }
  for r in 0 1; do
    want=$(grep -o "rank $r step 30 param_hash [0-9a-f]*" "$tmp/straight_$async.txt")
    got=$(grep -o "rank $r step 30 param_hash [0-9a-f]*" "$tmp/crash2_$async.txt")
    [[ -n "$want" && "$want" == "$got" ]] ||
      { echo "async=$async rank $r: uninterrupted '$want', resumed '$got'" >&2; exit 1; }
    echo "async=$async: $got (equal to the uninterrupted run)"
  done
done
echo PASS
