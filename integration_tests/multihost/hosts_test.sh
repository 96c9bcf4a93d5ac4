#!/bin/bash
# The emulated hosts themselves (hosts.sh): 3 hosts, each with its own hostname (UTS namespace)
# and address, resolving the others by name; no route out of 10.77.0.0/24; a link taken down
# isolates its host and comes back when plugged in again; a link shaped to 40 Mbit/s carries a
# bulk transfer at that rate (measured within [0.7, 1.05] x the rate); the namespaces and their
# /etc/netns files are gone after the test (the cleanup trap), also when a test fails;
# mh_fs_launch starts $FS_LAUNCH with the node's flags and variables.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/hosts.sh"
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "PASS: $*"; }

mh_require_netadmin
mh_create 3

for i in 0 1 2; do
  [[ $(mh_run "$i" hostname) == "host$i" ]] || fail "host $i's hostname is $(mh_run "$i" hostname)"
  got=$(mh_run "$i" getent hosts "host$(( (i + 1) % 3 ))" | awk '{print $1}')
  [[ $got == "$(mh_addr $(( (i + 1) % 3 )))" ]] || fail "host$i resolves host$(( (i + 1) % 3 )) to '$got'"
done
[[ $(hostname) != host0 ]] || fail "the caller's hostname changed"
pass "3 hosts: hostnames host0..host2, each resolving the others"

out=$(ip netns exec "$(mh_ns 0)" ip route get 192.0.2.1 2>&1 || true)
[[ $out == *"unreachable"* ]] || fail "host0 has a route out of the emulated network: $out"
pass "no route beyond $MH_SUBNET.0/24 ($out)"

mh_reachable 0 2 || fail "host0 does not reach host2"
mh_link 2 down
! mh_reachable 0 2 1 || fail "host2 still reachable with its link down"
mh_reachable 0 1 || fail "host1 unreachable while host2's link is down"
mh_link 2 up
mh_reachable 0 2 5 || fail "host2 unreachable after its link came back"
pass "link down isolates its host; up brings it back"

# Bulk transfer host0 -> host1 over a 40 Mbit/s link: 8 MB should take about 1.6 s.
mh_shape 1 rate=40mbit
port=5001
mh_run 1 python3 - "$port" >"$TEST_TMPDIR/recv.out" 2>&1 <<'PY' &
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1)
c, _ = s.accept(); n = 0; t0 = None
while True:
    b = c.recv(1 << 16)
    if not b: break
    if t0 is None: t0 = time.time()
    n += len(b)
print(n, time.time() - t0)
PY
recv=$!
sleep 0.5
mh_run 0 python3 - "$(mh_addr 1)" "$port" <<'PY'
import socket, sys, time
for _ in range(50):
    try:
        c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5); break
    except OSError: time.sleep(0.1)
c.sendall(b"x" * (8 << 20)); c.close()
PY
wait "$recv"
read -r bytes secs <"$TEST_TMPDIR/recv.out"
rate=$(awk -v b="$bytes" -v s="$secs" 'BEGIN { printf "%.1f", b * 8 / s / 1e6 }')
awk -v r="$rate" 'BEGIN { exit !(r >= 28 && r <= 42) }' ||
  fail "40 Mbit/s link carried $bytes bytes at $rate Mbit/s"
pass "shaped link: 40 Mbit/s configured, $rate Mbit/s measured ($bytes bytes in ${secs}s)"

# mh_fs_launch: $FS_LAUNCH in host 1 as node 1 of the 3, the store at host0's address, the
# variables in its environment, the other arguments after the ones it sets.
FS_LAUNCH="$TEST_TMPDIR/fake_fs_launch.sh"
printf '#!/bin/sh\necho "$(hostname) FOO=$FOO $*"\n' >"$FS_LAUNCH"
chmod +x "$FS_LAUNCH"
got=$(mh_fs_launch 1 29555 10 FOO=bar --nproc_per_node=2 -- prog --x=1)
want="host1 FOO=bar --nnodes=3 --node_rank=1 --master_addr=$(mh_addr 0) --master_port=29555"
want+=" --nproc_per_node=2 -- prog --x=1"
[[ $got == "$want" ]] || fail "mh_fs_launch ran: '$got', want: '$want'"
pass "mh_fs_launch: $got"

names=("${MH_CREATED[@]}")
mh_cleanup
for ns in "${names[@]}"; do
  ! ip netns list | grep -qw "$ns" || fail "namespace $ns left behind"
  [[ ! -e /etc/netns/$ns ]] || fail "/etc/netns/$ns left behind"
done
pass "cleanup: ${#names[@]} namespaces and their /etc/netns files removed"
