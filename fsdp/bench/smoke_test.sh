#!/usr/bin/env bash
# Runs the benchmark on 1 and 2 ranks with 2 blocks and 2 steps and checks the table has every row.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --ranks=1,2 --blocks=2 --width=128 --heads=4 --seq=16 --batch=2 --vocab=256 \
  --warmup=1 --steps=2)
echo "$out"
rows=$(echo "$out" | grep -c '^| [12] | \(unwrapped\|FULL_SHARD\|SHARD_GRAD_OP\|NO_SHARD\) ' || true)
[[ "$rows" -eq 8 ]] || { echo "expected 8 rows, got $rows" >&2; exit 1; }
echo "$out" | grep -q 'FULL_SHARD / NO_SHARD at 2 ranks' || { echo "no summary" >&2; exit 1; }
