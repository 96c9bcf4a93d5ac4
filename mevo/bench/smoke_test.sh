#!/usr/bin/env bash
# Runs the benchmark at a tiny size and checks the table has its rows and the load line.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --tokens=24 --dim=8 --vocab=100,37 --tiles=8x16,5x7 --repeats=1 --warmup=1)
echo "$out"
for row in 'V = 100' 'V = 37' '| plain |' '| MEVO 8 x 16 |' '| MEVO 5 x 7 |' 'loadavg before:'; do
  echo "$out" | grep -qF -- "$row" || { echo "missing: $row" >&2; exit 1; }
done
# MEVO's gradients match plain's (the last column) to f32 precision.
echo "$out" | awk -F'|' '/\| MEVO/ { if ($10 + 0 > 1e-5) { print "gradient error " $10 > "/dev/stderr"; exit 1 } }'
