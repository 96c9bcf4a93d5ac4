#!/usr/bin/env bash
# Runs the benchmark at a tiny size and checks the table has its rows and the target line.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --blocks=2 --width=32 --heads=2 --seq=8 --batch=2 --vocab=64 --warmup=1 --steps=1 --rounds=1)
echo "$out"
for row in '| none |' '| 1 in 2 |' '| every block |' '| block1 |' 'every block checkpointed:'; do
  echo "$out" | grep -qF -- "$row" || { echo "missing: $row" >&2; exit 1; }
done
