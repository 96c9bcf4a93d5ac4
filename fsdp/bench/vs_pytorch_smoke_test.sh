#!/bin/bash
# vs_pytorch.py at a tiny size, every configuration of both sides (ours over tcp, FULL_SHARD also
# over tcp without same-host copies and over ucx shared memory): the GPT at 1, 2 and 4 ranks,
# the MLP at 1 and 2. The comparison runs from a clean checkout, its report is complete (every
# row, every target line) and can be made again from the saved results (--summarize), and our
# FSDP (NO_SHARD, FULL_SHARD, SHARD_GRAD_OP) and OSS + ShardedDataParallel train to the same
# losses as PyTorch 1.13's DDP within 1e-5 (the script checks it and fails otherwise), from the
# same weights and batches.
set -euo pipefail
SCRIPT=$1
BINARY=$2
PYTHON=${PYTHON:-/usr/bin/python3}
"$PYTHON" -c "import torch" 2>/dev/null || {
  echo "FAIL: $PYTHON cannot import torch (Debian's python3-torch; ./bazelw installs it)"; exit 1; }
CONFIGS=DDP,NO_SHARD,FULL_SHARD,SHARD_GRAD_OP,ZERO_DDP,OSS_SDP,unwrapped,FULL_SHARD@tcp-socket,FULL_SHARD@ucx-shm
TINY=(--repeats=1 --warmup=1 --steps=3 --blocks=2 --width=32 --heads=2 --vocab=64 --seq=16
      --layers=3)
# check MODEL RANKS ROWS COMPARED
check() {
  local model=$1 ranks=$2 want_rows=$3 want_compared=$4 out=$TEST_TMPDIR/$1.md
  timeout -k 5 600 "$PYTHON" "$SCRIPT" --binary="$BINARY" --model="$model" --ranks="$ranks" \
      "${TINY[@]}" --configs=$CONFIGS --out="$out"
  rows=$(grep -c '^| [124] |' "$out")
  [[ $rows -eq $want_rows ]] || { cat "$out"; echo "FAIL: $model: $rows rows, want $want_rows"; exit 1; }
  # A loss comparison with DDP in every row but the unwrapped ones at more than 1 rank.
  compared=$(grep -E '^\| [124] \|' "$out" | grep -cE '\| [0-9.]+e[-+][0-9]+ \|$')
  [[ $compared -eq $want_compared ]] || {
    cat "$out"; echo "FAIL: $model: $compared loss comparisons, want $want_compared"; exit 1; }
  grep -q '^NO_SHARD / DDP at 2 ranks: ' "$out" || { cat "$out"; echo "FAIL: no target lines"; exit 1; }
  "$PYTHON" "$SCRIPT" --summarize="$out.runs.json" "${TINY[@]}" >"$out.again"
  diff "$out" "$out.again" || { echo "FAIL: $model: --summarize gives another report"; exit 1; }
  echo "PASS: $model at $ranks ranks"
}
check gpt 1,2,4 27 25
check mlp 1,2 18 17
