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
#
# Requires root (CAP_NET_ADMIN, CAP_SYS_ADMIN): ip (iproute2), unshare, tc.

# Bazel's test PATH (/bin:/usr/bin:/usr/local/bin) lacks the sbin directories of ip and tc.
export PATH="$PATH:/usr/sbin:/sbin"
MH_PREFIX=${MH_PREFIX:-fs$$}
MH_HOSTS=0
MH_SUBNET=10.77.0
MH_SWITCH="${MH_PREFIX}sw"
MH_CREATED=()

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

# mh_tx_bytes I: bytes host I has sent on its link so far (eth0's counter).
mh_tx_bytes() {
  ip netns exec "$(mh_ns "$1")" cat /sys/class/net/eth0/statistics/tx_bytes
}

# mh_pids I: the processes running in host I's network namespace.
mh_pids() { ip netns pids "$(mh_ns "$1")" 2>/dev/null || true; }

# mh_cleanup: kills every process in the hosts, deletes the namespaces and their /etc/netns files.
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
  MH_HOSTS=0
}
