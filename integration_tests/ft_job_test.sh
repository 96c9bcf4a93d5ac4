#!/bin/bash
# The main job's --fault_tolerant mode under fs_launch --replica_group_size (4 ranks = 2 replica
# groups x 2, tcp): a SIGKILLed rank stops only its group; the other group keeps training alone
# (groups 1/2), the launcher restarts the dead group, which rejoins with the state of the live one
# (groups 2/2), and the job ends with status 0 and the same full parameters on all 4 ranks.
# 1. rank 3 (group 1) is killed after step 6; 2. rank 0 (group 0, the progress writer) is.
source "$(dirname "$0")/lib.sh" "$@"
# A step of the tiny model takes tens of ms: enough steps that the survivors are still
# training when the restarted group is back (a few seconds).
FT=(--fault_tolerant --strategy=hybrid_shard --hybrid_shard_group_size=2 --steps=${FS_FT_STEPS:-150}
    --precision=fp32 --ft_heartbeat_ms=100 --ft_dead_after_ms=1000 --log_every=1 --eval_every=0)

# incarnations NAME RANK: the incarnations rank RANK started as (its start-up lines).
incarnations() {
  grep -o "fault-tolerant rank $2: .*incarnation [0-9]*" "$WORK/$1.log" | grep -o '[0-9]*$' |
    tr '\n' ' ' | sed 's/ $//'
}

# has NAME FILTER: some record of the run's metrics passes the jq FILTER (not jq's -e: jq 1.6
# judges by the last input only).
has() { [[ -n "$(jq -c "select($2)" "$WORK/$1/metrics.jsonl")" ]]; }

# check NAME KILLED_RANK: every expectation of a run in which KILLED_RANK was SIGKILLed once.
check() {
  local name=$1 killed=$2 m="$WORK/$1/metrics.jsonl" g=$(( $2 / 2 )) r want got
  [[ $STATUS -eq 0 ]] || { cat "$WORK/$name.log"; fail "$name: job exited with $STATUS, want 0"; }
  grep -q "fault injection: SIGKILL after step" "$WORK/$name.log" ||
    { cat "$WORK/$name.log"; fail "$name: the fault did not fire"; }
  for r in 0 1 2 3; do
    got=$(incarnations "$name" "$r")
    if (( r / 2 == g )); then want="0 1"; else want="0"; fi
    [[ "$got" == "$want" ]] || { cat "$WORK/$name.log"; fail "$name: rank $r started as incarnations '$got', want '$want'"; }
  done
  [[ -s "$m" ]] || { cat "$WORK/$name.log"; fail "$name: no metrics"; }
  has "$name" ".type == \"membership\" and .dropped == [$g]" ||
    { cat "$m"; fail "$name: no membership record dropping group $g"; }
  has "$name" ".type == \"membership\" and .joiners == [$g]" ||
    { cat "$m"; fail "$name: no membership record with joiners [$g]"; }
  # Train records in step order: 2 groups, then 1 (after the kill), then 2 again (after the join).
  got=$(jq -r 'select(.type == "train") | .groups' "$m" | uniq | tr '\n' ' ')
  [[ "$got" == "2 1 2 " ]] || { cat "$m"; fail "$name: live groups per step went '$got', want '2 1 2 '"; }
  [[ $(jq -r 'select(.type == "train") | .step' "$m" | sort -n | uniq | wc -l) -eq ${FS_FT_STEPS:-150} ]] ||
    fail "$name: not one train record per step"
  grep -q "groups 1/2" "$WORK/$name.log" || fail "$name: no progress line with groups 1/2"
  grep "groups [12]/2" "$WORK/$name.log" | tail -1 | grep -q "groups 2/2" ||
    fail "$name: the last progress line does not show groups 2/2"
  has "$name" '.type == "join"' || fail "$name: no join record"
  # One full-parameter hash per rank (the restarted group's second incarnation), all equal.
  got=$(grep -o "rank [0-3] (group .*full parameter hash [0-9a-f]*" "$WORK/$name.log" | sort -u)
  [[ $(wc -l <<<"$got") -eq 4 ]] || { echo "$got"; fail "$name: want 4 full-parameter hash lines"; }
  [[ $(grep -o '[0-9a-f]*$' <<<"$got" | sort -u | wc -l) -eq 1 ]] ||
    { echo "$got"; fail "$name: the ranks' full parameters differ"; }
  pass "$name: rank $killed killed: $(jq -c 'select(.type == "membership") | {step, groups, dropped, joiners, quorum_wait_s, transfer_s}' "$m" | tr '\n' ' ')"
  pass "$name: $(jq -c 'select(.type == "join") | {step, group, startup_s, quorum_wait_s, transfer_s, first_commit_s}' "$m")"
}

launch group1 4 --replica_group_size=2 --max_restarts=1 -- "${FT[@]}" --fault_kill=3:6
check group1 3
launch group0 4 --replica_group_size=2 --max_restarts=1 -- "${FT[@]}" --fault_kill=0:6
check group0 0
