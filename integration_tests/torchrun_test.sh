#!/bin/bash
# The main job and the demo under Debian's torchrun (/usr/bin/torchrun, python3-torch), with the
# ranks meeting in the c10d TCPStore that torchrun's agent hosts (//comm/torch:c10d_store):
#   * `torchrun --no_python --nproc_per_node=N` (static rendezvous, TORCHELASTIC_USE_AGENT_STORE=
#     True) at 2 and 4 ranks: the losses equal the fs_launch run's at the same world size;
#   * the demo at 2 and 4 ranks;
#   * torchrun's multi-node form: two agents on 127.0.0.1 as 2 nodes of 2 ranks with the c10d
#     rendezvous backend (TORCHELASTIC_USE_AGENT_STORE=False, MASTER_ADDR a host name, rank 0
#     hosts the store);
#   * --max_restarts=1 with a rank killed: the second attempt meets under
#     /worker/attempt_1/ in the agent's store (the first attempt's keys are still there).
# Debian's torchrun 1.13 on Python 3.11 crashes at start with its default `--redirects 0`
# (AttributeError: 'NoneType' object has no attribute 'get', an IntFlag change in 3.11): every
# run here passes `--redirects 1 --tee 1 --log_dir DIR`, which works (each line is prefixed
# `[default<local rank>]:`).
source "$(dirname "$0")/lib.sh" "$1" "$2"
DEMO=$(readlink -f "$3")
TORCHRUN=${TORCHRUN:-/usr/bin/torchrun}
[[ -x $TORCHRUN ]] || fail "$TORCHRUN not found (Debian's python3-torch; ./bazelw installs it)"

# trun NAME [torchrun flags...] -- PROGRAM [args...]: output in $WORK/NAME.log; sets STATUS.
trun() {
  local name=$1; shift
  STATUS=0
  timeout -k 5 240 "$TORCHRUN" --redirects 1 --tee 1 --log_dir "$WORK/$name.torchrun" "$@" \
      >"$WORK/$name.log" 2>&1 || STATUS=$?
  [[ $STATUS -ne 124 ]] || { cat "$WORK/$name.log"; fail "$name: still running after 240 s"; }
}

JOB=(--steps=10 --checkpoint_dir=none)

for n in 2 4; do
  launch "fs_launch_$n" "$n" -- "${JOB[@]}"
  [[ $STATUS -eq 0 ]] || { cat "$WORK/fs_launch_$n.log"; fail "fs_launch at $n ranks: $STATUS"; }

  name="torchrun_$n"
  trun "$name" --no_python --nproc_per_node="$n" --master_port="$(free_port)" -- \
      "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" --out_dir="$WORK/$name"
  [[ $STATUS -eq 0 ]] || { cat "$WORK/$name.log"; fail "$name exited with $STATUS"; }
  expect_same_losses "$name" "fs_launch_$n" 10
  pass "$name: same losses as fs_launch at $n ranks ($(losses "$name" | tail -1))"

  name="demo_$n"
  trun "$name" --no_python --nproc_per_node="$n" --master_port="$(free_port)" -- \
      "$DEMO" --count=20000
  [[ $STATUS -eq 0 ]] || { cat "$WORK/$name.log"; fail "$name exited with $STATUS"; }
  ok=$(grep -c "OK: all_reduce" "$WORK/$name.log" || true)
  [[ $ok -eq $n ]] || { cat "$WORK/$name.log"; fail "$name: $ok of $n ranks OK"; }
  pass "$name: all $n ranks OK"
done

# Multi-node form: 2 agents x 2 ranks, c10d rendezvous on 127.0.0.1. A wrapper records what
# torchrun gave the ranks.
cat >"$WORK/show_env.sh" <<'SH'
#!/bin/sh
echo "env: RANK=$RANK MASTER_ADDR=$MASTER_ADDR TORCHELASTIC_USE_AGENT_STORE=$TORCHELASTIC_USE_AGENT_STORE" >&2
exec "$@"
SH
chmod +x "$WORK/show_env.sh"
port=$(free_port)
rdzv=(--nnodes=2 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint="127.0.0.1:$port"
      --rdzv_id="fs_torchrun_$$" --no_python -- "$WORK/show_env.sh" "$TRAIN_GPT" "${TINY[@]}"
      "${JOB[@]}" --out_dir="$WORK/multinode")
trun multinode_a "${rdzv[@]}" &
agent_a=$!
trun multinode_b "${rdzv[@]}"
status_b=$STATUS
status_a=0
wait "$agent_a" || status_a=$?
[[ $status_a -eq 0 && $status_b -eq 0 ]] ||
  { cat "$WORK/multinode_a.log" "$WORK/multinode_b.log"; fail "multi-node: agents exited $status_a, $status_b"; }
cat "$WORK/multinode_a.log" "$WORK/multinode_b.log" >"$WORK/multinode.log"
[[ $(grep -c "env: RANK=" "$WORK/multinode.log") -eq 4 ]] || fail "multi-node: expected 4 ranks"
grep -q "TORCHELASTIC_USE_AGENT_STORE=False" "$WORK/multinode.log" ||
  fail "multi-node: torchrun's c10d rendezvous should leave the store to rank 0"
addr=$(grep -m1 -o "MASTER_ADDR=[^ ]*" "$WORK/multinode.log" | cut -d= -f2)
[[ ! $addr =~ ^[0-9.]+$ ]] || fail "multi-node: MASTER_ADDR '$addr' is not a host name"
expect_same_losses multinode fs_launch_4 10
pass "multi-node: 2 agents x 2 ranks, rank 0 hosting the store at MASTER_ADDR=$addr (a host name), same losses as fs_launch at 4 ranks"

# A restart: rank 1 dies at step 3 of the first attempt; torchrun restarts both and the second
# attempt trains from scratch, meeting in a fresh /worker/attempt_1/ namespace.
name=restart
trun "$name" --no_python --nproc_per_node=2 --master_port="$(free_port)" --max_restarts=1 -- \
    "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" --fault_kill=1:3 --out_dir="$WORK/$name"
[[ $STATUS -eq 0 ]] || { cat "$WORK/$name.log"; fail "$name exited with $STATUS"; }
grep -q "attempt_1" <(find "$WORK/$name.torchrun" -type d) ||
  { cat "$WORK/$name.log"; fail "$name: torchrun did not restart"; }
[[ "$(losses "$name" | tail -10)" == "$(losses fs_launch_2)" ]] ||
  { diff <(losses fs_launch_2) <(losses "$name" | tail -10) || true; fail "$name: the second attempt's losses differ"; }
pass "$name: the second attempt ran the job again with the same losses"
