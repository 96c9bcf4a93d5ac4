#!/bin/bash
# The main job under OpenMPI's mpirun (openmpi-bin) at 2 and 4 ranks: ranks and size come from
# OMPI_COMM_WORLD_*, the rendezvous is a FileStore in mpirun's per-job session directory (one
# node, no MASTER_ADDR), and the losses equal the fs_launch run's at the same world size. Then
# with an explicit `-x MASTER_ADDR -x MASTER_PORT` (rank 0 hosts the TCPStore, as across nodes).
source "$(dirname "$0")/lib.sh" "$1" "$2"
DEMO=$(readlink -f "$3")
command -v mpirun >/dev/null || fail "mpirun not found (Debian's openmpi-bin; ./bazelw installs it)"
# As root, OpenMPI refuses to run without these (the same as --allow-run-as-root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# More ranks than cores is fine here; no network interfaces but loopback in the sandbox.
MPI=(mpirun --oversubscribe --bind-to none --mca btl self,vader --mca btl_tcp_if_include lo
     --mca oob_tcp_if_include lo)

JOB=(--steps=10 --checkpoint_dir=none)

# mrun NAME NP [mpirun flags...] -- [train_gpt flags...]
mrun() {
  local name=$1 np=$2; shift 2
  local mflags=()
  while [[ $# -gt 0 && $1 != -- ]]; do mflags+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  STATUS=0
  timeout -k 5 240 "${MPI[@]}" -np "$np" "${mflags[@]}" "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" \
      --out_dir="$WORK/$name" "$@" >"$WORK/$name.log" 2>&1 || STATUS=$?
  [[ $STATUS -ne 124 ]] || { cat "$WORK/$name.log"; fail "$name: still running after 240 s"; }
}

for n in 2 4; do
  launch "fs_launch_$n" "$n" -- "${JOB[@]}"
  [[ $STATUS -eq 0 ]] || { cat "$WORK/fs_launch_$n.log"; fail "fs_launch at $n ranks: $STATUS"; }
  mrun "mpirun_$n" "$n"
  [[ $STATUS -eq 0 ]] || { cat "$WORK/mpirun_$n.log"; fail "mpirun -np $n exited with $STATUS"; }
  grep -q "train_gpt: $n ranks" "$WORK/mpirun_$n.log" ||
    { cat "$WORK/mpirun_$n.log"; fail "mpirun_$n: not one job of $n ranks"; }
  expect_same_losses "mpirun_$n" "fs_launch_$n" 10
  pass "mpirun -np $n: one job of $n ranks, same losses as fs_launch ($(losses "mpirun_$n" | tail -1))"
done

port=$(free_port)
mrun mpirun_x 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port"
[[ $STATUS -eq 0 ]] || { cat "$WORK/mpirun_x.log"; fail "mpirun -x MASTER_ADDR exited with $STATUS"; }
expect_same_losses mpirun_x fs_launch_2 10
pass "mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT: same losses"

out=$(timeout -k 5 120 "${MPI[@]}" -np 3 "$DEMO" --count=20000 2>&1) || { echo "$out"; fail "demo under mpirun"; }
[[ $(grep -c "OK: all_reduce" <<<"$out") -eq 3 ]] || { echo "$out"; fail "demo under mpirun: not 3 OK ranks"; }
pass "demo under mpirun -np 3: all ranks OK"
