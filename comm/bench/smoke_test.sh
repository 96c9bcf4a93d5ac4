#!/usr/bin/env bash
# Runs the benchmark at tiny sizes on 2 and 3 ranks and checks the table has every row.
set -euo pipefail
out=$("$1" --ranks=2,3 --min_bytes=4 --max_bytes=4096 --rounds=1 --bytes_per_round=4096)
echo "$out"
rows=$(echo "$out" | grep -c '^| \(all_reduce\|reduce_scatter\|all_gather\|broadcast\) ' || true)
# 6 sizes (4 B .. 4 KiB, x4 steps) x 4 ops x 2 world sizes (at 2 and 3 ranks no two sizes round
# to the same reduce_scatter / all_gather buffer; at 4 ranks 4 B and 16 B would, and one is kept).
[[ "$rows" -eq 48 ]] || { echo "expected 48 rows, got $rows" >&2; exit 1; }
