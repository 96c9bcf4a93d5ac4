#!/usr/bin/env bash
# The benchmark runs end to end (2 ranks, the small model, one repeat) and prints its table.
set -euo pipefail
out=$(OMP_NUM_THREADS=1 timeout 300 "$1" --models=main --repeats=1 --saves=2 2>&1) ||
  { echo "$out"; exit 1; }
echo "$out"
echo "$out" | grep -qE "^\| main \| 818241 \| [0-9.]+ \| [0-9.]+ \| [0-9.]+ \|" ||
  { echo "no result row for the main model" >&2; exit 1; }
echo PASS
