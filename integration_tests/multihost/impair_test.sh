#!/bin/bash
# Impairments of the emulated hosts (hosts.sh: mh_loss, mh_drop, mh_delay), measured on 2 hosts:
# - loss: 5000 UDP datagrams host0 -> host1, paced so no socket buffer overflows (0 lost without
#   loss); 10% on one end loses a fraction in [0.05, 0.15], in either direction (host1 receiving,
#   host1 sending); 10% on both ends compounds to 1 - 0.9^2 = 19% ([0.14, 0.24]); 0 after removal;
# - drop: a TCP connect times out both ways while host1's link stays up and its sends succeed;
#   after `off` the connect is answered again;
# - delay: the TCP connect time (SYN out, RST back: one round trip; median of 20) is about 0
#   without delay, [39, 80] ms with 20 ms on host1 (each way: 2 x 20 ms is the floor),
#   [79, 130] ms with 20 ms on both ends, < 5 ms after removal;
# - delay + rate: 8 MB over host0's link at 40 Mbit/s and 20 ms each way completes at
#   [20, 42] Mbit/s;
# - a delay queue of 20 packets at 200 ms drops at least 90% of the paced datagrams;
# - the delayers are gone after mh_cleanup.
# Usage: impair_test.sh NETDELAY (Bazel passes the delayer's runfiles path).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export MH_NETDELAY=${1:?usage: impair_test.sh PATH_TO_NETDELAY}
[[ $MH_NETDELAY == /* ]] || MH_NETDELAY=$PWD/$MH_NETDELAY
source "$here/hosts.sh"
export TEST_TMPDIR=${TEST_TMPDIR:-$(mktemp -d)}
fail() { echo "FAIL: $*" >&2; exit 1; }
pass() { echo "PASS: $*"; }
within() { awk -v x="$1" -v lo="$2" -v hi="$3" 'BEGIN { exit !(x >= lo && x <= hi) }'; }

mh_require_netadmin
mh_create 2

# lost_fraction FROM TO: sends 5000 small UDP datagrams from host FROM to host TO (paced: 50 per
# millisecond at most), prints the fraction that did not arrive.
udp_port=6000
lost_fraction() {
  local from=$1 to=$2 n=5000 out
  udp_port=$(( udp_port + 1 ))
  out="$TEST_TMPDIR/udp.$udp_port"
  mh_run "$to" python3 - "$udp_port" >"$out" 2>&1 <<'PY' &
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(10)  # until the first datagram; then 1 s of silence ends the count
n = 0
try:
    while True:
        s.recv(64)
        n += 1
        s.settimeout(1)
except socket.timeout:
    pass
print(n)
PY
  local recv=$!
  sleep 0.3
  mh_run "$from" python3 - "$(mh_addr "$to")" "$udp_port" "$n" <<'PY'
import socket, sys, time
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(n):
    s.sendto(b"%08d" % i, (addr, port))
    if i % 50 == 49:
        time.sleep(0.001)
PY
  wait "$recv"
  awk -v got="$(cat "$out")" -v n="$n" 'BEGIN { printf "%.4f", (n - got) / n }'
}

# tcp_probe FROM TO [TIMEOUT]: one TCP connect from host FROM to a closed port of host TO;
# prints "answered MS" (a reset came back after MS milliseconds) or "timeout" or "error: ...".
tcp_probe() {
  mh_run "$1" python3 - "$(mh_addr "$2")" "${3:-2}" <<'PY'
import socket, sys, time
s = socket.socket()
s.settimeout(float(sys.argv[2]))
t = time.monotonic()
try:
    s.connect((sys.argv[1], 9))
    print("error: connected")
except ConnectionRefusedError:
    print("answered %.2f" % ((time.monotonic() - t) * 1000))
except socket.timeout:
    print("timeout")
except OSError as e:
    print("error: %s" % e)
PY
}

# connect_rtt_ms FROM TO: the median of 20 TCP connect times (one round trip each).
connect_rtt_ms() {
  local k out times=()
  for (( k = 0; k < 20; k++ )); do
    out=$(tcp_probe "$1" "$2")
    [[ $out == answered* ]] || fail "connect host$1 -> host$2: $out"
    times+=("${out#answered }")
  done
  printf '%s\n' "${times[@]}" | sort -g | sed -n 10p
}

# --- loss ---
f=$(lost_fraction 0 1)
[[ $f == 0.0000 ]] || fail "without loss, $f of the datagrams host0 -> host1 were lost"
mh_loss 1 10
f_in=$(lost_fraction 0 1)
within "$f_in" 0.05 0.15 || fail "10% loss on host1: host0 -> host1 lost $f_in"
f_out=$(lost_fraction 1 0)
within "$f_out" 0.05 0.15 || fail "10% loss on host1: host1 -> host0 lost $f_out"
mh_loss 0 10
f_both=$(lost_fraction 0 1)
within "$f_both" 0.14 0.24 || fail "10% loss on host0 and host1: host0 -> host1 lost $f_both"
mh_loss 0 0
mh_loss 1 0
f_off=$(lost_fraction 0 1)
[[ $f_off == 0.0000 ]] || fail "loss removed, yet $f_off of the datagrams were lost"
pass "loss (5000 UDP datagrams): 10% on host1: $f_in lost host0 -> host1, $f_out host1 -> host0;" \
  "10% on both ends: $f_both (1 - 0.9^2 = 0.19); removed: $f_off"

# --- drop (partition with the link up) ---
mh_drop 1 on
out=$(tcp_probe 0 1 1)
[[ $out == timeout ]] || fail "host1 dropping: host0's connect to host1 gave '$out', not a timeout"
out=$(tcp_probe 1 0 1)
[[ $out == timeout ]] || fail "host1 dropping: host1's connect to host0 gave '$out', not a timeout"
state=$(ip netns exec "$(mh_ns 1)" cat /sys/class/net/eth0/operstate)
[[ $state == up ]] || fail "host1 dropping: its eth0 is '$state', not up"
mh_run 1 python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('$(mh_addr 0)', 9))" ||
  fail "host1 dropping: a UDP send from host1 failed"
mh_drop 1 off
out=$(tcp_probe 0 1 2)
[[ $out == answered* ]] || fail "host1's drop off: host0's connect to host1 gave '$out'"
pass "drop: connects time out both ways, host1's eth0 stays up and its sends succeed; off: ${out} ms"

# --- delay ---
rtt0=$(connect_rtt_ms 0 1)
mh_delay 1 20
rtt1=$(connect_rtt_ms 0 1)
within "$rtt1" 39 80 || fail "20 ms delay on host1: connect round trip $rtt1 ms, not in [39, 80]"
mh_delay 0 20
rtt2=$(connect_rtt_ms 0 1)
within "$rtt2" 79 130 || fail "20 ms delay on both ends: connect round trip $rtt2 ms, not in [79, 130]"
mh_delay 0 0
mh_delay 1 0
rtt3=$(connect_rtt_ms 0 1)
within "$rtt3" 0 5 || fail "delay removed: connect round trip $rtt3 ms"
pass "delay (TCP connect round trip, median of 20): none $rtt0 ms; 20 ms on host1: $rtt1 ms;" \
  "20 ms on both ends: $rtt2 ms; removed: $rtt3 ms"

# --- delay + rate: a bulk transfer completes ---
mh_delay 0 20
mh_shape 0 rate=40mbit
port=5001
mh_run 1 python3 - "$port" >"$TEST_TMPDIR/bulk.out" 2>&1 <<'PY' &
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); s.settimeout(20)
c, _ = s.accept(); c.settimeout(20); n = 0; t0 = time.time()
while True:
    b = c.recv(1 << 16)
    if not b: break
    n += len(b)
print(n, "%.2f" % (time.time() - t0))
PY
recv=$!
sleep 0.5
mh_run 0 python3 - "$(mh_addr 1)" "$port" <<'PY'
import socket, sys, time
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
c.settimeout(30)
c.sendall(b"x" * (8 << 20)); c.close()
PY
wait "$recv" || fail "bulk receiver: $(cat "$TEST_TMPDIR/bulk.out")"
read -r bytes secs <"$TEST_TMPDIR/bulk.out"
[[ $bytes == $(( 8 << 20 )) ]] || fail "bulk transfer: $bytes of $(( 8 << 20 )) bytes arrived"
rate=$(awk -v b="$bytes" -v s="$secs" 'BEGIN { printf "%.1f", b * 8 / s / 1e6 }')
within "$rate" 20 42 || fail "8 MB at 40 Mbit/s + 20 ms each way: $rate Mbit/s"
pass "delay + rate: 8 MB over 40 Mbit/s and 20 ms each way (host0) in ${secs}s: $rate Mbit/s"
mh_shape 0 none
mh_delay 0 0

# --- the delay queue is bounded: beyond it packets are dropped ---
MH_DELAY_QUEUE=20 mh_delay 1 200
f_full=$(lost_fraction 0 1)
within "$f_full" 0.9 1 || fail "delay queue of 20 at 200 ms: only $f_full of 5000 datagrams lost"
mh_delay 1 0
pass "a delay queue of 20 packets held 200 ms: $f_full of 5000 paced datagrams dropped"

# --- the delayers end with the hosts ---
mh_delay 0 20
mh_delay 1 20
pids=("${MH_DELAYER[@]}")
(( ${#pids[@]} == 2 )) || fail "expected 2 delayers running, got ${#pids[@]}"
mh_cleanup
sleep 0.2
for p in "${pids[@]}"; do
  # Gone, or a zombie its parent (this shell) has not reaped yet.
  [[ ! -e /proc/$p ]] || grep -q '^State:[[:space:]]*Z' "/proc/$p/status" ||
    fail "netdelay $p still running after mh_cleanup"
done
pass "mh_cleanup ended the ${#pids[@]} delayers"
for log in "$TEST_TMPDIR"/netdelay.*.log; do echo "$(basename "$log"): $(tr '\n' ' ' <"$log")"; done
