#!/bin/bash
# The main job under Debian's torchrun (/usr/bin/torchrun, python3-torch) in its multi-node form
# across 2 emulated hosts (hosts.sh): in host k,
#   torchrun --nnodes=2 --node_rank=k --nproc_per_node=2 --master_addr=10.77.0.1
#            --master_port=P --no_python train_gpt ...
# (static rendezvous: node 0's agent hosts the c10d TCPStore at 10.77.0.1:P and the ranks use it,
# TORCHELASTIC_USE_AGENT_STORE=True, through //comm/torch:c10d_store). Tiny model, fp32,
# full_shard, 8 steps: ranks 0, 1 ran in host0 and 2, 3 in host1 (each rank prints its hostname;
# host1's link carried the job's traffic), and the per-step losses equal, within 1e-5, those of the same job at 4 ranks on host0 alone
# (fs_launch). Every run passes `--redirects 1 --tee 1 --log_dir` (Debian's torchrun 1.13 crashes
# on Python 3.11 with the default; see ../torchrun_test.sh).
# Args: fs_launch, train_gpt (lib.sh's).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../lib.sh" "$@"
source "$here/hosts.sh"
source "$here/job_lib.sh"
TORCHRUN=${TORCHRUN:-/usr/bin/torchrun}
[[ -x $TORCHRUN ]] || fail "$TORCHRUN not found (Debian's python3-torch; ./bazelw installs it)"

mh_require_netadmin
mh_create 2
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK
export FS_COMM_TIMEOUT_S=60

reference one_host

# Node k's output in $WORK/torchrun.node<k>.log, its metrics in $WORK/torchrun.node<k>/ (rank 0's
# in node 0's).
port=29620
tx=$(mh_tx_bytes 1)
pids=()
for k in 0 1; do
  mh_run "$k" timeout -k 5 240 "$TORCHRUN" --redirects 1 --tee 1 \
      --log_dir "$WORK/torchrun.node$k.torchrun" --nnodes=2 --node_rank="$k" --nproc_per_node=2 \
      --master_addr="$(mh_addr 0)" --master_port="$port" --no_python -- \
      "$REPORT" "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" --out_dir="$WORK/torchrun.node$k" \
      >"$WORK/torchrun.node$k.log" 2>&1 &
  pids+=($!)
done
status0=0 status1=0
wait "${pids[0]}" || status0=$?
wait "${pids[1]}" || status1=$?
logs=("$WORK/torchrun.node0.log" "$WORK/torchrun.node1.log")
[[ $status0 -eq 0 && $status1 -eq 0 ]] ||
  { show_logs "${logs[@]}"; fail "torchrun on 2 hosts: nodes exited $status0, $status1 (124: still running after 240 s)"; }
expect_placement torchrun "${logs[@]}"
expect_crossed torchrun "$tx"
rm -rf "$WORK/torchrun" && ln -s "$WORK/torchrun.node0" "$WORK/torchrun"
diff=$(close_losses torchrun one_host) || { show_logs "${logs[@]}"; fail "torchrun: losses (above)"; }
pass "torchrun --nnodes=2 on 2 hosts x 2 ranks (ranks 0,1 in host0, 2,3 in host1): losses within $diff of 4 ranks on host0 ($(losses torchrun | tail -1)); host1 sent $CROSSED bytes"
