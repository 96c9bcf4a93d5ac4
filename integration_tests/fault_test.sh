#!/bin/bash
# Fault tolerance under fs_launch (2 ranks, tcp):
# 1. rank 1 SIGKILLs itself after step 12: the job stops within seconds (no hang) with rank 1's
#    status (137) and a line naming rank 1, and rank 0 ends with an error naming its peer;
# 2. the same with --max_restarts=1: the job restarts from the last complete checkpoint
#    (step 10) and ends with exactly the parameters and losses of an uninterrupted run;
# 3. rank 1 is SIGKILLed in the middle of the checkpoint save of step 15 (its files written,
#    COMPLETE not yet): the step-10 checkpoint stays intact, and a resumed run loads it and
#    again ends with the uninterrupted run's parameters.
source "$(dirname "$0")/lib.sh" "$@"
JOB=(--steps=20 --checkpoint_every=5 --strategy=full_shard --precision=bf16 --resume=auto)

launch whole 2 -- "${JOB[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/whole.log"; fail "uninterrupted run exited with $STATUS"; }
want=$(final_field whole param_fnv1a64)

start=$(date +%s)
launch killed 2 -- "${JOB[@]}" --fault_kill=1:12
took=$(( $(date +%s) - start ))
[[ $STATUS -eq 137 ]] || { cat "$WORK/killed.log"; fail "killed job exited with $STATUS, want 137"; }
grep -q "rank 1" "$WORK/killed.log" || fail "no message names rank 1"
(( took < 60 )) || fail "the killed job took ${took}s to stop"
pass "kill: job stopped with status 137 in ${took}s: $(grep -m1 'job failed' "$WORK/killed.log")"

launch restarted 2 --max_restarts=1 -- "${JOB[@]}" --fault_kill=1:12
[[ $STATUS -eq 0 ]] || { cat "$WORK/restarted.log"; fail "restarted job exited with $STATUS"; }
got=$(final_field restarted param_fnv1a64)
[[ "$got" == "$want" ]] || fail "after a restart the parameters are $got, uninterrupted $want"
diff <(losses whole) <(losses restarted | sort -n -u) || fail "losses differ after the restart"
pass "kill + restart: parameters equal the uninterrupted run ($got)"

launch save 2 -- "${JOB[@]}" --fault_kill=1:15:save
[[ $STATUS -eq 137 ]] || { cat "$WORK/save.log"; fail "kill during save: status $STATUS"; }
[[ -f "$WORK/save/checkpoints/step_00000010/COMPLETE" ]] || fail "step 10 checkpoint lost"
[[ ! -f "$WORK/save/checkpoints/step_00000015/COMPLETE" ]] || fail "step 15 marked complete"
launch save 2 -- "${JOB[@]}"
[[ $STATUS -eq 0 ]] || { cat "$WORK/save.log"; fail "resume after a kill during save: $STATUS"; }
got=$(final_field save param_fnv1a64)
[[ "$got" == "$want" ]] || fail "after a kill during save the parameters are $got, want $want"
pass "kill during save: step 10 intact, resumed run equals the uninterrupted one"
