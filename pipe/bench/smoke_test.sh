#!/usr/bin/env bash
# Runs the benchmark at 2 stages at a tiny size and checks the table has every row: GPipe and
# 1F1B at m = 1, 2, interleaved 1F1B with 2 virtual stages at m = 2 (m = 1 is not a multiple of 2).
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --stages=2 --chunks=1,2 --virtual_stages=2 --blocks=4 --width=16 --hidden=32 \
  --batch=4 --warmup=1 --steps=1)
echo "$out"
rows=$(echo "$out" | grep -c '^| 2 | \(gpipe\|1f1b\|interleaved v=2\) | [12] ' || true)
[[ "$rows" -eq 5 ]] || { echo "expected 5 rows, got $rows" >&2; exit 1; }
