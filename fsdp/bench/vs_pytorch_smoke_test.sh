#!/bin/bash
# vs_pytorch.py at a tiny size, 1 and 2 ranks, every configuration of both sides, on the GPT and
# the MLP: the comparison runs from a clean checkout, and our FSDP (NO_SHARD, FULL_SHARD,
# SHARD_GRAD_OP) and OSS + ShardedDataParallel train to the same losses as PyTorch 1.13's DDP
# (within 1e-5, which the script checks and fails on), from the same weights and batches.
set -euo pipefail
SCRIPT=$1
BINARY=$2
PYTHON=${PYTHON:-/usr/bin/python3}
"$PYTHON" -c "import torch" 2>/dev/null || {
  echo "FAIL: $PYTHON cannot import torch (Debian's python3-torch; ./bazelw installs it)"; exit 1; }
for model in gpt mlp; do
  out=$TEST_TMPDIR/$model.md
  timeout -k 5 600 "$PYTHON" "$SCRIPT" --binary="$BINARY" --model=$model --ranks=1,2 --repeats=1 \
      --warmup=1 --steps=3 --blocks=2 --width=32 --heads=2 --vocab=64 --seq=16 --layers=3 \
      --configs=DDP,NO_SHARD,FULL_SHARD,SHARD_GRAD_OP,ZERO_DDP,OSS_SDP,unwrapped --out="$out"
  # Every configuration at both world sizes, each compared with DDP (unwrapped at 2 ranks is not).
  rows=$(grep -c '^| [12] |' "$out")
  [[ $rows -eq 14 ]] || { cat "$out"; echo "FAIL: $model: $rows rows, want 14"; exit 1; }
  compared=$(grep -E '^\| [12] \|' "$out" | grep -cE '\| [0-9.]+e[-+][0-9]+ \|$')
  [[ $compared -eq 13 ]] || { cat "$out"; echo "FAIL: $model: $compared loss comparisons, want 13"; exit 1; }
  echo "PASS: $model"
done
