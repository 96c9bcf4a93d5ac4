#!/usr/bin/env bash
# Runs the benchmark at 2 ranks on a tiny Gpt and checks the table has the three rows, and that
# LocalSGD moves 1/H of DDP's bytes per step.
set -euo pipefail
export OMP_NUM_THREADS=1
out=$("$1" --ranks=2 --steps=4 --h=2 --repeats=1 --batch=2 --model_size=tiny)
echo "$out"
rows=$(echo "$out" | grep -c '^| 2 | \(ddp\|localsgd\|slowmo (beta 0.5)\) ' || true)
[[ "$rows" -eq 3 ]] || { echo "expected 3 rows, got $rows" >&2; exit 1; }
echo "$out" | grep -q '^| 2 | localsgd | [0-9.]* | [0-9.]* | [0-9]* | 0.500x ' || { echo "localsgd bytes not 1/2 of ddp" >&2; exit 1; }
