#!/bin/bash
# The main job under OpenMPI's mpirun (openmpi-bin) across 2 emulated hosts (hosts.sh), 2 ranks
# each: mpirun runs in host0 and starts its daemon in host1 through netns_rsh.sh, the ssh
# stand-in (--mca plm_rsh_agent); OpenMPI's own TCP stays on the hosts' eth0. The ranks meet in
# rank 0's TCPStore at `-x MASTER_ADDR=10.77.0.1 -x MASTER_PORT=P` (no shared session directory
# across hosts).
#   - tiny model, fp32, full_shard, 8 steps: ranks 0, 1 ran in host0 and 2, 3 in host1 (each rank
#     prints its hostname; host1's link carried the job's traffic), and the per-step losses equal, within 1e-5, those of the same job at
#     4 ranks on host0 alone (fs_launch)
#   - without MASTER_ADDR: every rank fails within seconds saying to pass
#     `-x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=...` (not a rendezvous timeout)
#   - MASTER_ADDR/MASTER_PORT exported where mpirun runs but not passed with -x: host1's ranks
#     do not get them (as over ssh) and fail the same way, within seconds
#   - -x MASTER_ADDR=host0 where host0's /etc/hosts names itself 127.0.1.1 (Debian's default):
#     host0's ranks fail within seconds saying the address is loopback there (rank 0's store
#     would listen out of host1's reach)
# Args: fs_launch, train_gpt (lib.sh's).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../lib.sh" "$@"
source "$here/hosts.sh"
source "$here/job_lib.sh"
command -v mpirun >/dev/null || fail "mpirun not found (Debian's openmpi-bin; ./bazelw installs it)"

mh_require_netadmin
mh_create 2
export MH_PREFIX  # netns_rsh.sh finds the hosts' namespaces by it

# As root, mpirun refuses to run without these (the same as --allow-run-as-root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
unset MASTER_ADDR MASTER_PORT
printf 'host0 slots=2\nhost1 slots=2\n' >"$WORK/hostfile"
MPI=(mpirun --hostfile "$WORK/hostfile" -np 4 --bind-to none
     --mca plm_rsh_agent "$here/netns_rsh.sh"
     --mca oob_tcp_if_include eth0 --mca btl_tcp_if_include eth0
     -x OMP_NUM_THREADS=1 -x FS_COMM_TIMEOUT_S=60)

# mrun NAME [mpirun flags...]: the job under mpirun started in host0, output in $WORK/NAME.log,
# metrics in $WORK/NAME/; sets STATUS and SECONDS_TAKEN.
mrun() {
  local name=$1; shift
  local t0=$SECONDS
  STATUS=0
  mh_run 0 timeout -k 5 240 "${MPI[@]}" "$@" "$REPORT" "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" \
      --out_dir="$WORK/$name" >"$WORK/$name.log" 2>&1 || STATUS=$?
  SECONDS_TAKEN=$(( SECONDS - t0 ))
  [[ $STATUS -ne 124 ]] || { show_logs "$WORK/$name.log"; fail "$name: still running after 240 s"; }
}

reference one_host

tx=$(mh_tx_bytes 1)
mrun mpirun -x MASTER_ADDR="$(mh_addr 0)" -x MASTER_PORT=29610
[[ $STATUS -eq 0 ]] || { show_logs "$WORK/mpirun.log"; fail "mpirun across 2 hosts exited with $STATUS"; }
grep -q "train_gpt: 4 ranks" "$WORK/mpirun.log" ||
  { show_logs "$WORK/mpirun.log"; fail "mpirun: not one job of 4 ranks"; }
expect_placement mpirun "$WORK/mpirun.log"
expect_crossed mpirun "$tx"
diff=$(close_losses mpirun one_host) || { show_logs "$WORK/mpirun.log"; fail "mpirun: losses (above)"; }
pass "mpirun across 2 hosts x 2 ranks (ranks 0,1 in host0, 2,3 in host1): losses within $diff of 4 ranks on host0 ($(losses mpirun | tail -1)); host1 sent $CROSSED bytes"

# expect_clear_error NAME: the job failed, soon, with the message that says what to pass.
expect_clear_error() {
  local name=$1
  [[ $STATUS -ne 0 ]] || { show_logs "$WORK/$name.log"; fail "$name: exited 0 without a rendezvous"; }
  (( SECONDS_TAKEN <= 30 )) ||
    { show_logs "$WORK/$name.log"; fail "$name: took ${SECONDS_TAKEN}s to fail (want seconds)"; }
  grep -q "MASTER_ADDR is not set" "$WORK/$name.log" &&
    grep -q "mpirun -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=" "$WORK/$name.log" ||
    { show_logs "$WORK/$name.log"; fail "$name: no error saying to pass -x MASTER_ADDR -x MASTER_PORT"; }
}

mrun no_master_addr
expect_clear_error no_master_addr
pass "mpirun across hosts without MASTER_ADDR: failed in ${SECONDS_TAKEN}s: $(grep -m1 -o 'MASTER_ADDR is not set.*' "$WORK/no_master_addr.log")"

# Exported in mpirun's environment only: host0's ranks inherit the variables, host1's do not.
mpi=("${MPI[@]}")
MPI=(env MASTER_ADDR="$(mh_addr 0)" MASTER_PORT=29611 "${mpi[@]}")
mrun not_forwarded
MPI=("${mpi[@]}")
expect_clear_error not_forwarded
pass "MASTER_ADDR exported but not passed with -x: host1's ranks failed in ${SECONDS_TAKEN}s saying to pass -x"

# Debian's /etc/hosts maps a host's own name to 127.0.1.1: with that on host0, MASTER_ADDR=host0
# is loopback for host0's ranks (rank 0's TCPStore would listen there) and 10.77.0.1 for host1's.
hosts0="/etc/netns/$(mh_ns 0)/hosts"
cp "$hosts0" "$WORK/hosts0.orig"
sed -i "s/^$(mh_addr 0) host0\$/127.0.1.1 host0/" "$hosts0"
grep -q "^127.0.1.1 host0$" "$hosts0" || fail "could not map host0 to 127.0.1.1 in $hosts0"
mrun loopback_name -x MASTER_ADDR=host0 -x MASTER_PORT=29612
cp "$WORK/hosts0.orig" "$hosts0"
[[ $STATUS -ne 0 ]] || { show_logs "$WORK/loopback_name.log"; fail "loopback_name: exited 0"; }
(( SECONDS_TAKEN <= 30 )) ||
  { show_logs "$WORK/loopback_name.log"; fail "loopback_name: took ${SECONDS_TAKEN}s to fail (want seconds)"; }
grep -q "MASTER_ADDR='host0' is a loopback address on this host, but mpirun placed the ranks on several hosts" \
    "$WORK/loopback_name.log" ||
  { show_logs "$WORK/loopback_name.log"; fail "loopback_name: no error saying MASTER_ADDR is loopback on host0"; }
pass "-x MASTER_ADDR=host0 with host0 named 127.0.1.1 on host0: failed in ${SECONDS_TAKEN}s: $(grep -m1 -o "MASTER_ADDR='host0' is a loopback.*" "$WORK/loopback_name.log" | cut -c1-160)..."
