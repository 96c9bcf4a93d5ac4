#!/usr/bin/env bash
# SIGKILL of a random rank of the own loop at a random moment while asynchronous checkpoints are
# written (one every 2 steps), FS_KILL_TRIALS times (default 20): the launcher must end within
# its bound, the newest complete checkpoint must restore, and the resumed run must end with
# parameters bitwise equal to an uninterrupted run's, on every rank.
set -euo pipefail
launch="$1"
loop="$2"
trials="${FS_KILL_TRIALS:-20}"
seed="${FS_KILL_SEED:-$RANDOM}"
RANDOM=$seed
echo "kill test: $trials trials, seed $seed (FS_KILL_SEED=$seed reproduces the schedule)"
tmp="${TEST_TMPDIR:-/tmp}/own_loop_kill_$$"
mkdir -p "$tmp"
args=(--steps=120 --save_every=2 --async=true)
timeout 300 "$launch" --nproc_per_node=2 --master_port=0 -- "$loop" --ckpt="$tmp/straight" \
  "${args[@]}" > "$tmp/straight.txt" 2>&1 || { cat "$tmp/straight.txt"; exit 1; }
want=$(grep -o "rank [01] step 120 param_hash [0-9a-f]*" "$tmp/straight.txt" | sort)
[[ $(echo "$want" | wc -l) -eq 2 ]] || { cat "$tmp/straight.txt"; exit 1; }
resumed_from_checkpoint=0
for trial in $(seq 1 "$trials"); do
  dir="$tmp/trial_$trial"
  "$launch" --nproc_per_node=2 --master_port=0 -- "$loop" --ckpt="$dir" "${args[@]}" \
    > "$tmp/killed_$trial.txt" 2>&1 &
  launcher=$!
  if (( RANDOM % 5 == 0 )); then
    # Early: 0.3 to 2.3 s in, maybe before the first checkpoint.
    sleep "$(( RANDOM % 3 )).$(( RANDOM % 10 ))"
    sleep 0.3
  else
    # Mid-run: after the first complete checkpoint, 0 to 0.99 s later (saves every 2 steps, so
    # one is being snapshotted or written most of the time).
    for _ in $(seq 1 300); do
      ls "$dir"/step_*/COMPLETE > /dev/null 2>&1 && break
      sleep 0.1
    done
    sleep "0.$(( RANDOM % 100 ))"
  fi
  victim_rank=$(( RANDOM % 2 ))
  ranks=($(pgrep -P "$launcher" || true))
  if [[ ${#ranks[@]} -eq 2 ]]; then
    kill -9 "${ranks[$victim_rank]}" 2>/dev/null || true
  fi
  # The launcher notices the dead rank, stops the other and fails, within its stop timeout.
  start=$SECONDS
  wait "$launcher" && status=0 || status=$?
  (( SECONDS - start <= 30 )) ||
    { echo "trial $trial: the launcher took $((SECONDS - start)) s to end" >&2; exit 1; }
  complete=$(ls -d "$dir"/step_*/COMPLETE 2>/dev/null | wc -l || true)
  timeout 300 "$launch" --nproc_per_node=2 --master_port=0 -- "$loop" --ckpt="$dir" \
    "${args[@]}" > "$tmp/resumed_$trial.txt" 2>&1 ||
    { cat "$tmp/killed_$trial.txt" "$tmp/resumed_$trial.txt"; echo "trial $trial: resume failed" >&2; exit 1; }
  got=$(grep -o "rank [01] step 120 param_hash [0-9a-f]*" "$tmp/resumed_$trial.txt" | sort)
  [[ "$got" == "$want" ]] ||
    { cat "$tmp/resumed_$trial.txt"; echo "trial $trial: '$got' != '$want'" >&2; exit 1; }
  from=$(grep -o "rank 0 resumed at step [0-9]*" "$tmp/resumed_$trial.txt" || echo "fresh start")
  [[ "$from" != "fresh start" ]] && resumed_from_checkpoint=$((resumed_from_checkpoint + 1))
  echo "trial $trial: killed rank $victim_rank (launcher status $status, $complete complete checkpoints left): $from, final parameters equal"
  rm -rf "$dir"
done
echo "PASS: $trials trials, $resumed_from_checkpoint resumed from a checkpoint"
