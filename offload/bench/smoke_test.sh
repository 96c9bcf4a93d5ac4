#!/usr/bin/env bash
# Runs the benchmark at a tiny size and checks the table has its rows.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --blocks=2 --width=32 --heads=2 --seq=8 --batch=2 --vocab=64 --warmup=1 --steps=1 \
  --rounds=1 --microbatches=2 --chunk_bytes=4096 --dir="${TEST_TMPDIR:-/tmp}/offload_bench")
echo "$out"
for row in '| in memory, torch Adam |' '| in memory, OffloadedAdam' '| OffloadModel, 1 module per slice |' \
  '| OffloadModel, 1 module per slice, checkpoint_activation |'; do
  echo "$out" | grep -qF -- "$row" || { echo "missing: $row" >&2; exit 1; }
done
