# Emulated hosts for the multi-host tests (sourced; bash). Each host is a Linux network namespace
# with its own address and, for every process started in it with mh_run, its own hostname (a UTS
# namespace), joined to the others by a veth pair to a bridge that lives in a namespace of its own:
#
#   host 0 (netns <p>h0, eth0 10.77.0.1/24) --veth-- [bridge in netns <p>sw] --veth-- host 1 ...
#
# Nothing is created in the caller's namespace and the hosts have no route beyond 10.77.0.0/24:
# test traffic cannot leave the emulated network. Names carry a per-test prefix (the shell's pid),
# so tests can run concurrently. Every host resolves every other host's name ("host<i>") through
# its own /etc/hosts (ip netns exec bind-mounts /etc/netns/<ns>/hosts). Everything is torn down on
# exit (mh_cleanup, installed as an EXIT/INT/TERM trap by mh_create).
#
#   source integration_tests/multihost/hosts.sh
#   mh_require_netadmin                    # fails in CI, skips elsewhere, without CAP_NET_ADMIN
#   mh_create 2                            # host0, host1
#   mh_run 1 some_command args...          # runs in host1 (netns + UTS "host1")
#   mh_shape 1 rate=100mbit                # host1's link: 100 Mbit/s each way (tbf)
#   mh_link 1 down; mh_link 1 up           # unplug / replug host1's cable
#   mh_addr 0                              # 10.77.0.1
#   mh_loss 1 10; mh_loss 1 0              # host1 loses 10% of its packets each way / none
#   mh_drop 1 on; mh_drop 1 off            # host1's packets vanish (link stays up) / flow again
#   mh_delay 1 20; mh_delay 1 0            # host1's packets delayed 20 ms each way / not
#   mh_fs_launch 1 29500 240 [VAR=V...] --nproc_per_node=2 -- prog args...
#                                          # $FS_LAUNCH as node 1 of a job over every host
#
# Impairments (loss, drop, delay) act on host I's cable at the switch, on the IPv4 packets it
# sends and those it receives, so between host I and any other host each applies once per
# direction; set on both ends they compound (10% loss on each: a datagram survives with
# 0.9 x 0.9 = 81%; 20 ms delay on each: 40 ms one way). The host's own stack sees nothing (no
# send errors). They are iptables rules in the switch's namespace (the bridge calls iptables:
# br_netfilter), and for delay netdelay (an NFQUEUE reader: this kernel has no netem qdisc), run
# in the switch's namespace: $MH_NETDELAY, by default `netdelay` beside this file. Order on the
# way out of host I: its tbf (mh_shape), then drop, loss, delay; on the way in: drop, loss, delay,
# then the tbf of its port. ARP and IPv6 are not impaired.
#
# Requires root (CAP_NET_ADMIN, CAP_SYS_ADMIN): ip (iproute2), unshare, tc; for impairments
# iptables (with the physdev and statistic matches and the NFQUEUE target).

# Bazel's test PATH (/bin:/usr/bin:/usr/local/bin) lacks the sbin directories of ip and tc.
export PATH="$PATH:/usr/sbin:/sbin"
MH_PREFIX=${MH_PREFIX:-fs$$}
MH_HOSTS=0
MH_SUBNET=10.77.0
MH_SWITCH="${MH_PREFIX}sw"
MH_CREATED=()
MH_NETDELAY=${MH_NETDELAY:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/netdelay}
declare -A MH_DELAYER=()  # host -> pid of its netdelay
MH_DELAY_RUNS=0

mh_log() { echo "multihost: $*" >&2; }

# mh_require_netadmin: returns when this process can create network namespaces. Otherwise, as
# root (CI runs as root: there this is a broken machine, not a missing privilege) or with
# FS_REQUIRE_NETADMIN set it fails with the reason; elsewhere it prints SKIP and exits 0.
mh_require_netadmin() {
  local probe="${MH_PREFIX}probe" err
  if err=$(ip netns add "$probe" 2>&1); then
    ip netns del "$probe" 2>/dev/null || true
    return 0
  fi
  local why="cannot create a network namespace (needs root: CAP_NET_ADMIN and CAP_SYS_ADMIN): $err"
  if [[ $(id -u) -eq 0 || -n ${FS_REQUIRE_NETADMIN:-} ]]; then
    echo "FAIL: multihost: $why" >&2
    exit 1
  fi
  echo "SKIP: multihost: $why (run as root to emulate hosts; CI does)"
  exit 0
}

mh_ns() { echo "${MH_PREFIX}h$1"; }
mh_addr() { echo "$MH_SUBNET.$(( $1 + 1 ))"; }
mh_hostname() { echo "host$1"; }
# The switch-side end of host i's cable.
mh_port() { echo "p$1"; }

# mh_create H: H hosts (0 .. H-1) on one bridge. Installs the cleanup trap.
mh_create() {
  local n=$1 i ns
  (( n >= 1 && n <= 200 )) || { echo "mh_create: 1..200 hosts, got $n" >&2; return 1; }
  trap mh_cleanup EXIT
  trap 'mh_cleanup; exit 130' INT
  trap 'mh_cleanup; exit 143' TERM
  ip netns add "$MH_SWITCH"
  MH_CREATED+=("$MH_SWITCH")
  ip -n "$MH_SWITCH" link set lo up
  ip -n "$MH_SWITCH" link add br0 type bridge
  ip -n "$MH_SWITCH" link set br0 up
  local hosts_file
  hosts_file=$(printf '127.0.0.1 localhost\n'; for (( i = 0; i < n; i++ )); do
    printf '%s %s\n' "$(mh_addr "$i")" "$(mh_hostname "$i")"; done)
  for (( i = 0; i < n; i++ )); do
    ns=$(mh_ns "$i")
    ip netns add "$ns"
    MH_CREATED+=("$ns")
    mkdir -p "/etc/netns/$ns"
    printf '%s\n' "$hosts_file" >"/etc/netns/$ns/hosts"
    printf '%s\n' "$(mh_hostname "$i")" >"/etc/netns/$ns/hostname"
    ip -n "$ns" link set lo up
    # The cable: eth0 in the host, p<i> on the switch.
    ip link add "${MH_PREFIX}e$i" netns "$ns" type veth peer name "$(mh_port "$i")" netns "$MH_SWITCH"
    ip -n "$ns" link set "${MH_PREFIX}e$i" name eth0
    ip -n "$ns" addr add "$(mh_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$MH_SWITCH" link set "$(mh_port "$i")" master br0
    ip -n "$MH_SWITCH" link set "$(mh_port "$i")" up
  done
  MH_HOSTS=$n
  # The bridge forwards at once (STP off); check that every host reaches the next.
  for (( i = 0; i < n && n > 1; i++ )); do
    mh_reachable "$i" $(( (i + 1) % n )) 5 ||
      { mh_log "host$i cannot reach host$(( (i + 1) % n ))"; return 1; }
  done
}

# mh_reachable FROM TO [SECONDS]: whether host FROM gets an answer from host TO within SECONDS
# (default 1): a TCP connect to a closed port, answered by a reset when the path works (no ping
# here: iputils is not installed, and no listener is needed).
mh_reachable() {
  ip netns exec "$(mh_ns "$1")" python3 - "$(mh_addr "$2")" "${3:-1}" <<'PY'
import socket, sys, time
addr, budget = sys.argv[1], float(sys.argv[2])
deadline = time.time() + budget
while time.time() < deadline:
    s = socket.socket()
    s.settimeout(max(0.05, min(0.5, deadline - time.time())))
    try:
        s.connect((addr, 9))
        sys.exit(0)
    except ConnectionRefusedError:
        sys.exit(0)
    except OSError:
        time.sleep(0.05)
    finally:
        s.close()
sys.exit(1)
PY
}

# mh_run I CMD...: runs CMD in host I: its network namespace and a UTS namespace named host<I>.
# The environment is passed through. Output goes where the caller's goes.
mh_run() {
  local i=$1; shift
  ip netns exec "$(mh_ns "$i")" unshare --uts -- \
    /bin/sh -c 'hostname "$0" && exec "$@"' "$(mh_hostname "$i")" "$@"
}

# mh_link I up|down: plugs / unplugs host I's cable (its switch port).
mh_link() {
  ip -n "$MH_SWITCH" link set "$(mh_port "$1")" "$2"
}

# mh_shape I rate=R [burst=B]: host I's link limited to R (tc units: 1gbit, 100mbit) in both
# directions with tbf (the host's egress on eth0, its ingress as the switch port's egress).
# mh_shape I none: removes it.
mh_shape() {
  local i=$1; shift
  local rate="" burst=""
  for kv in "$@"; do
    case $kv in
      none) rate=none ;;
      rate=*) rate=${kv#rate=} ;;
      burst=*) burst=${kv#burst=} ;;
      *) echo "mh_shape: unknown setting '$kv' (rate=R [burst=B] | none)" >&2; return 1 ;;
    esac
  done
  [[ -n $rate ]] || { echo "mh_shape: rate=R or none" >&2; return 1; }
  local ns dev
  for side in host switch; do
    if [[ $side == host ]]; then ns=$(mh_ns "$i") dev=eth0; else ns=$MH_SWITCH dev=$(mh_port "$i"); fi
    ip netns exec "$ns" tc qdisc del dev "$dev" root 2>/dev/null || true
    [[ $rate == none ]] && continue
    # burst: at least one 10 ms of data at the rate (tbf needs burst >= rate / HZ).
    ip netns exec "$ns" tc qdisc add dev "$dev" root tbf rate "$rate" \
      burst "${burst:-256kb}" latency 100ms
  done
}

# mh_swtables ARGS...: iptables in the switch's namespace (-w: wait for the xtables lock).
mh_swtables() { ip netns exec "$MH_SWITCH" iptables -w "$@"; }

# mh__impair_chains: makes sure the switch has the impairment chains. The bridge passes IPv4
# through iptables' FORWARD hook (br_netfilter); what a host sends (in on its port) meets the
# mangle table's chains, what it receives (out on its port) the filter table's, each in the order
# mh_drop, mh_loss, mh_delay. Two tables because a queued packet's ACCEPT ends its table: a packet
# between two delayed hosts is held by the sender's delay (mangle), then by the receiver's (filter).
mh__impair_chains() {
  mh_swtables -t mangle -L mh_drop -n >/dev/null 2>&1 && return 0
  ip netns exec "$MH_SWITCH" sh -c "echo 1 >/proc/sys/net/bridge/bridge-nf-call-iptables"
  local t c
  for t in mangle filter; do
    for c in mh_drop mh_loss mh_delay; do
      mh_swtables -t "$t" -N "$c"
      mh_swtables -t "$t" -A FORWARD -j "$c"
    done
  done
}

# mh__impair I CHAIN [TARGET...]: replaces host I's rules in CHAIN by one per direction that
# sends its packets to TARGET (none: removes them).
mh__impair() {
  local i=$1 chain=$2; shift 2
  local port rule t
  port=$(mh_port "$i")
  mh__impair_chains
  for t in mangle filter; do
    while read -r -a rule; do
      [[ ${#rule[@]} -gt 0 ]] && mh_swtables -t "$t" -D "${rule[@]:1}"
    done < <(mh_swtables -t "$t" -S "$chain" | grep -E -- "--physdev-(in|out) $port( |\$)" || true)
  done
  (( $# )) || return 0
  mh_swtables -t mangle -A "$chain" -m physdev --physdev-in "$port" "$@"
  mh_swtables -t filter -A "$chain" -m physdev --physdev-out "$port" "$@"
}

# mh_loss I PCT: drops PCT percent (0..100) of host I's packets at random, independently in each
# direction (what it sends and what it receives). mh_loss I 0: none.
mh_loss() {
  local i=$1 pct=$2
  awk -v p="$pct" 'BEGIN { exit !(p ~ /^[0-9]+(\.[0-9]+)?$/ && p >= 0 && p <= 100) }' ||
    { echo "mh_loss: a percentage 0..100, got '$pct'" >&2; return 1; }
  if awk -v p="$pct" 'BEGIN { exit !(p > 0) }'; then
    mh__impair "$i" mh_loss -m statistic --mode random \
      --probability "$(awk -v p="$pct" 'BEGIN { printf "%.6f", p / 100 }')" -j DROP
  else
    mh__impair "$i" mh_loss
  fi
}

# mh_drop I on|off: every packet host I sends or receives vanishes (on), or none does (off).
# Unlike mh_link down, host I's link stays up and its sends succeed: peers see only silence.
mh_drop() {
  case $2 in
    on) mh__impair "$1" mh_drop -j DROP ;;
    off) mh__impair "$1" mh_drop ;;
    *) echo "mh_drop: on or off, got '$2'" >&2; return 1 ;;
  esac
}

# mh_delay I MS: holds every packet host I sends or receives for MS milliseconds (an integer),
# in order: netdelay, in the switch's namespace, reading NFQUEUE I. At most MH_DELAY_QUEUE
# packets (default 1000) wait at once, the rest are dropped, as by a full link buffer.
# mh_delay I 0: no delay (packets waiting are released at once). Each run's log (counts, on
# exit): ${MH_LOGDIR:-$TEST_TMPDIR}/netdelay.<run>.host<I>.log.
mh_delay() {
  local i=$1 ms=$2
  [[ $ms =~ ^[0-9]+$ ]] || { echo "mh_delay: milliseconds (an integer), got '$ms'" >&2; return 1; }
  mh__impair "$i" mh_delay
  if [[ -n ${MH_DELAYER[$i]:-} ]]; then
    kill -TERM "${MH_DELAYER[$i]}" 2>/dev/null || true
    wait "${MH_DELAYER[$i]}" 2>/dev/null || true
    unset "MH_DELAYER[$i]"
  fi
  (( ms > 0 )) || return 0
  [[ -x $MH_NETDELAY ]] || { echo "mh_delay: no netdelay at '$MH_NETDELAY' (set MH_NETDELAY)" >&2; return 1; }
  MH_DELAY_RUNS=$(( MH_DELAY_RUNS + 1 ))
  local log="${MH_LOGDIR:-${TEST_TMPDIR:-/tmp}}/netdelay.$MH_DELAY_RUNS.host$i.log" ready="" t
  # It prints "ready" once bound to the queue; only then the rules go in (a queue nobody reads
  # drops). The switch's namespace: there host I's packets are no longer charged to the sending
  # socket, so holding them does not stall TCP's small-queue limit (as the host's OUTPUT would).
  ip netns exec "$MH_SWITCH" "$MH_NETDELAY" --queue="$i" --delay_ms="$ms" \
    --max_queue="${MH_DELAY_QUEUE:-1000}" >"$log" 2>&1 &
  MH_DELAYER[$i]=$!
  for (( t = 0; t < 100; t++ )); do
    grep -q '^ready$' "$log" 2>/dev/null && { ready=1; break; }
    kill -0 "${MH_DELAYER[$i]}" 2>/dev/null || break
    sleep 0.05
  done
  [[ -n $ready ]] || { mh_log "netdelay for host$i did not start: $(cat "$log")"; return 1; }
  mh__impair "$i" mh_delay -j NFQUEUE --queue-num "$i"
}

# mh_tx_bytes I: bytes host I has sent on its link so far (eth0's counter).
mh_tx_bytes() {
  ip netns exec "$(mh_ns "$1")" cat /sys/class/net/eth0/statistics/tx_bytes
}

# mh_fs_launch I PORT HANG_S [VAR=VALUE...] FS_LAUNCH_ARGS...: runs $FS_LAUNCH (the caller's
# path to //launch:fs_launch) in host I as node I of a job over all MH_HOSTS hosts, the job store
# on host0's address and PORT, with VAR=VALUE added to its environment, under
# `timeout -k 5 HANG_S`; FS_LAUNCH_ARGS (the other launcher flags, --, the program and its
# arguments) follow. In the foreground: callers start one per host with & and redirect its output.
mh_fs_launch() {
  local i=$1 port=$2 hang_s=$3; shift 3
  local vars=()
  while [[ $# -gt 0 && $1 =~ ^[A-Za-z_][A-Za-z0-9_]*= ]]; do vars+=("$1"); shift; done
  mh_run "$i" env ${vars[@]+"${vars[@]}"} timeout -k 5 "$hang_s" "$FS_LAUNCH" \
      --nnodes="$MH_HOSTS" --node_rank="$i" --master_addr="$(mh_addr 0)" --master_port="$port" "$@"
}

# mh_pids I: the processes running in host I's network namespace.
mh_pids() { ip netns pids "$(mh_ns "$1")" 2>/dev/null || true; }

# mh_cleanup: kills every process in the hosts and the switch (the delayers), deletes the
# namespaces and their /etc/netns files.
# Idempotent; runs from the trap on every exit path.
mh_cleanup() {
  local ns p
  for ns in "${MH_CREATED[@]}"; do
    for p in $(ip netns pids "$ns" 2>/dev/null); do kill -KILL "$p" 2>/dev/null || true; done
  done
  for ns in "${MH_CREATED[@]}"; do
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "/etc/netns/$ns"
  done
  MH_CREATED=()
  MH_DELAYER=()
  MH_HOSTS=0
}
