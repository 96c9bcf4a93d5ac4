#!/usr/bin/env bash
# The main job end to end at 1, 2 and 3 ranks with a small payload.
set -euo pipefail
for n in 1 2 3; do
  out=$(timeout 120 "$1" --ranks=$n --count=40000 2>&1) || { echo "$out"; exit 1; }
  echo "$out" | tail -2
  ok=$(echo "$out" | grep -c "OK: all_reduce" || true)
  [[ "$ok" -eq "$n" ]] || { echo "$out"; echo "expected $n OK lines, got $ok" >&2; exit 1; }
done
