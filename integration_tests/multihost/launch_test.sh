#!/bin/bash
# The main job across 2 emulated hosts (hosts.sh): one fs_launch per host, 2 ranks each, rank 0's
# host at 10.77.0.1 holding the store. Each multi-host run is compared, step by step, with the
# same job at 4 ranks on ONE host (host0): per-step losses within 1e-5 (the max difference is
# printed).
#   - tcp, --strategy=full_shard, address chosen automatically (the route to MASTER_ADDR: node 1's
#     ranks advertise 10.77.0.2)
#   - tcp, --strategy=hybrid_shard with FS_SOCKET_IFNAME=eth0; the shard groups are the hosts
#     (hybrid_shard_group_size 0 = by hostname): ranks 0 and 2 (and 1 and 3) hold the same shard,
#     while the one-host run (one group of 4) has 4 different shards
#   - ucx over UCX_TLS=tcp, full_shard, FS_SOCKET_IFNAME=eth0 (UCX_NET_DEVICES=eth0): the same
#     losses as the tcp run across the hosts
#   - FS_SOCKET_IFNAME=lo on both hosts (every rank advertises 127.0.0.1): the job fails within
#     seconds naming the peer, the loopback address and FS_SOCKET_IFNAME, not after 10 minutes
# Args: fs_launch, train_gpt (lib.sh's).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/../lib.sh" "$@"
source "$here/hosts.sh"
source "$here/job_lib.sh"   # STEPS, JOB, reference, close_losses

mh_require_netadmin
mh_create 2

export FS_STORE_TOKEN=$(printf '%032d' 7)
export FS_COMM_TIMEOUT_S=120
PORT=29600

# multi NAME [VAR=VALUE...] -- [train_gpt flags...]: the job on host0 and host1, 2 ranks each.
# Node 0's output in $WORK/NAME.log and its metrics in $WORK/NAME/ (lib.sh's losses NAME); node
# 1's in $WORK/NAME.node1.log. Sets STATUS0 and STATUS1.
multi() {
  local name=$1; shift
  local vars=()
  while [[ $# -gt 0 && $1 != -- ]]; do vars+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift
  PORT=$(( PORT + 1 ))
  local k pids=() out log
  for k in 0 1; do
    out="$WORK/$name"; log="$WORK/$name.log"
    if [[ $k -eq 1 ]]; then out="$WORK/$name.node1"; log="$WORK/$name.node1.log"; fi
    mh_fs_launch "$k" "$PORT" 240 "${vars[@]}" --nproc_per_node=2 --stop_timeout_s=5 -- \
        "$TRAIN_GPT" "${TINY[@]}" "${JOB[@]}" --out_dir="$out" "$@" >"$log" 2>&1 &
    pids+=($!)
  done
  STATUS0=0; STATUS1=0
  wait "${pids[0]}" || STATUS0=$?
  wait "${pids[1]}" || STATUS1=$?
}

expect_ok() {
  local name=$1
  [[ $STATUS0 -eq 0 && $STATUS1 -eq 0 ]] ||
    { tail -40 "$WORK/$name.log" "$WORK/$name.node1.log"; fail "$name: nodes exited $STATUS0, $STATUS1"; }
}

# same_losses GOT WANT: close_losses (job_lib.sh), said.
same_losses() {
  local diff
  diff=$(close_losses "$1" "$2") || return 1
  echo "$1 vs $2: max |loss difference| $diff over $STEPS steps"
}

# hashes NAME: the ranks' parameter-shard hashes at the end, space-separated.
hashes() { jq -r 'select(.type == "final") | .param_fnv1a64 | join(" ")' "$WORK/$1/metrics.jsonl"; }

# ---- full_shard over tcp, the address chosen automatically ------------------------------------
reference one_full --strategy=full_shard
multi two_full -- --strategy=full_shard
expect_ok two_full
grep -q "listening for peers on $(mh_addr 1) (the route to MASTER_ADDR=$(mh_addr 0))" \
    "$WORK/two_full.node1.log" ||
  { cat "$WORK/two_full.node1.log"; fail "two_full: node 1's ranks did not choose $(mh_addr 1)"; }
same_losses two_full one_full || fail "full_shard across 2 hosts: losses differ from one host's"
pass "full_shard, 2 hosts x 2 ranks (automatic address $(mh_addr 1) on host1) = 4 ranks on one host"

# ---- hybrid_shard over tcp, FS_SOCKET_IFNAME=eth0: a shard group per host ---------------------
reference one_hybrid --strategy=hybrid_shard
multi two_hybrid FS_SOCKET_IFNAME=eth0 -- --strategy=hybrid_shard
expect_ok two_hybrid
grep -q "listening for peers on $(mh_addr 0) (FS_SOCKET_IFNAME=eth0)" "$WORK/two_hybrid.log" ||
  { cat "$WORK/two_hybrid.log"; fail "two_hybrid: node 0's ranks did not use eth0"; }
read -r -a h2 <<<"$(hashes two_hybrid)"
read -r -a h1 <<<"$(hashes one_hybrid)"
echo "shard hashes: 2 hosts ${h2[*]}; one host ${h1[*]}"
[[ ${#h2[@]} -eq 4 && ${h2[0]} == "${h2[2]}" && ${h2[1]} == "${h2[3]}" && ${h2[0]} != "${h2[1]}" ]] ||
  fail "two_hybrid: shard hashes ${h2[*]}: want shard groups {0,1} on host0 and {2,3} on host1"
[[ $(printf '%s\n' "${h1[@]}" | sort -u | wc -l) -eq 4 ]] ||
  fail "one_hybrid: shard hashes ${h1[*]}: want one group of 4 on one host"
same_losses two_hybrid one_hybrid || fail "hybrid_shard across 2 hosts: losses differ from one host's"
pass "hybrid_shard, 2 hosts x 2 ranks (FS_SOCKET_IFNAME=eth0; shard groups = hosts) = 4 ranks on one host"

# ---- ucx over tcp across the hosts --------------------------------------------------------------
multi two_ucx FS_COMM_BACKEND=ucx UCX_TLS=tcp FS_SOCKET_IFNAME=eth0 -- --strategy=full_shard
expect_ok two_ucx
same_losses two_ucx two_full || fail "ucx across 2 hosts: losses differ from tcp's"
pass "ucx (UCX_TLS=tcp, UCX_NET_DEVICES from FS_SOCKET_IFNAME=eth0), 2 hosts x 2 ranks = tcp"

# ---- a loopback address advertised across hosts fails fast ------------------------------------
start=$(date +%s)
multi two_lo FS_SOCKET_IFNAME=lo -- --strategy=full_shard
took=$(( $(date +%s) - start ))
[[ $STATUS0 -ne 0 && $STATUS1 -ne 0 ]] || fail "two_lo: nodes exited $STATUS0, $STATUS1; want failures"
(( took < 60 )) || fail "two_lo: took ${took}s to fail"
grep -q "cannot connect to rank [01] at 127.0.0.1:[0-9]* (connect: Connection refused" \
    "$WORK/two_lo.node1.log" ||
  { cat "$WORK/two_lo.node1.log"; fail "two_lo: node 1 did not name the refused loopback address"; }
grep -q "advertised a loopback address.*set FS_SOCKET_IFNAME=<interface>" "$WORK/two_lo.node1.log" ||
  { cat "$WORK/two_lo.node1.log"; fail "two_lo: no advice about FS_SOCKET_IFNAME"; }
pass "FS_SOCKET_IFNAME=lo across hosts: failed in ${took}s naming the loopback address and the fix"
