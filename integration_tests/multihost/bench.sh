#!/bin/bash
# Inter-host traffic and step time of the main job's sharding strategies across 2 emulated hosts
# x 2 ranks (hosts.sh), the link between them shaped: FULL_SHARD (every unit sharded over all 4
# ranks), HYBRID_SHARD (sharded inside each host, gradients all-reduced across the hosts:
# --strategy=hybrid_shard, groups by host name) and NO_SHARD (DDP-style: replicated, gradients
# all-reduced over all 4 ranks).
#
#   integration_tests/multihost/bench.sh FS_LAUNCH TRAIN_GPT      (as root; see README.md)
#
# Environment (defaults in brackets):
#   BENCH_RATES       link rates, tc units                      ["1gbit 100mbit"]
#   BENCH_DELAY_MS    one-way delay added on host1's link (netdelay; needs MH_NETDELAY) [0]
#   BENCH_MODELS      "main" (train_gpt's defaults: width 128, 4 blocks) and/or "large"
#                     (width 512, 8 blocks, 8 heads: 25.9M parameters)       ["main large"]
#   BENCH_STRATEGIES                                            ["full_shard hybrid_shard no_shard"]
#   BENCH_REPEATS     interleaved repeats; medians are reported [3]
#   BENCH_STEPS       optimizer steps per run; the step time is the median of steps 2.. [6]
#   BENCH_OUT         where the runs and the table go           [$TEST_TMPDIR or a temp dir]
# Bytes crossing the boundary: host0's plus host1's eth0 tx counters over the run (every byte a
# host sends leaves it: with 2 hosts all of it crosses), per step (the rendezvous, a few KB, is
# included). Prints a Markdown table and the load average before and after.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
FS_LAUNCH=$(readlink -f "$1")
TRAIN_GPT=$(readlink -f "$2")
source "$here/hosts.sh"

RATES=${BENCH_RATES:-1gbit 100mbit}
DELAY_MS=${BENCH_DELAY_MS:-0}
MODELS=${BENCH_MODELS:-main large}
STRATEGIES=${BENCH_STRATEGIES:-full_shard hybrid_shard no_shard}
REPEATS=${BENCH_REPEATS:-3}
STEPS=${BENCH_STEPS:-6}
OUT=${BENCH_OUT:-${TEST_TMPDIR:-$(mktemp -d)}/mh_bench}
rm -rf "$OUT" && mkdir -p "$OUT"
export OMP_NUM_THREADS=1
export FS_STORE_TOKEN=${FS_STORE_TOKEN:-$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')}

model_flags() {
  case $1 in
    main) echo "--width=128 --blocks=4 --heads=4 --seq=64 --batch=16" ;;
    large) echo "--width=512 --blocks=8 --heads=8 --seq=64 --batch=4" ;;
    tiny) echo "--width=32 --blocks=2 --heads=2 --seq=32 --batch=8" ;;
    *) echo "bench: unknown model '$1' (main, large, tiny)" >&2; exit 2 ;;
  esac
}

mh_require_netadmin
mh_create 2
[[ $DELAY_MS -eq 0 ]] || mh_delay 1 "$DELAY_MS"
echo "bench: load average before: $(cut -d' ' -f1-3 /proc/loadavg) ($(getconf _NPROCESSORS_ONLN) cores)"

# run NAME MODEL STRATEGY: 2 hosts x 2 ranks; prints "<step_s median> <bytes per step>".
run() {
  local name=$1 model=$2 strategy=$3 port k pids=()
  port=$(( 29700 + RANDOM % 200 ))
  local before=$(( $(mh_tx_bytes 0) + $(mh_tx_bytes 1) ))
  for k in 0 1; do
    # shellcheck disable=SC2046
    mh_fs_launch "$k" "$port" 900 --nproc_per_node=2 -- "$TRAIN_GPT" $(model_flags "$model") \
      --strategy="$strategy" --precision=fp32 --steps="$STEPS" --eval_every=100000 \
      --eval_batches=1 --sample_tokens=0 --threads=1 --checkpoint_dir=none \
      --out_dir="$OUT/$name/n$k" >"$OUT/$name/n$k.log" 2>&1 &
    pids+=($!)
  done
  local st=0 p
  for p in "${pids[@]}"; do wait "$p" || st=$?; done
  [[ $st -eq 0 ]] || { tail -n 20 "$OUT/$name"/n*.log >&2; echo "bench: $name failed ($st)" >&2; exit 1; }
  local after=$(( $(mh_tx_bytes 0) + $(mh_tx_bytes 1) ))
  local step_s
  step_s=$(jq -r 'select(.type == "train" and .step > 1) | .step_s' "$OUT/$name/n0/metrics.jsonl" |
           sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }')
  echo "$step_s $(( (after - before) / STEPS ))"
}

declare -A STEP BYTES
for (( r = 1; r <= REPEATS; r++ )); do
  for rate in $RATES; do
    mh_shape 0 rate="$rate"
    mh_shape 1 rate="$rate"
    for model in $MODELS; do
      for strategy in $STRATEGIES; do
        name="r${r}_${rate}_${model}_${strategy}"
        mkdir -p "$OUT/$name"
        s="" b=""
        read -r s b < <(run "$name" "$model" "$strategy") || true
        [[ -n $s && -n $b ]] || { echo "bench: $name gave no result" >&2; exit 1; }
        STEP[$rate,$model,$strategy]+="$s "
        BYTES[$rate,$model,$strategy]+="$b "
        echo "bench: repeat $r, $rate, $model, $strategy: step ${s}s, $(( b / 1000 )) KB/step across the hosts"
      done
    done
  done
done

median() { tr ' ' '\n' | grep -v '^$' | sort -g |
  awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

{
  echo "| link | model | strategy | step time (s) | MB/step across hosts | step time / full_shard | bytes / full_shard |"
  echo "|---|---|---|---|---|---|---|"
  for rate in $RATES; do
    for model in $MODELS; do
      full_s=$(echo "${STEP[$rate,$model,full_shard]:-}" | median)
      full_b=$(echo "${BYTES[$rate,$model,full_shard]:-}" | median)
      for strategy in $STRATEGIES; do
        s=$(echo "${STEP[$rate,$model,$strategy]}" | median)
        b=$(echo "${BYTES[$rate,$model,$strategy]}" | median)
        awk -v rate="$rate" -v d="$DELAY_MS" -v m="$model" -v st="$strategy" -v s="$s" -v b="$b" \
            -v fs="$full_s" -v fb="$full_b" 'BEGIN {
          link = rate (d > 0 ? " + " d " ms" : "")
          rs = (fs > 0) ? sprintf("%.2f", s / fs) : "-"; rb = (fb > 0) ? sprintf("%.2f", b / fb) : "-"
          printf "| %s | %s | %s | %.3f | %.2f | %s | %s |\n", link, m, st, s, b / 1e6, rs, rb }'
      done
    done
  done
} | tee "$OUT/table.md"
echo "bench: load average after: $(cut -d' ' -f1-3 /proc/loadavg); medians over $REPEATS interleaved repeats; runs in $OUT"
