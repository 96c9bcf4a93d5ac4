#!/usr/bin/env bash
# Runs the benchmark on 1 and 2 ranks at a tiny size and checks the table has every row.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --ranks=1,2 --blocks=2 --width=64 --heads=4 --seq=16 --batch=2 --vocab=128 \
  --warmup=1 --steps=2)
echo "$out"
rows=$(echo "$out" | grep -c '^| [12] | \(ddp\|oss\|oss_flat\|sdp\|sdp_flat\|sdp_flat_bf16\) ' || true)
[[ "$rows" -eq 12 ]] || { echo "expected 12 rows, got $rows" >&2; exit 1; }
