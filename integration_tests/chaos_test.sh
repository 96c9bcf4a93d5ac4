#!/bin/bash
# Chaos: a seeded random loop of faults against the main job under fs_launch (tcp, 127.0.0.1).
# Each trial picks a world size (2 or 4), a rank and one fault:
#   kill   the rank SIGKILLs itself after a random step (--fault_kill=R:S)
#   save   the rank SIGKILLs itself inside a random checkpoint save, after its files are written
#          and before COMPLETE (--fault_kill=R:S:save)
#   sigkill  this script SIGKILLs the rank at a random moment (startup included)
#   sigstop  this script SIGSTOPs the rank at a random moment and leaves it stopped
# with checkpoints saved synchronously or, in half the trials, in the background
# (--async_checkpoint: then a save fault kills the rank in the save's background thread while
# training goes on), and asserts:
#   - no hang: the faulted job ends within BOUND_S seconds (from its start; it runs under
#     `timeout` so a hang fails the trial instead of the whole test's deadline);
#   - its exit status is the fault's (137 SIGKILL, 147 a rank stopped > --stopped_timeout_s);
#   - fs_launch's "job failed" line names the faulted rank;
#   - the newest COMPLETE checkpoint (if any) is intact: every file it lists has its size and
#     FNV-1a 64 checksum;
#   - `--resume=auto` then resumes at exactly that step (its resume record's full-parameter hash
#     equals the one COMPLETE's metadata recorded), runs to the end, and ends with the final parameters
#     (param_fnv1a64 of every rank) of an uninterrupted run of the same world size, bitwise.
#
# Environment: FS_CHAOS_TRIALS (default 20), FS_CHAOS_SEED (default: random, printed; rerun a
# failure with the printed seed), FS_CHAOS_BOUND_S (default 30).
# FS_CHAOS_KEEP=1 keeps every trial's output. Soak mode (README, "Chaos and soak"):
#   ./bazelw test //integration_tests:chaos_test --test_env=FS_CHAOS_TRIALS=100 \
#       --test_timeout=3600 --test_output=streamed --nocache_test_results
source "$(dirname "$0")/lib.sh" "$@"

TRIALS=${FS_CHAOS_TRIALS:-20}
SEED=${FS_CHAOS_SEED:-$(( $(od -An -N2 -tu2 /dev/urandom) ))}
BOUND_S=${FS_CHAOS_BOUND_S:-30}
HANG_S=$(( BOUND_S * 3 ))  # the `timeout` of one run: past BOUND_S it is a failure anyway
STEPS=30
EVERY=5
RANDOM=$SEED
echo "chaos: seed $SEED, $TRIALS trials, bound ${BOUND_S}s (FS_CHAOS_SEED=$SEED reproduces)"

# A smaller model than lib.sh's TINY (later flags win): a run is mostly process start-up.
JOB=(--width=16 --blocks=1 --heads=2 --seq=16 --batch=4 --log_every=1 --eval_every=100
     --steps=$STEPS --checkpoint_every=$EVERY --keep_checkpoints=2 --strategy=full_shard
     --precision=bf16 --resume=auto)

# start NAME NPROC [train_gpt flags]: starts the job in the background (PID: `timeout`'s pid).
start() {
  local name=$1 nproc=$2; shift 2
  timeout -k 5 "$HANG_S" "$FS_LAUNCH" --nproc_per_node="$nproc" --master_port=0 \
      --stop_timeout_s=5 --stopped_timeout_s=2 -- "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" \
      --out_dir="$WORK/$name" "$@" >"$WORK/$name.log" 2>&1 &
  PID=$!
}
# finish: waits for the job started last; sets STATUS (124, or 137 at HANG_S: `timeout` ended it).
finish() {
  STATUS=0
  wait "$PID" || STATUS=$?
}
now_ms() { date +%s%3N; }

# rank_pid NAME RANK: the pid of that rank of the running job, waiting up to 20 s for it.
rank_pid() {
  local rank=$1 launcher="" p i
  for (( i = 0; i < 400; i++ )); do
    launcher=${launcher:-$(pgrep -P "$PID" | head -1 || true)}
    if [[ -n $launcher ]]; then
      for p in $(pgrep -P "$launcher" || true); do
        if tr '\0' '\n' <"/proc/$p/environ" 2>/dev/null | grep -qx "RANK=$rank"; then
          echo "$p"; return 0
        fi
      done
    fi
    sleep 0.05
  done
  return 1
}
proc_state() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null || echo gone; }

# newest_complete NAME: the step of the newest COMPLETE checkpoint, or 0.
newest_complete() {
  local d
  d=$(ls -d "$WORK/$1"/checkpoints/step_*/COMPLETE 2>/dev/null | sort | tail -1 || true)
  [[ -n $d ]] || { echo 0; return; }
  d=${d%/COMPLETE}
  echo $(( 10#${d##*step_} ))
}
# intact DIR: every file of every item COMPLETE lists (<item>/<file>) has its recorded size and
# FNV-1a 64, computed here independently of the library.
intact() {
  python3 - "$1" <<'EOF'
import json, os, sys
d = sys.argv[1]
c = json.load(open(os.path.join(d, "COMPLETE")))
assert c["format"] == "fairscale.train_state.v1", c["format"]
n = 0
for item, entry in c["items"].items():
    for f in entry["files"]:
        path = os.path.join(d, item, f["name"])
        data = open(path, "rb").read()
        h = 0xcbf29ce484222325
        for b in data:
            h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
        if len(data) != f["bytes"] or "%016x" % h != f["fnv1a64"]:
            sys.exit("%s: %d bytes fnv1a64 %016x, COMPLETE says %d %s"
                     % (path, len(data), h, f["bytes"], f["fnv1a64"]))
        n += 1
if n == 0:
    sys.exit("%s/COMPLETE lists no files" % d)
EOF
}

# Reference: an uninterrupted run per world size, and how long one takes (for the stop times).
declare -A WANT REF_MS
for n in 2 4; do
  t0=$(now_ms)
  start "ref$n" "$n"; finish
  [[ $STATUS -eq 0 ]] || { cat "$WORK/ref$n.log"; fail "uninterrupted $n-rank run exited with $STATUS"; }
  REF_MS[$n]=$(( $(now_ms) - t0 ))
  WANT[$n]=$(final_field "ref$n" param_fnv1a64)
  echo "reference: $n ranks in ${REF_MS[$n]} ms, param_fnv1a64 ${WANT[$n]}"
done

FAULTS=(kill save sigkill sigstop)
hangs=0 max_end_ms=0 max_after_ms=0 missed=0 test_t0=$(now_ms)
declare -A COUNT
for (( trial = 1; trial <= TRIALS; trial++ )); do
  n=$(( RANDOM % 2 ? 4 : 2 ))
  rank=$(( RANDOM % n ))
  fault=${FAULTS[RANDOM % ${#FAULTS[@]}]}
  name="t$trial"
  flags=() what="" fault_ms="" mode="sync" save_flags=()
  if (( RANDOM % 2 )); then save_flags=(--async_checkpoint) mode="async"; fi
  case $fault in
    kill) step=$(( 1 + RANDOM % (STEPS - 1) )); flags=(--fault_kill=$rank:$step)
          what="rank $rank SIGKILLs itself after step $step" ;;
    save) step=$(( EVERY * (1 + RANDOM % (STEPS / EVERY)) )); flags=(--fault_kill=$rank:$step:save)
          what="rank $rank SIGKILLs itself inside the save of step $step" ;;
    *) # Half of them at a random moment from the start (mostly start-up and rendezvous: a
       # run is mostly that), half when rank 0 logs a random step (training, saves).
       if (( RANDOM % 2 )); then
         delay_ms=$(( RANDOM % (REF_MS[$n] / 2) )) at_step=""
         what="rank $rank gets SIG${fault#sig} ${delay_ms} ms after its start"
       else
         delay_ms=0 at_step=$(( 1 + RANDOM % (STEPS - 2) ))
         what="rank $rank gets SIG${fault#sig} when rank 0 logs step $at_step"
       fi
       what=${what/SIGkill/SIGKILL} what=${what/SIGstop/SIGSTOP} ;;
  esac
  t0=$(now_ms)
  start "$name" "$n" ${save_flags[@]+"${save_flags[@]}"} ${flags[@]+"${flags[@]}"}
  expect=137
  if [[ $fault == sig* ]]; then
    pid=$(rank_pid "$rank") || { kill -KILL "$PID" 2>/dev/null || true; fail "trial $trial: rank $rank never started"; }
    sleep "$(printf '%d.%03d' $(( delay_ms / 1000 )) $(( delay_ms % 1000 )))"
    if [[ -n $at_step ]]; then
      for (( i = 0; i < 2000; i++ )); do
        grep -Eq "step +$at_step/$STEPS " "$WORK/$name.log" && break
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.01
      done
    fi
    # Stop first and check that it took (a rank that already exited cannot be faulted): a
    # stopped process cannot exit, so then the fault is certain to land.
    kill -STOP "$pid" 2>/dev/null || true
    for (( i = 0; i < 200; i++ )); do
      state=$(proc_state "$pid")
      [[ $state == [TZ] || $state == gone ]] && break
      sleep 0.01
    done
    if [[ $state != T ]]; then
      missed=$(( missed + 1 )) expect=0 what="$what: missed, the rank had exited"
    elif [[ $fault == sigkill ]]; then
      kill -KILL "$pid"; expect=137 fault_ms=$(now_ms)
    else
      expect=147 fault_ms=$(now_ms)
    fi
  fi
  finish
  fstatus=$STATUS done_ms=$(now_ms)
  end_ms=$(( done_ms - t0 ))
  (( end_ms > max_end_ms )) && max_end_ms=$end_ms
  after=""
  if [[ -n $fault_ms ]]; then
    after=" ($(( done_ms - fault_ms )) ms after the signal)"
    (( done_ms - fault_ms > max_after_ms )) && max_after_ms=$(( done_ms - fault_ms ))
  fi
  log="$WORK/$name.log"
  if [[ $STATUS -eq 124 || ( $STATUS -eq 137 && $end_ms -ge $(( HANG_S * 1000 )) ) ]]; then
    hangs=$(( hangs + 1 ))
    cat "$log"; fail "trial $trial ($n ranks, $what; seed $SEED): HANG, still running after ${HANG_S}s"
  fi
  (( end_ms <= BOUND_S * 1000 )) ||
    { cat "$log"; fail "trial $trial ($n ranks, $what; seed $SEED): ended after ${end_ms} ms > ${BOUND_S}s"; }
  [[ $STATUS -eq $expect ]] ||
    { cat "$log"; fail "trial $trial ($n ranks, $what; seed $SEED): exit status $STATUS, want $expect"; }
  if [[ $expect -ne 0 ]]; then
    grep -q "fs_launch: job failed: rank $rank " "$log" ||
      { cat "$log"; fail "trial $trial ($n ranks, $what; seed $SEED): the job-failed line does not name rank $rank"; }
  fi

  # The newest complete checkpoint is intact, and --resume continues from it bitwise.
  ckpt=$(newest_complete "$name")
  if (( ckpt > 0 )); then
    dir=$(printf '%s/%s/checkpoints/step_%08d' "$WORK" "$name" "$ckpt")
    intact "$dir" || fail "trial $trial ($n ranks, $what; seed $SEED): checkpoint of step $ckpt damaged"
    saved=$(jq -r .metadata.full_param_fnv1a64 "$dir/COMPLETE")
  fi
  cp "$log" "$log.fault"
  start "$name" "$n" ${save_flags[@]+"${save_flags[@]}"}; finish
  [[ $STATUS -eq 0 ]] ||
    { cat "$log.fault" "$log"; fail "trial $trial ($n ranks, $what; seed $SEED): resumed run exited with $STATUS"; }
  if (( ckpt > 0 && ckpt < STEPS )); then
    grep -Eq "resumed at step $ckpt([^0-9]|$)" "$log" ||
      { cat "$log"; fail "trial $trial: the resumed run did not resume at step $ckpt (newest COMPLETE)"; }
    resumed=$(jq -r 'select(.type == "resume") | .full_param_fnv1a64' "$WORK/$name/metrics.jsonl" | tail -1)
    [[ $resumed == "$saved" ]] ||
      fail "trial $trial: full parameters at resume $resumed, COMPLETE of step $ckpt says $saved"
  fi
  got=$(final_field "$name" param_fnv1a64)
  [[ $got == "${WANT[$n]}" ]] ||
    { cat "$log.fault" "$log"; fail "trial $trial ($n ranks, $what; seed $SEED): final parameters $got, uninterrupted ${WANT[$n]}"; }
  COUNT[$fault]=$(( ${COUNT[$fault]:-0} + 1 )) COUNT[$mode]=$(( ${COUNT[$mode]:-0} + 1 ))
  echo "trial $trial/$TRIALS: $n ranks, $mode saves, $what: status $fstatus after ${end_ms} ms$after," \
       "newest complete checkpoint step $ckpt, resumed run equal"
  [[ -n ${FS_CHAOS_KEEP:-} ]] || rm -rf "$WORK/$name" "$log" "$log.fault"
done
total_s=$(( ($(now_ms) - test_t0) / 1000 ))
echo "chaos summary: seed $SEED, trials $TRIALS (kill ${COUNT[kill]:-0}, save ${COUNT[save]:-0}," \
     "sigkill ${COUNT[sigkill]:-0}, sigstop ${COUNT[sigstop]:-0}; async saves ${COUNT[async]:-0};" \
     "missed $missed), hangs $hangs," \
     "max end time ${max_end_ms} ms from start (bound ${BOUND_S}s), max ${max_after_ms} ms" \
     "from an outside signal to the end, ${total_s}s in the loop"
pass "chaos: $TRIALS trials, hangs=0"
