#!/usr/bin/env bash
# The main job end to end at 1, 2 and 3 ranks with a small payload.
set -euo pipefail
for n in 1 2 3; do
  out=$(timeout 120 "$1" --ranks=$n --count=40000 2>&1) || { echo "$out"; exit 1; }
  echo "$out" | tail -2
  ok=$(echo "$out" | grep -c "OK: all_reduce" || true)
  [[ "$ok" -eq "$n" ]] || { echo "$out"; echo "expected $n OK lines, got $ok" >&2; exit 1; }
done
# torchrun's name for the rank count, and the launch line before any rank's output (stdout is a
# pipe here: the launcher flushes it before spawning).
out=$(timeout 120 "$1" --nproc_per_node=2 --count=4000 2>&1) || { echo "$out"; exit 1; }
launching=$(echo "$out" | grep -n "demo: launching 2 ranks" | cut -d: -f1)
first_ok=$(echo "$out" | grep -n "OK: all_reduce" | head -1 | cut -d: -f1)
[[ -n "$launching" && -n "$first_ok" && "$launching" -lt "$first_ok" ]] ||
  { echo "$out"; echo "expected 'demo: launching 2 ranks' before the ranks' output" >&2; exit 1; }
# Disagreeing spellings are refused before anything is launched.
if out=$(timeout 60 "$1" --ranks=2 --nproc_per_node=3 2>&1); then
  echo "$out"; echo "expected --ranks=2 --nproc_per_node=3 to fail" >&2; exit 1
fi
echo "$out" | grep -q "disagree" || { echo "$out"; exit 1; }
echo "$out" | grep -q "launching" && { echo "$out"; echo "launched anyway" >&2; exit 1; }
echo PASS
