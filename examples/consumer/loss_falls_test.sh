#!/usr/bin/env bash
# Launches each example on 2 ranks with fs_launch and checks that rank 0's loss fell by 4x.
set -euo pipefail
launcher=$1
shift
train_fsdp=$1
for program in "$@"; do
  name=$(basename "$program")
  out=$(timeout -k 5 120 "$launcher" --nproc_per_node=2 --master_port=0 -- "$program" 2>&1) || {
    echo "$out"
    echo "FAIL: $name under fs_launch exited non-zero"
    exit 1
  }
  echo "$out"
  first=$(echo "$out" | sed -nE 's/.*step 1 loss ([0-9.]+).*/\1/p' | head -1)
  last=$(echo "$out" | sed -nE 's/.*step 100 loss ([0-9.]+).*/\1/p' | head -1)
  [[ -n $first && -n $last ]] || { echo "FAIL: $name printed no step 1 / step 100 loss"; exit 1; }
  if ! awk -v a="$first" -v b="$last" 'BEGIN { exit !(b < a / 4) }'; then
    echo "FAIL: $name loss went from $first to $last (expected below a quarter)"
    exit 1
  fi
  echo "PASS: $name on 2 ranks: loss $first -> $last"
done
# train_fsdp with checkpoints (train_state, asynchronous): a run saves steps 50 and 100; a second
# run in the same directory resumes at step 100 and has nothing left to train.
ckpt="${TEST_TMPDIR:-/tmp}/consumer_ckpt_$$"
for run in first second; do
  out=$(CKPT_DIR="$ckpt" timeout -k 5 120 "$launcher" --nproc_per_node=2 --master_port=0 -- \
        "$train_fsdp" 2>&1) || { echo "$out"; echo "FAIL: train_fsdp with CKPT_DIR ($run run)"; exit 1; }
  echo "$out" | tail -3
done
echo "$out" | grep -q "resumed at step 100" ||
  { echo "$out"; echo "FAIL: the second run did not resume at step 100"; exit 1; }
[[ -d "$ckpt/step_00000100" && -f "$ckpt/step_00000100/COMPLETE" ]] ||
  { ls -R "$ckpt"; echo "FAIL: no complete checkpoint of step 100"; exit 1; }
echo "PASS: train_fsdp checkpoints with train_state and resumes"
