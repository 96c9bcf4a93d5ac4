#!/bin/bash
# bench.sh in CI at its smallest (the tiny model, one 1 Gbit/s link setting, one repeat of 4
# steps): it runs, prints its table, and the traffic across the hosts has the expected shape
# (deterministic, unlike the step times): hybrid_shard sends less than half of full_shard's bytes
# across the hosts (measured 0.37 on the tiny model, 0.40 on the main job's and 0.38 on the 26M
# model) and no_shard less than full_shard (0.70 / 0.60 / 0.57).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export BENCH_RATES=1gbit BENCH_MODELS=tiny BENCH_REPEATS=1 BENCH_STEPS=4
export BENCH_OUT=${TEST_TMPDIR:-$(mktemp -d)}/bench_smoke
bash "$here/bench.sh" "$1" "$2"
table="$BENCH_OUT/table.md"
[[ -s $table ]] || { echo "FAIL: no table"; exit 1; }
ratio() { awk -F'|' -v s="$1" '$4 ~ " " s " " { gsub(/ /, "", $8); print $8 }' "$table"; }
hybrid=$(ratio hybrid_shard) no_shard=$(ratio no_shard)
awk -v h="$hybrid" -v n="$no_shard" 'BEGIN { exit !(h > 0 && h < 0.5 && n > 0 && n < 1) }' ||
  { cat "$table"; echo "FAIL: bytes across the hosts / full_shard's: hybrid $hybrid, no_shard $no_shard"; exit 1; }
echo "PASS: bytes across the hosts / full_shard's: hybrid_shard $hybrid, no_shard $no_shard"
