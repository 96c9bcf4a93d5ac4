#!/usr/bin/env bash
# Runs the benchmark at 2 stages at a tiny size and checks the table has every row.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --stages=2 --chunks=1,2 --blocks=2 --width=16 --hidden=32 --batch=4 --warmup=1 \
  --steps=1)
echo "$out"
rows=$(echo "$out" | grep -c '^| 2 | \(gpipe\|1f1b\) | [12] ' || true)
[[ "$rows" -eq 4 ]] || { echo "expected 4 rows, got $rows" >&2; exit 1; }
