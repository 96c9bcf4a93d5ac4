#!/usr/bin/env bash
# Runs every configuration once at a tiny size and checks the table has every row, and that the
# measured bytes of TP's all-reduces and FSDP's all-gathers equal the theory column.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --repeats=1 --warmup=1 --steps=1 --blocks=2 --width=32 --heads=4 --seq=8 \
  --vocab=64 --batch=2 --experts=4)
echo "$out"
for c in dense_1 dense_1_2t tp_2 fsdp_2 moe_1 dense_2 moe_2; do
  echo "$out" | grep -q "^| $c | " || { echo "no row for $c" >&2; exit 1; }
done
echo "$out" | grep -q 'loadavg before: ' || { echo "no load line" >&2; exit 1; }
checks=$(echo "$out" | grep -c '^check .*: equal$' || true)
[[ "$checks" -eq 6 ]] || { echo "expected 6 byte checks equal, got $checks" >&2; exit 1; }
